"""eejax's programs compiled by XLA:GPU for an H100 on this CPU machine (no device:
`eejax.kernels.gpu_targets`, `ProgramCache.compile_for`), and the count of the kernels a compiled
GPU program launches (`control_flow.kernel_launches`).

The compilations run in a fresh process through `scripts/gpu_compiler.sh`, which makes jax's
CUDA plugin importable (installing it into .cache/gpu-compiler on first use); the rest of the
suite never loads it."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import eejax
from eejax.config import LlamaConfig
from eejax.decode.control_flow import kernel_launches
from eejax.errors import EejaxError
from eejax.kernels.gpu_targets import compile_only_device
from eejax.models import llama
from tests.test_gpu_lowering import PROMPTS, gpu_layout
from tests.test_speculative import tiny

ROOT = Path(__file__).resolve().parents[1]
IN_COMPILER = os.environ.get("EEJAX_TEST_GPU_COMPILER") == "1"
in_compiler_only = pytest.mark.skipif(not IN_COMPILER, reason="run by test_compiles_for_a_gpu_without_one")

LOOP_HLO = """HloModule m

%fused_exp (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_exp
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[4]{0}) tuple(%n, %f)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (x: f32[4], cache: f32[1024]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %cache = f32[1024]{0} parameter(1)
  %copy = f32[4]{0} copy(%x)
  %update_in_place = f32[1024]{0} dynamic-update-slice(%cache, %x, %zero)
  %zero = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%zero, %copy)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_kernel_launches_counts_each_loop_iteration_and_what_it_writes():
    k = kernel_launches(LOOP_HLO)
    # the copy, the update in place; 5 x (compare + fusion + add) and the last compare
    assert k.total == 2 + 5 * 3 + 1
    assert k.loops == ((5, 3),) and k.dynamic_loops == 0
    assert k.written_bytes == 16 + 5 * (1 + 16 + 4) + 1  # the update in place writes a slice: not counted
    unknown = kernel_launches(LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', ""))
    assert unknown.loops == ((None, 3),) and unknown.dynamic_loops == 1 and unknown.total == 2 + 3 + 1


def test_a_custom_calls_outputs_that_alias_its_operands_are_updates_in_place():
    """A Triton kernel that writes the KV cache's new slots (jax-triton's input-output aliases)
    writes its other outputs only."""
    hlo = LOOP_HLO.replace(
        "  %copy = f32[4]{0} copy(%x)\n",
        '  %k = (f32[4]{0}, f32[1024]{0}) custom-call(%x, %cache), custom_call_target="triton_kernel_call", '
        "output_to_operand_aliasing={{1}: (1, {})}, api_version=API_VERSION_STATUS_RETURNING\n"
        "  %copy = f32[4]{0} get-tuple-element(%k), index=0\n",
    )
    plain = kernel_launches(LOOP_HLO)
    aliased = kernel_launches(hlo)
    assert aliased.total == plain.total  # the call replaced the copy: one kernel either way
    assert aliased.written_bytes == plain.written_bytes  # 16 bytes of x, not the 4 KB cache


def test_kernel_launches_reads_a_compiled_program():
    """The counter reads XLA's real output too: a fori_loop's trip count and its body."""
    step = jax.jit(lambda x: jax.lax.fori_loop(0, 7, lambda i, x: jnp.sin(x) * 2.0, x))
    k = kernel_launches(step.lower(jnp.ones(8)).compile().as_text())
    assert [trips for trips, _ in k.loops] == [7] and k.total >= 7


def test_compile_only_device_says_what_it_needs():
    with pytest.raises(EejaxError, match="gpu_compiler.sh"):
        compile_only_device("h100")
    with pytest.raises(EejaxError, match="unknown GPU target 'a100'"):
        compile_only_device("a100")


def test_compiles_for_a_gpu_without_one():
    if IN_COMPILER:
        pytest.skip("this is the compiler's process")
    # Triton compiled, not interpreted: the Triton layer's kernels lower through jax-triton there
    env = {**os.environ, "EEJAX_TEST_GPU_COMPILER": "1", "PYTHON": sys.executable, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "for_an_h100", __file__]
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_compiler.sh"), *command],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


# A model whose products XLA does not fuse whole (a tiny one's it does), with heads of 64 (the
# Triton layer rotates q and k in their launch)
WIDE = LlamaConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=256,
)


def compiled_for_h100(model, names=None) -> dict[str, list[str]]:
    """function name -> the optimised HLO of its programs compiled for an H100."""
    out: dict[str, list[str]] = {}
    for name, compiled in model.programs.compile_for(compile_only_device("h100"), names):
        out.setdefault(name, []).append(compiled.as_text())
    return out


