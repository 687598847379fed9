"""Every program eejax compiles, lowered for CUDA on this CPU machine (reference attention):
generate at full depth, sampling, each early-exit measure (KV fill included), self-speculation
(draft, verify, plain rounds, the adaptive policy) and T5: the engine's slot programs, which
`generate` runs (a serving engine compiles the same functions at its own slot count).

Not covered here: jax-triton's custom call, which only its CUDA jaxlib plugin can build (jax_triton
does not import without one); the kernel itself is compiled for sm_80 / sm_90 by test_triton_aot."""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import pytest

import eejax
from eejax.config import T5Config
from eejax.decode import early_exit
from eejax.decode.control_flow import argument_copies, cache_copies, control_flow
from eejax.decode.programs import ProgramCache
from eejax.decode.sampling import FILTERED
from eejax.models import exits, t5
from eejax.options import ExitConfig, LayerSkipSpec
from tests.helpers import fixed_policy_costs, random_prompts
from tests.test_speculative import tiny

PROMPTS = random_prompts(3, [5, 12, 2], vocab=60, seed=3)


def gpu_layout(model):
    """`model` with the layer layout a GPU runs (stacked; "auto" picks per-layer buffers here)."""
    return dataclasses.replace(model, layer_buffers="stacked")


# The lowering tests run in a fresh pytest process without JAX's persistent compilation cache: in
# three full-suite runs (never alone) serialising one of their executables for that cache
# segfaulted inside jaxlib, in a worker that had run other test files first.
IN_FRESH_PROCESS = os.environ.get("EEJAX_TEST_FRESH_PROCESS") == "1"
fresh_process_only = pytest.mark.skipif(not IN_FRESH_PROCESS, reason="run by test_lowering_in_a_fresh_process")


def test_lowering_in_a_fresh_process():
    if IN_FRESH_PROCESS:
        pytest.skip("this is the fresh process")
    env = {**os.environ, "EEJAX_TEST_FRESH_PROCESS": "1", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "lower_for_cuda", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def lowered_for_cuda(model) -> dict[str, list[str]]:
    """function name -> the StableHLO texts of its programs lowered for CUDA."""
    out = {}
    for name, lowered in model.programs.lower_for("cuda"):
        out.setdefault(name, []).append(lowered.as_text())
    return out


def assert_cuda_modules(texts: dict[str, list[str]], lowered_count: int):
    assert sum(map(len, texts.values())) == lowered_count
    for name, modules in texts.items():
        for text in modules:
            assert "func.func public @main" in text, name
            assert "callback" not in text, name  # no host callback (the interpreted kernel would be one)
            dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
            # float32 computes in float32 (a GPU's default is TF32: `programs.float32_matmuls`)
            assert all("precision = [HIGHEST, HIGHEST]" in line for line in dots), name


@fresh_process_only
def test_llama_programs_lower_for_cuda(monkeypatch):
    model = gpu_layout(eejax.init_exits(tiny(num_layers=4), classifier=True))
    # Rounds that never pay (a draft pass as dear as a verify): the adaptive run takes plain steps.
    fixed_policy_costs(monkeypatch, draft_pass=1.0, verify=1.0, plain=1.0)
    runs = [
        dict(),
        dict(temperature=0.8, top_k=5, seed=1),
        dict(exit="softmax:0.3"),
        dict(exit="static:2"),
        dict(exit="state:0.5"),
        dict(exit="classifier:0.5"),
        dict(spec="2:2"),
        dict(spec="1:3:adaptive", max_new_tokens=24),  # a split round, plain steps (several per program)
        dict(spec="2:2", temperature=0.7, seed=2),
    ]
    for kw in runs:
        eejax.generate(model, PROMPTS, ignore_eos=True, **{"max_new_tokens": 6, **kw})
    for static in (False, True):  # the CPU's loop structure, and the GPU's (`early_exit.static_loops`)
        monkeypatch.setattr(early_exit, "static_loops", lambda static=static: static)
        texts = lowered_for_cuda(model)
        print({name: len(modules) for name, modules in texts.items()})
        assert {
            "prefill_slots",
            "decode_slots",
            "plain_step_slots",
            "draft_slots",
            "verify_slots",
            "spec_round_slots",
        } <= set(texts)
        assert_cuda_modules(texts, model.programs.num_programs)
        assert any("stablehlo.while" in text for text in texts["decode_slots"])  # the early-exit segment loop


@fresh_process_only
def test_t5_programs_lower_for_cuda():
    c = T5Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_encoder_layers=2, num_heads=4, head_dim=8
    )
    model = gpu_layout(eejax.Model(c, t5.init_params(c, jax.random.PRNGKey(0), scale=0.3)))
    for kw in (dict(), dict(exit="softmax:0.3"), dict(spec=LayerSkipSpec(1, 2))):
        eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, **kw)
    texts = lowered_for_cuda(model)
    assert {"prefill_slots", "decode_slots", "spec_round_slots"} <= set(texts)
    assert_cuda_modules(texts, model.programs.num_programs)


