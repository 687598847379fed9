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
from tests.helpers import TINY_SIZES, random_prompts
from tests.test_llama_hf import eejax_logits, hf_greedy, hf_logits

WINDOW = 6
COMMON = dict(**TINY_SIZES, num_attention_heads=4, num_key_value_heads=2)


def make_hf(model_type: str, seed: int = 0, head_dim: int = 16):
    """A tiny random HF model of `model_type` (fp32), its norms and biases random too, so that one
    dropped or misplaced shows."""
    import transformers

    if model_type == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, head_dim=head_dim, tie_word_embeddings=False)
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


def write_gguf(hf, tokenizer, path, arch: str):
    """hf (a tiny Qwen2 / Qwen3) written as llama.cpp writes such a file: its attention matrices in
    Q8_0 blocks, its MLP's in Q4_1, the embedding Q8_0, norms and biases F32, Q and K unpermuted,
    the tokenizer a GPT-2 BPE vocabulary with its merges."""
    import json

    import gguf

    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if arch == "qwen3":
        writer.add_uint32(f"{arch}.attention.key_length", c.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    tokens += [f"<extra_{i}>" for i in range(c.vocab_size - len(tokens))]  # the embedding's rows past the BPE's
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t.startswith("<") else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    for key, value in (("bos_token_id", 1), ("eos_token_id", 2), ("padding_token_id", 0)):
        writer.add_uint32(f"tokenizer.ggml.{key}", value)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}

    def add(name, w, kind=None):
        if kind is None:
            writer.add_tensor(name, w)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], "Q8_0")
    add("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state and not c.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"], "Q8_0")
    for i in range(c.num_hidden_layers):
        layer = f"model.layers.{i}."
        for ours, theirs, kind in (
            ("attn_norm.weight", "input_layernorm.weight", None),
            ("attn_q.weight", "self_attn.q_proj.weight", "Q8_0"),
            ("attn_k.weight", "self_attn.k_proj.weight", "Q8_0"),
            ("attn_v.weight", "self_attn.v_proj.weight", "Q8_0"),
            ("attn_output.weight", "self_attn.o_proj.weight", "Q8_0"),
            ("attn_q.bias", "self_attn.q_proj.bias", None),
            ("attn_k.bias", "self_attn.k_proj.bias", None),
            ("attn_v.bias", "self_attn.v_proj.bias", None),
            ("attn_q_norm.weight", "self_attn.q_norm.weight", None),
            ("attn_k_norm.weight", "self_attn.k_norm.weight", None),
            ("ffn_norm.weight", "post_attention_layernorm.weight", None),
            ("ffn_gate.weight", "mlp.gate_proj.weight", "Q4_1"),
            ("ffn_up.weight", "mlp.up_proj.weight", "Q4_1"),
            ("ffn_down.weight", "mlp.down_proj.weight", "Q4_1"),
        ):
            if layer + theirs in state:
                add(f"blk.{i}.{ours}", state[layer + theirs], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_gguf_files_of_qwens_read_as_transformers_reads_them(family, tiny_tokenizer, tmp_path, model_type):
    """A Qwen2 / Qwen3 .gguf file: converted dequantised (no torch), its logits are transformers'
    reading of the file; kept as its blocks (`--quantization gguf`), its greedy tokens are too. (The
    Qwen3 has Qwen3's usual head size, 128: transformers' GGUF reader takes that default, not the
    file's key length, which eejax reads.)"""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from conversion import convert

    path = tmp_path / f"tiny-{model_type}.gguf"
    hf = family[model_type][0] if model_type == "qwen2" else make_hf("qwen3", head_dim=128)
    write_gguf(hf, tiny_tokenizer, path, model_type)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    floats = eejax.load(convert(path, tmp_path / "float", progress=False))
    blocks = eejax.load(convert(path, tmp_path / "blocks", quantization="gguf", progress=False))
    assert floats.config.model_type == model_type and floats.config.qkv_bias == (model_type == "qwen2")
    prompts = random_prompts(2, [5, 13], seed=7)
    prefill, _ = eejax_logits(floats, prompts, [[3] * 8] * 2, page_size=4)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(prefill[i, : len(p)], hf_logits(reference, p), atol=1e-4, rtol=0)
    kw = dict(max_new_tokens=12, ignore_eos=True, page_size=4)
    want = [hf_greedy(reference, p, 12) for p in prompts]
    assert eejax.generate(floats, prompts, **kw).tokens == want
    assert eejax.generate(blocks, prompts, **kw).tokens == want


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_exit_training_runs_on_the_family(family, model_type):
    """`train-exits`' loop on a Qwen2 (biases) and a Mistral (its window in the training forward):
    the distillation loss falls."""
    from eejax.train.data import sequence_batches
    from eejax.train.loop import train_exit_adapters

    model = eejax.init_exits(family[model_type][1], adapter_rank=8)
    batches = sequence_batches(random_prompts(8, [12, 20, 7, 16], seed=9), 8, 32)
    _, losses, start = train_exit_adapters(model, batches, steps=30, learning_rate=1e-2, progress=False)
    assert start == 0 and float(np.mean(losses[-5:])) < 0.8 * float(np.mean(losses[:5]))


def test_draft_head_training_and_the_engine_run_on_the_family(family, tmp_path):
    """`train-draft`'s two stages on a Qwen2 (its biases in the features and in the head's layer):
    the loss falls and the trained head decodes losslessly; the serving engine runs a Mistral
    (its window) with plain, early-exit and speculative requests mixed, each row as `generate`."""
    from eejax.engine.engine import Engine
    from eejax.train.draft_features import build_feature_cache, load_feature_cache
    from eejax.train.draft_training import train_draft

    model = family["qwen2"][1]
    texts = random_prompts(8, [40, 33, 24], seed=11)
    cache = build_feature_cache(model, texts, tmp_path / "features", window=32, batch_size=4, progress=False)
    draft, losses, _ = train_draft(model, load_feature_cache(cache), steps=20, batch_size=4, progress=False)
    assert np.isfinite(losses).all() and losses[-5:].mean() < losses[:5].mean()
    drafted = model.with_params({**model.params, "draft": draft})
    prompts = random_prompts(3, [4, 19, 9], seed=5)
    kw = dict(max_new_tokens=12, ignore_eos=True, page_size=4)
    assert eejax.generate(drafted, prompts, spec="draft:2", **kw).tokens == eejax.generate(model, prompts, **kw).tokens

    mistral = family["mistral"][1]
    engine = Engine(mistral, max_slots=2, max_new_tokens=12, cache_budget="1MiB", page_size=4, ignore_eos=True)
    options = [dict(), dict(exit="static:2"), dict(spec="1:3")]
    seqs = [engine.submit(p, max_new_tokens=12, **o) for p, o in zip(prompts, options)]
    engine.run()
    for seq, p, o in zip(seqs, prompts, options):
        assert seq.tokens == eejax.generate(mistral, [p], **kw, **o).tokens[0], o