@in_compiler_only
def test_programs_compile_for_an_h100_as_a_gpu_traces_them():
    """Full depth, self-speculation and early exit compile for sm_90, traced as a GPU traces them:
    XLA's attention and products, the GPU's static loops (no data-dependent loop in a step or a
    round, which a CPU trace has: `early_exit.static_loops`)."""
    model = gpu_layout(tiny(num_layers=4))
    for kw in (dict(), dict(spec="2:2"), dict(exit="softmax:0.3")):
        eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, **kw)
    texts = compiled_for_h100(model)
    assert {"prefill_slots", "decode_slots", "spec_round_slots"} <= set(texts)
    assert sum(map(len, texts.values())) == model.programs.num_programs
    for name, hlos in texts.items():
        for text in hlos:
            assert "eejax_" not in text and "callback" not in text, name  # no CPU kernel, no host call
    assert all(kernel_launches(text).dynamic_loops == 0 for text in texts["spec_round_slots"])
    # full depth has none; early exit's segment loop is its one (the GPU's structure: control_flow)
    assert sorted(kernel_launches(text).dynamic_loops for text in texts["decode_slots"]) == [0, 1]


@in_compiler_only
def test_quantized_programs_compile_for_an_h100():
    """GGUF blocks (Q4_1 layers, a Q8_0 table) with float32 and int8 activations: full depth and
    self-speculation compile for sm_90 as XLA's products of the blocks."""
    from eejax.quantized import with_activations
    from tests.test_quantized import blocks_of

    base = tiny(num_layers=4)
    for activations in ("float32", "int8"):
        model = gpu_layout(eejax.Model(base.config, with_activations(blocks_of(base.params), activations)))
        for kw in (dict(), dict(spec="2:2")):  # early exit's KV fill runs the same products
            eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, **kw)
        texts = compiled_for_h100(model)
        assert {"prefill_slots", "decode_slots", "spec_round_slots"} <= set(texts)
        assert sum(map(len, texts.values())) == model.programs.num_programs
        assert not any("eejax_" in text for hlos in texts.values() for text in hlos)


@in_compiler_only
def test_the_rows_layout_fuses_each_product_of_a_step_compiled_for_an_h100():
    """At batch 1 XLA:GPU makes a product a multiply and a sum over D_in. From a weight as stored
    ([D_in, N]) with the RMSNorm before it, it writes the multiply out first (4 bytes a weight)
    and sums it in a second kernel; from the weight's rows (`layer_buffers="rows"`) the multiply
    fuses into the sum. (A model this size or larger: XLA fuses a tiny one's either way.)"""
    config = WIDE
    params = llama.init_params(config, jax.random.PRNGKey(0), scale=0.3)
    weight_bytes = sum(params["layers"][k].nbytes for k in llama.LINEAR_KEYS)  # float32, all layers
    launches = {}
    for layout in ("stacked", "rows"):
        model = eejax.Model(config, params, layer_buffers=layout)
        eejax.generate(model, [[3, 4, 5]], max_new_tokens=3, ignore_eos=True)
        (text,) = compiled_for_h100(model, names=("decode_slots",))["decode_slots"]
        launches[layout] = kernel_launches(text)
    (_, stacked_layer), (steps, _) = launches["stacked"].loops  # the layer loop, then the steps'
    (_, rows_layer), _ = launches["rows"].loops
    assert rows_layer < stacked_layer
    assert launches["stacked"].written_bytes / steps > 0.8 * weight_bytes
    assert launches["rows"].written_bytes / steps < 0.2 * weight_bytes


@in_compiler_only
def test_the_triton_layer_compiles_for_an_h100_as_its_kernels():
    """The programs that ran here (XLA's layer) traced again as the Triton layer
    (`compile_for(attention="triton")`) compile for sm_90 through jax-triton, given the target's
    compute capability: a step is each layer's five Triton kernels (q/k/v with the rotation,
    attention, o, gate/up, down) and the head's, with fewer launches than XLA's layer."""
    config = WIDE
    model = eejax.Model(config, llama.init_params(config, jax.random.PRNGKey(0), scale=0.3), layer_buffers="split")
    eejax.generate(model, [[3, 4, 5]], max_new_tokens=3, ignore_eos=True)
    device = compile_only_device("h100")
    (_, xla), (_, triton) = (
        model.programs.compile_for(device, names=("decode_slots",), attention=a)[0] for a in (None, "triton")
    )
    text = triton.as_text()
    calls = [line for line in text.splitlines() if "custom-call(" in line and "triton_kernel_call" in line]
    assert len(calls) == 5 * config.num_layers + 1
    assert kernel_launches(text).total < kernel_launches(xla.as_text()).total