@fresh_process_only
def test_quantized_programs_lower_for_cuda(monkeypatch):
    """A GPU multiplies quantized weights as XLA's product of the dequantised blocks (the CPU
    kernel is a CPU custom call): GGUF blocks with float32 and int8 activations, full depth,
    early exit (KV fill) and self-speculation lower for CUDA with no custom call of eejax's."""
    from eejax.quantized import with_activations
    from tests.test_quantized import blocks_of

    monkeypatch.setenv("EEJAX_CPU_MATMUL", "off")  # what a GPU backend traces
    base = tiny(num_layers=4)
    for activations in ("float32", "int8"):
        params = with_activations(blocks_of(base.params), activations)
        model = gpu_layout(eejax.Model(base.config, params))
        for kw in (dict(), dict(exit="softmax:0.3"), dict(spec="2:2")):
            eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, **kw)
        texts = lowered_for_cuda(model)
        assert {"prefill_slots", "decode_slots", "spec_round_slots"} <= set(texts)
        assert_cuda_modules(texts, model.programs.num_programs)
        assert not any("eejax_" in text for modules in texts.values() for text in modules)


# (exit, data-dependent loops of the GPU's structure): the segment loop, and the layer loop of
# the segments' layers beyond the shortest segment's (none when the segments are equally long)
EXIT_OPTIONS = [
    (ExitConfig("softmax", threshold=0.05, decay=None, head="full"), 1),  # checks after every layer
    (ExitConfig("state", threshold=0.5), 1),
    (ExitConfig("classifier", threshold=0.5, exit_layers=(2, 4, 6)), 1),  # segments of 2
    (ExitConfig("softmax", threshold=0.05, decay=None, head="reduced", exit_layers=(2, 3, 5)), 2),
]


@pytest.mark.parametrize(("exit_config", "gpu_loops"), EXIT_OPTIONS, ids=["softmax", "state", "classifier", "reduced"])
def test_static_loops_keep_the_tokens_and_cut_the_gpu_round_trips(monkeypatch, exit_config, gpu_loops):
    # On GPU a while iteration or a conditional costs a host round trip, a loop of known trip
    # count none. With `static_loops` (the GPU's choice) KV fill and the layers every segment
    # has run in loops of known trip count, and the reduced check has no conditional: fewer
    # data-dependent loops, same tokens and exit layers.
    base = eejax.init_exits(tiny(num_layers=8), classifier=True)
    base = dataclasses.replace(base, params=exits.set_exit_vocab(base.params, range(0, 64, 2), tied=False))
    results, flows = {}, {}
    for static in (False, True):
        monkeypatch.setattr(early_exit, "static_loops", lambda static=static: static)
        model = eejax.Model(base.config, base.params, layer_buffers="stacked")  # its own program cache, a GPU's layout
        results[static] = eejax.generate(model, PROMPTS, max_new_tokens=6, ignore_eos=True, exit=exit_config)
        flows[static] = [
            (control_flow(p.as_text()), options.num_steps)
            for name, options, p in model.programs.entries()
            if name == "decode_slots"
        ]
    assert results[True].tokens == results[False].tokens
    assert results[True].exit_layers == results[False].exit_layers
    assert min(map(min, results[True].exit_layers)) < 8  # some steps exit early: KV fill runs
    print(exit_config.measure, flows)
    for (loops, steps), (static, _) in zip(flows[False], flows[True]):
        # traced: the segment loop, its layer loop, KV fill (and the steps', which ends once every row is done)
        assert (loops.dynamic_loops, static.dynamic_loops) == (3 + (steps > 1), gpu_loops)
        assert static.conditionals == loops.conditionals - (exit_config.head == "reduced")  # the check's


def test_full_depth_static_exit_and_speculation_have_no_host_round_trips():
    """No loop of unknown trip count but that of a program's steps or rounds (on a CPU it ends
    once every row is done; on a GPU its trip count is known: next test); one conditional, in a
    draft with the bonus pass (the head skipped on the pass that only fills the draft layers'
    cache: a known round trip), alone or in a whole round; and, on a CPU only, one where the
    filtered sampler skips its sort when no row filters (a prefill's draw and its log-probs)."""
    model = gpu_layout(tiny(num_layers=4))
    for kw in (
        dict(),
        dict(exit="static:2"),
        dict(spec=LayerSkipSpec(2, 2, bonus=False)),
        dict(spec=LayerSkipSpec(2, 2, bonus=True)),
        dict(spec="1:2:adaptive"),
    ):
        eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, **kw)
    for name, options, program in model.programs.entries():
        flow = control_flow(program.as_text())
        bonus_draft = name in ("draft_slots", "spec_round_slots") and options.bonus
        sorts = (options.sampler == FILTERED) * (1 + options.logprobs)  # `sampling.filtered_logits`
        assert flow.dynamic_loops == (options.num_steps > 1), (name, options.num_steps, flow)
        assert flow.conditionals == int(bonus_draft) + sorts, (name, flow)
    assert any(options.num_steps > 1 for _, options, _ in model.programs.entries())


