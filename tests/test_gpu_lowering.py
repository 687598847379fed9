"""Every program eejax compiles, lowered for CUDA on this CPU machine (reference attention):
generate at full depth, sampling, each early-exit measure (KV fill included), self-speculation
(draft, verify, plain rounds, the adaptive policy), T5, and the engine's slot programs.

Not covered here: jax-triton's custom call, which only its CUDA jaxlib plugin can build (jax_triton
does not import without one); the kernel itself is compiled for sm_80 / sm_90 by test_triton_aot."""

import jax

import eejax
from eejax.config import SpecConfig, T5Config
from eejax.models import t5
from eejax.serve.engine import Engine
from tests.conftest import random_prompts
from tests.test_speculative import tiny

PROMPTS = random_prompts(3, [5, 12, 2], vocab=60, seed=3)


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


def test_llama_programs_lower_for_cuda():
    model = eejax.init_exits(tiny(num_layers=4), classifier=True)
    runs = [dict(), dict(temperature=0.8, top_k=5, seed=1), dict(exit="softmax:0.3"), dict(exit="static:2"),
            dict(exit="state:0.5"), dict(exit="classifier:0.5"), dict(spec="2:2"), dict(spec="1:3:adaptive"),
            dict(spec="2:2", temperature=0.7, seed=2)]
    for kw in runs:
        eejax.generate(model, PROMPTS, max_new_tokens=6, ignore_eos=True, **kw)
    engine = Engine(model, max_slots=2, max_new_tokens=8, cache_budget="1MiB", page_size=8)
    for kw in (dict(), dict(exit="softmax:0.3"), dict(spec="2:2"), dict(temperature=0.9, seed=4)):
        engine.submit(PROMPTS[0], max_new_tokens=5, **kw)
    engine.run()
    texts = lowered_for_cuda(model)
    print({name: len(modules) for name, modules in texts.items()})
    assert {"prefill", "decode", "plain_step", "draft", "verify", "prefill_slots", "decode_slots",
            "spec_round_slots"} <= set(texts)
    assert_cuda_modules(texts, model.programs.num_programs)
    assert any("stablehlo.while" in text for text in texts["decode"])  # the early-exit segment loop


def test_t5_programs_lower_for_cuda():
    c = T5Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_encoder_layers=2,
                 num_heads=4, head_dim=8)
    model = eejax.Model(c, t5.init_params(c, jax.random.PRNGKey(0), scale=0.3))
    for kw in (dict(), dict(exit="softmax:0.3"), dict(spec=SpecConfig(1, 2))):
        eejax.generate(model, PROMPTS, max_new_tokens=5, ignore_eos=True, **kw)
    texts = lowered_for_cuda(model)
    assert {"prefill", "decode", "draft", "verify"} <= set(texts)
    assert_cuda_modules(texts, model.programs.num_programs)
