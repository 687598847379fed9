"""The test session's environment (the model cache, Triton's interpreter, JAX's persistent
compilation cache) and the shared fixtures: a small byte-level BPE tokenizer and tiny random HF
Llama checkpoints converted to eejax. Helpers that are not fixtures live in `tests/helpers.py`."""

from __future__ import annotations

import os

import pytest

from tests.helpers import ROOT, TINY_CONFIGS, cnndm_rows, make_hf_llama

# The real model is cached inside the repo's ignored .cache unless EEJAX_CACHE says otherwise,
# so repeated runs (and CI on the same machine) convert it once.
os.environ.setdefault("EEJAX_CACHE", str(ROOT / ".cache" / "eejax"))
# No GPU here: Triton kernels run in Triton's interpreter, which must be chosen before triton
# is first imported (eejax would set it itself, but a test may import triton first).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Many tests (and the CLI and server processes they start) compile the same programs for the same
# tiny models: JAX's persistent compilation cache, shared by the test workers, compiles each once.
# It lives outside the clone, so a second run (of any clone on this machine) compiles little:
# $EEJAX_COMPILE_CACHE, default ~/.cache/eejax/jax-compile; "off" runs without one. Its size cap
# turns on JAX's file lock around cache reads and writes: without it a worker can read an entry
# another worker is still writing, and deserialising half an executable segfaults (seen once in the
# suite: tests/test_gpu_lowering.py reading what a test_speculative.py worker wrote).
from eejax.compile_cache import MAX_BYTES, MIN_COMPILE_S, enable_compile_cache  # noqa: E402

COMPILE_CACHE = enable_compile_cache()
if COMPILE_CACHE is None:
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
else:  # for the CLI and server processes the tests start
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(COMPILE_CACHE))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_S))
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(MAX_BYTES))
# Each test runs one layer layout: "auto" on this CPU compiles the split programs before their
# first step, instead of decoding on the stacked ones while they compile in the background
# (`Model.compiles_split_later`: its own test turns it on).
os.environ.setdefault("EEJAX_BACKGROUND_COMPILE", "off")
# Two test workers share the machine's cores: torch's OpenMP threads, spinning beside the other
# worker's XLA threads, made the HF parity test of test_smollm2.py 3x slower (60 s, 20 s with one
# thread; 2 cores). A worker's torch (and the processes it starts) runs one thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Nor do the CPU kernels' helper threads spin between products (`kernels/cpu_parts.h`): the
    # other worker needs the core.
    os.environ.setdefault("EEJAX_CPU_LINGER_US", "0")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([r["article"] for r in cnndm_rows(20)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_tokenizer):
    """kind -> (HF model, HF directory, converted eejax directory), built once per session."""
    from conversion import convert

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind in TINY_CONFIGS:
        hf = make_hf_llama(kind)
        hf_dir = root / f"hf-{kind}"
        hf.save_pretrained(hf_dir)
        tiny_tokenizer.save_pretrained(hf_dir)
        out[kind] = (hf, hf_dir, convert(hf_dir, root / f"eejax-{kind}", progress=False))
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoints):
    import eejax

    return eejax.load(tiny_checkpoints["gqa-untied"][2])


UNIT_FIRST = (
    "test_allocator.py",
    "test_scheduler.py",
    "test_buckets.py",
    "test_sampling.py",
    "test_confidence.py",
    "test_spec_policy.py",
    "test_step_options.py",
    "test_model_interface.py",
    "test_attention.py",
    "test_transfers.py",
)


# The files that take longest (a cold run, 2026-11-24: ~100-200 s of one worker each) start
# right after the unit tests, so that no long file is left to run alone at the end (a clean-clone
# run measured no change in wall time: 935 s before, 947 s after).
SLOW_FIRST = (
    "test_smollm2.py",
    "test_sharding.py",
    "test_engine.py",
    "test_engine_property.py",
    "test_http.py",
    "test_speculative.py",
    "test_t5.py",
    "test_gpu_lowering.py",
)


# The quick tier (`scripts/test.sh --quick`, pytest -m quick): the unit files, then conversion and
# HF parity on the tiny models.
QUICK = (*UNIT_FIRST, "test_conversion.py", "test_llama_hf.py", "test_llama_family.py")


def pytest_collection_modifyitems(items):
    """Marks the quick tier; runs the torch-free unit tests first (a broken invariant shows in
    seconds), then the slowest parity and end-to-end files, then the rest; the sort is stable, so
    each file keeps its own order."""
    for item in items:
        if item.path.name in QUICK:
            item.add_marker(pytest.mark.quick)

    def rank(item) -> tuple[bool, int]:
        name = item.path.name
        return name not in UNIT_FIRST, SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_module(request):
    """A test worker runs many files: after each, every compiled program goes (those of the
    session's models too, and JAX's caches), so programs do not pile up in one process (a worker
    that had grown to 9 GB crashed inside jaxlib; one that held ~60k memory maps, most of them the
    programs test_engine.py compiled for the session's tiny model, failed with "can't start new
    thread"). EEJAX_TEST_RSS_LOG=FILE appends each module's peak RSS to FILE."""
    yield
    import resource

    from eejax.decode.programs import release_all

    release_all()
    log = os.environ.get("EEJAX_TEST_RSS_LOG")
    if log:
        with open(log, "a") as f:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            f.write(f"{os.getpid()} {request.module.__name__} peak {peak} MB\n")


# Linux allows a process vm.max_map_count memory maps (default 65530), and each compiled XLA:CPU
# program holds some (~256 for SmolLM2): a file that compiles many runs its later tests after the
# programs are freed once fewer than this many maps are left.
MIN_MAP_HEADROOM = 20_000


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_maps_run_low():
    yield
    from eejax.decode.programs import map_headroom, release_all

    headroom = map_headroom()
    if headroom is not None and headroom < MIN_MAP_HEADROOM:
        release_all()