def test_gpu_structure_speculation_has_no_host_round_trips(monkeypatch):
    """With the GPU's structure (`early_exit.static_loops`), no speculation program has a loop of
    unknown trip count or a conditional (each a host round trip per run on a GPU): E:d with and
    without the bonus pass, adaptive, and the draft head's chain, tree, confidence stop and prompt
    lookup run fixed scans with per-row masks. Greedy tokens stay full depth's."""
    from tests.test_draft_head import with_draft

    monkeypatch.setattr(early_exit, "static_loops", lambda: True)
    model = dataclasses.replace(gpu_layout(with_draft(tiny(num_layers=4))), programs=ProgramCache())
    prompts = [*PROMPTS, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]  # a row the lookup copies from
    kw = dict(max_new_tokens=9, ignore_eos=True)
    want = eejax.generate(model, prompts, **kw).tokens
    for spec in (
        LayerSkipSpec(2, 2, bonus=False),
        LayerSkipSpec(2, 2, bonus=True),
        "1:2:adaptive",
        "draft:3",
        "draft:3:tree",
        "draft:3:stop=0.4",
        "draft:3:lookup",
    ):
        assert eejax.generate(model, prompts, spec=spec, **kw).tokens == want, spec
    for name, options, program in model.programs.entries():
        flow = control_flow(program.as_text())
        assert flow.dynamic_loops == 0 and flow.conditionals == 0, (name, options.spec, flow)


@pytest.mark.parametrize("layout", ["stacked", "split"])
def test_no_program_copies_the_kv_cache(layout):
    """Every program that full depth, exit steps, self-speculation (plain and adaptive) and their
    prefills compile updates the paged cache in place: no copy in its HLO moves a layer's worth
    of the cache (the GPU issue's suspect for slow rounds, checked on the CPU). The engine's
    decode programs (steps, rounds, plain steps) do not copy their arguments in: the state and
    counters they return are donated, as the cache is."""
    model = dataclasses.replace(tiny(num_layers=4), layer_buffers=layout)
    c = model.config
    for kw in (dict(), dict(exit="softmax:0.5"), dict(spec="2:2"), dict(spec="1:2:adaptive")):
        eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, page_size=8, **kw)
    assert model.programs.num_programs >= 4
    cache = re.compile(rf"f32\[{c.num_layers},{c.num_kv_heads},(\d+),8,{c.head_dim}\]")  # [L, Hkv, P, S, Dh]
    for name, _, program in model.programs.entries():
        text = program.as_text()
        pages = {int(p) for p in cache.findall(text)}
        assert len(pages) == 1, (name, pages)  # the cache is there, one size
        assert cache_copies(text, c.num_kv_heads * pages.pop() * 8 * c.head_dim) == 0, name
        if name in ("decode_slots", "spec_round_slots", "plain_step_slots"):
            # a plain step keeps its rows' generated counts from before its loop (what it counts)
            assert argument_copies(text) == (name == "plain_step_slots"), name
    assert {"decode_slots", "spec_round_slots", "plain_step_slots"} <= {n for n, _, _ in model.programs.entries()}


def test_cache_copies_sees_an_update_that_is_not_in_place():
    """The check above can fail: an update of an input that is also returned as it was is a copy."""
    cache = jax.numpy.zeros((4, 2, 9, 8, 8))
    layer = 2 * 9 * 8 * 8
    kept = jax.jit(lambda c: (c.at[:, :, 0].set(1.0), c + 0 * c.sum())).lower(cache).compile()
    donated = jax.jit(lambda c: c.at[:, :, 0].set(1.0), donate_argnums=0).lower(cache).compile()
    assert cache_copies(kept.as_text(), layer) == 1 and cache_copies(donated.as_text(), layer) == 0


def test_argument_copies_sees_an_argument_a_loop_updates_without_donation():
    """A loop that updates an argument copies it in first unless it is donated."""

    def steps(x):
        return jax.lax.fori_loop(0, jax.numpy.asarray(3) + x[0].astype(int) * 0, lambda i, x: x.at[i].add(1), x)

    x = jax.numpy.zeros((8,), int)
    assert argument_copies(jax.jit(steps).lower(x).compile().as_text()) == 1
    assert argument_copies(jax.jit(steps, donate_argnums=0).lower(x).compile().as_text()) == 0
