"""Helpers the tests share (not fixtures): tiny HF Llamas, random prompts, a prefilled cache, a
server in a thread or a process, the CNN/DM sample, a model's logits along a sequence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


CNNDM = ROOT / "data" / "cnndm_test_dev100.jsonl"


def cnndm_rows(n: int) -> list[dict]:
    with CNNDM.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


TINY_CONFIGS = {
    "gqa-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "llama3-rope": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


# The tiny models' sizes and special tokens (HF config fields), whatever their family.
TINY_SIZES = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_hf_llama(kind: str, seed: int = 0):
    """A tiny random HF LlamaForCausalLM (fp32) of one of TINY_CONFIGS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**TINY_SIZES, **TINY_CONFIGS[kind])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms, so a norm weight that is dropped or misplaced shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def random_prompts(n: int, lengths, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(lengths[i % len(lengths)])).tolist() for i in range(n)]


def prefilled(model, prompts, max_new_tokens=8, temperature=0.0, pages_per_row=4, page_size=8):
    """(state, cache, block_table) after the full-depth prefill of `prompts` (right-padded), each
    row owning `pages_per_row` consecutive pages of `page_size`."""
    import jax
    import jax.numpy as jnp

    from eejax.cache import init_cache
    from eejax.decode import steps
    from eejax.decode.sampling import RowSampling, SamplingParams
    from eejax.options import StepOptions

    c = model.config
    b, t = len(prompts), max(map(len, prompts))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    table = jnp.asarray(1 + np.arange(b * pages_per_row, dtype=np.int32).reshape(b, pages_per_row))
    cache = init_cache(model.cache_layers, 1 + b * pages_per_row, page_size, c.num_kv_heads, c.head_dim, model.dtype)
    state, cache = steps.prefill(
        model.params,
        cache,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        table,
        jax.random.PRNGKey(0),
        sampling=RowSampling.of(SamplingParams(temperature), b),
        config=c,
        options=StepOptions(max_new_tokens, sampler=SamplingParams(temperature).sampler),
    )
    return state, cache, table


def serve_in_thread(engine, name: str = "tiny", ssl: tuple | None = None, **app_options):
    """Starts `engine` and an `eejax serve` app for it (`create_app(..., **app_options)`) on a free
    127.0.0.1 port in this process, over TLS with `ssl` = (keyfile, certfile); a context manager
    yielding the base URL, stopping both at exit."""
    import contextlib
    import socket
    import threading
    import time

    import uvicorn

    from eejax.serve.http import create_app

    @contextlib.contextmanager
    def running():
        engine.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = create_app(engine, served_model_name=name, **app_options)
        keyfile, certfile = ssl or (None, None)
        server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=port, log_level="warning", ssl_keyfile=keyfile, ssl_certfile=certfile
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            yield f"{'https' if ssl else 'http'}://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join()
            engine.stop(cancel=True)

    return running()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_eejax_serve(model_dir, *args, timeout: float = 120):
    """Runs `eejax serve --model model_dir *args` as a subprocess on a free 127.0.0.1 port, output
    piped; returns (process, base URL) once /health answers 200."""
    import os
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "eejax.cli", "serve", "--model", str(model_dir), "--port", str(port), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    url = f"http://127.0.0.1:{port}"
    if not wait_until_healthy(url, [proc], timeout):
        proc.kill()
        raise AssertionError(f"eejax serve did not start: {proc.stdout.read()}")
    return proc, url


def wait_until_healthy(url: str, procs, timeout: float) -> bool:
    """Whether `url`/health answered 200 within `timeout` seconds while all of `procs` ran."""
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline and all(p.poll() is None for p in procs):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return True
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    return False


def sequence_logits(model, ids, page_size: int = 16):
    """float32 logits [T, V] at every position of one token sequence: a Llama prefill through the
    paged cache (in the model's dtype) and the head."""
    from eejax.cache import init_cache
    from eejax.models import llama

    c, t = model.config, len(ids)
    pages = -(-t // page_size)
    cache = init_cache(c.num_layers, 1 + pages, page_size, c.num_kv_heads, c.head_dim, model.dtype)
    positions = np.arange(t, dtype=np.int32)[None]
    batch = llama.token_batch(
        c,
        positions,
        np.ones((1, t), bool),
        np.arange(1, 1 + pages, dtype=np.int32)[None],
        np.array([t], np.int32),
        page_size,
    )
    h, _ = llama.run_layers(model.params, llama.embed(model.params, np.array([ids], np.int32)), cache, batch, c)
    return np.asarray(llama.lm_head(model.params, h, c))[0]


def assert_equal_until_a_near_tie(model, prompts, got, want, tol: float) -> None:
    """Each row of greedy tokens `got` equals `want`'s, or both are equal until they part at a
    near-tie: the full model's logits there (a prefill of their common prefix) give both tokens
    within `tol` of each other and of the top. bf16 matmuls over another number of rows (a
    verification pass, a larger batch) may round differently on some CPUs and split such a tie
    the other way; from there the rows are different texts and nothing more is compared."""
    for prompt, g, w in zip(prompts, got, want):
        part = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if part is None:
            assert len(g) == len(w)
            continue
        logits = sequence_logits(model, prompt + w[:part])[-1]
        pair = logits[[g[part], w[part]]]
        assert abs(pair[0] - pair[1]) < tol and pair.max() >= logits.max() - tol, (part, pair, logits.max())


def fixed_policy_costs(monkeypatch, draft_pass: float, verify: float, plain: float) -> None:
    """Feeds every adaptive speculation policy these seconds instead of the wall times the engine
    measures (a busy 2-core machine's are noise at a tiny model's size): a draft pass, a verify
    of any d, a plain step. What a policy then chooses depends only on the acceptance."""
    from eejax.decode.spec_policy import SpeculationPolicy

    # the policy's own methods, also when an earlier call in the same test replaced them
    observe_times = getattr(SpeculationPolicy.observe_times, "original", SpeculationPolicy.observe_times)
    observe_plain = getattr(SpeculationPolicy.observe_plain, "original", SpeculationPolicy.observe_plain)

    def times(self, d, draft_s, verify_s, passes=None, whole=False):
        observe_times(self, d, draft_pass * (d + 1), verify, passes=d + 1, whole=whole)

    def plain_step(self, seconds):
        observe_plain(self, plain)

    times.original, plain_step.original = observe_times, observe_plain
    monkeypatch.setattr(SpeculationPolicy, "observe_times", times)
    monkeypatch.setattr(SpeculationPolicy, "observe_plain", plain_step)
