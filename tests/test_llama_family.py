"""The HF model types that are a Llama with a setting (`LlamaConfig`): Qwen2 (q/k/v biases), Qwen3
(RMSNorm on each head of q and k) and Mistral (a sliding attention window, here 6 positions:
shorter than the prompts). Tiny random transformers checkpoints, converted by `eejax convert`:
logits and greedy tokens equal transformers', and lossless modes equal their own full depth."""

import jax
import numpy as np
import pytest
import torch

import eejax
from eejax.config import LlamaConfig
from eejax.errors import UnsupportedModelError
from eejax.models import draft_head, llama
from tests.helpers import random_prompts
from tests.test_llama_hf import eejax_logits, hf_greedy, hf_logits

WINDOW = 6
COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_hf(model_type: str, seed: int = 0):
    """A tiny random HF model of `model_type` (fp32), its norms and biases random too, so that one
    dropped or misplaced shows."""
    import transformers

    if model_type == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.MistralConfig(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False)
        cls = transformers.MistralForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_tokenizer):
    """model type -> (HF model, converted eejax model)."""
    from conversion import convert

    root = tmp_path_factory.mktemp("family")
    out = {}
    for model_type in ("qwen2", "qwen3", "mistral"):
        hf = make_hf(model_type)
        hf.save_pretrained(root / f"hf-{model_type}")
        tiny_tokenizer.save_pretrained(root / f"hf-{model_type}")
        path = convert(root / f"hf-{model_type}", root / f"eejax-{model_type}", progress=False)
        out[model_type] = (hf, eejax.load(path))
    return out


def test_the_configs_say_what_differs(family):
    qwen2, qwen3, mistral = (family[t][1].config for t in ("qwen2", "qwen3", "mistral"))
    assert (qwen2.model_type, qwen2.qkv_bias, qwen2.qk_norm, qwen2.sliding_window) == ("qwen2", True, False, None)
    assert (qwen3.model_type, qwen3.qkv_bias, qwen3.qk_norm, qwen3.sliding_window) == ("qwen3", False, True, None)
    assert (mistral.model_type, mistral.sliding_window) == ("mistral", WINDOW)
    assert {"bq", "bk", "bv"} <= set(family["qwen2"][1].params["layers"])
    assert {"q_norm", "k_norm"} <= set(family["qwen3"][1].params["layers"])


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_logits_and_greedy_tokens_match_transformers(family, model_type):
    """A paged prefill and 8 decode steps give transformers' logits (prompts up to 17 tokens:
    Mistral's later positions see only their window); `generate` gives its greedy tokens."""
    hf, model = family[model_type]
    prompts = random_prompts(3, [5, 17, 11], seed=1)
    rng = np.random.default_rng(2)
    continuations = [rng.integers(3, 300, 8).tolist() for _ in prompts]
    prefill, decode = eejax_logits(model, prompts, continuations, page_size=4)
    for i, (p, cont) in enumerate(zip(prompts, continuations)):
        want = hf_logits(hf, p + cont)
        np.testing.assert_allclose(prefill[i, : len(p)], want[: len(p)], atol=1e-4, rtol=0, err_msg=f"prefill row {i}")
        np.testing.assert_allclose(decode[i], want[len(p) : len(p) + 8], atol=1e-4, rtol=0, err_msg=f"decode row {i}")
    res = eejax.generate(model, prompts, max_new_tokens=16, ignore_eos=True, page_size=4)
    for i, p in enumerate(prompts):
        assert res.tokens[i] == hf_greedy(hf, p, 16), f"row {i}"
    # the training forward (dense attention, no cache) too
    ids = prompts[1] + continuations[1]
    dense = llama.Llama(model.config).apply({"params": model.params}, np.array([ids], np.int32), np.array([len(ids)]))
    np.testing.assert_allclose(np.asarray(dense)[0], hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_lossless_modes_equal_full_depth(family, model_type):
    """Self-speculation and a draft head (random, so that it is often wrong) give full depth's
    tokens; early exit that never exits too, with its KV fill."""
    _, model = family[model_type]
    prompts = random_prompts(3, [4, 19, 9], seed=5)
    kw = dict(max_new_tokens=20, ignore_eos=True, page_size=4)
    full = eejax.generate(model, prompts, **kw).tokens
    assert eejax.generate(model, prompts, spec="1:3", **kw).tokens == full
    assert eejax.generate(model, prompts, exit="softmax:inf", **kw).tokens == full
    draft = draft_head.init_draft(model.config, jax.random.PRNGKey(0), params=model.params)
    drafted = model.with_params({**model.params, "draft": draft})
    assert eejax.generate(drafted, prompts, spec="draft:3", **kw).tokens == full


def test_a_window_on_some_layers_only_is_refused():
    hf = {
        **COMMON,
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    }
    with pytest.raises(UnsupportedModelError, match="some layers only"):
        LlamaConfig.from_hf(hf)
    assert LlamaConfig.from_hf({**hf, "max_window_layers": 0}).sliding_window == 8
    assert LlamaConfig.from_hf({**hf, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(UnsupportedModelError, match="gemma"):
        LlamaConfig.from_hf({**COMMON, "model_type": "gemma"})
