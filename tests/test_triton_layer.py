"""The Triton layer as a whole (attention="triton": the fused products of `triton_linear`, the
paged-attention kernel and the fused head): the reference's tokens, a row's logits the same bits
alone, verified and in a batch, and bf16 speculation equal to full depth bit for bit. On a CPU the
kernels run in Triton's interpreter; on a GPU they run compiled (`scripts/gpu_check.sh`'s tests
step), where these tests compare the bits the device computes."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eejax
from eejax.config import LlamaConfig
from eejax.kernels import triton_linear
from eejax.models import llama
from tests.helpers import random_prompts
from tests.test_batch_invariance import NEW, ROWS, logits_four_ways

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_the_triton_layer_decodes_a_tiny_llama_as_the_reference_does(tiny_model, monkeypatch):
    """attention="triton" runs the decode layer's products as the fused kernels (RMSNorm + q, k
    and v in one launch; o + residual; RMSNorm + gate/up + SiLU·mul; down + residual) and the
    final norm + head as one, in prefill, decode steps and speculation rounds: the same tokens as
    the reference path."""
    forms = []

    def spy(x, ws, **kw):
        forms.append((len(ws), *sorted(k for k, v in kw.items() if v is not None and k not in ("eps", "interpret"))))
        return triton_linear.fused_linears(x, ws, **kw)

    monkeypatch.setattr(llama, "fused_linears", spy)
    monkeypatch.setattr(llama, "fused_linear", lambda x, w, **kw: spy(x, [w], **kw)[0])
    model = eejax.Model(tiny_model.config, tiny_model.params)  # its own programs: traced here, with the spy
    prompts = random_prompts(3, [5, 12, 9], seed=11)
    kw = dict(max_new_tokens=4, ignore_eos=True)
    want = eejax.generate(model, prompts, attention="reference", **kw).tokens
    assert not forms  # the reference path takes XLA's products
    assert eejax.generate(model, prompts, attention="triton", spec="1:2", **kw).tokens == want
    head = (1, "norm_weight", "out_dtype", "transposed")  # this model's head is untied: [D, V]
    assert set(forms) == {(3, "norm_weight"), (1, "residual"), (1, "norm_weight", "w_up"), head}


def test_a_draft_heads_layer_runs_the_fused_products_and_drafts_stay_lossless(tiny_model, monkeypatch):
    """With the Triton layer a draft head's layer takes the fused products too (as the model's
    layers do), and draft:2 gives full depth's tokens."""
    from eejax.models import draft_head
    from tests.test_draft_head import with_draft

    triton_passes = []  # per DecoderLayer the draft head builds: whether it is the Triton layer

    def recorded(config, *args, **kw):
        triton_passes.append(kw.get("triton", False))
        return llama.DecoderLayer(config, *args, **kw)

    monkeypatch.setattr(draft_head, "DecoderLayer", recorded)
    drafted = with_draft(tiny_model)
    model = eejax.Model(drafted.config, drafted.params)  # its own programs: traced here, with the spy
    prompts = random_prompts(2, [5, 9], seed=3)
    kw = dict(max_new_tokens=6, ignore_eos=True, attention="triton")
    want = eejax.generate(model, prompts, **kw).tokens
    assert eejax.generate(model, prompts, spec="draft:2", **kw).tokens == want
    # (its module's own setup builds one plain layer; the draft passes build theirs as the Triton layer)
    assert triton_passes.count(True) > 0, triton_passes


def test_the_triton_layers_bf16_logits_do_not_depend_on_the_rows_beside_it():
    """The GPU's Triton layer (attention="triton": the fused products with q and k rotated in their
    launch, the paged-attention kernel and the fused head, here in Triton's interpreter) on bf16
    weights and a bf16 cache: a row's logits are the same bits alone, verified, in a batch and as a
    batch's verify pass (the GPU check compares them on a device), and close to the reference
    path's. A narrow model: the interpreter runs each program in Python."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_embeddings=True,
    )
    assert llama.rope_fuses(config)
    params = llama.with_layer_buffers(llama.init_params(config, jax.random.PRNGKey(2), scale=0.1, dtype=jnp.bfloat16))
    got = logits_four_ways(config, params, "triton", jnp.bfloat16)
    for how in ("verify", "batch", "batch verify"):
        differing = int((got[how] != got["alone"]).any(-1).sum())
        assert differing == 0, f"triton bf16, {how}: {differing} of {ROWS * NEW} positions differ from alone"
    want = logits_four_ways(config, params, "reference", jnp.bfloat16)["alone"]
    scale = np.abs(want).max()
    assert np.abs(got["alone"] - want).max() < 0.03 * scale  # bf16 rounds other intermediates


def test_bf16_speculation_on_the_triton_layer_gives_full_depths_log_probs_bit_for_bit(tiny_model):
    """bf16 weights and cache on the Triton layer: self-speculation emits full depth's tokens, and
    each token's log-prob (from a verify pass's logits there, a decode step's here) is the same
    float. Three rows at once, so a row's verify pass runs beside the others' positions."""
    from eejax.engine.engine import Engine

    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          tiny_model.params)  # fmt: skip
    model = eejax.Model(tiny_model.config, params)

    def run(spec):
        engine = Engine(model, max_slots=3, max_new_tokens=8, cache_budget="1MiB", page_size=8, attention="triton")
        seqs = [engine.submit(p, max_new_tokens=8, logprobs=0, spec=spec) for p in random_prompts(3, [5, 12, 9], 11)]
        engine.run()
        return [(s.tokens, s.token_logprobs) for s in seqs]

    want = run(None)
    assert sum(len(tokens) for tokens, _ in want) > 12
    for spec in ("1:2", "2:3"):
        assert run(spec) == want, spec
