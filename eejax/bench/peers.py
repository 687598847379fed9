"""The peers a bench run can time beside eejax on the same weights and token ids: HF transformers
(PyTorch, the GGUF dequantised to float32 by transformers) and llama.cpp (llama-cpp-python on
the GGUF's own blocks, in a process of its own: its thread pool slows eejax's in one process).

Both need a known model whose original is a GGUF file (`eejax models`); HF needs the `convert`
extra (torch), llama.cpp the `llamacpp` extra. llama.cpp decodes one sequence: batch 1 only."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eejax.errors import EejaxError

PEERS = ("hf", "llamacpp")


@dataclasses.dataclass(frozen=True)
class PeerResult:
    """A peer's greedy decoding of a run's prompts: `decode_tokens_per_s` (the tokens after each
    row's first over the time they took), `tokens_per_s` (end to end, prefill included),
    `tokens` per prompt, and where the peer times it, `prefill_tokens_per_s` (prompt tokens
    over the time to each first token)."""

    decode_tokens_per_s: float
    tokens_per_s: float
    tokens: list[list[int]]
    prefill_tokens_per_s: float | None = None


def original_gguf(model_name: str) -> Path:
    """The GGUF file a known model (or the base it is built from) was converted from."""
    from eejax.loading.hub import KNOWN_MODELS, fetch_original

    name = model_name
    while name in KNOWN_MODELS and KNOWN_MODELS[name].base is not None:
        name = KNOWN_MODELS[name].base
    if name not in KNOWN_MODELS or not (KNOWN_MODELS[name].member or "").endswith(".gguf"):
        raise EejaxError(
            f"--peer needs a known model converted from a GGUF file (see `eejax models`), not {model_name}"
        )
    return fetch_original(name)


def check_peer(peer: str, model_name: str) -> Path:
    """The GGUF file `peer` runs for `model_name`, after checking that the peer is installed (an
    EejaxError names the extra to install, or why the model has no GGUF)."""
    if peer not in PEERS:
        raise EejaxError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    gguf = original_gguf(model_name)
    _needs(*{"llamacpp": ("llama_cpp", "llamacpp"), "hf": ("torch", "convert")}[peer])
    return gguf


def peer_runner(peer: str, model_name: str, pad_id: int, threads: int | None = None):
    """`run(ids, batch, new_tokens) -> PeerResult | None` for `peer` ("hf" or "llamacpp"; None
    where the peer cannot run at that batch size); see `check_peer`."""
    gguf = check_peer(peer, model_name)
    if peer == "llamacpp":
        threads = threads or os.cpu_count() or 1
        return lambda ids, batch, new_tokens: llamacpp_in_child(gguf, ids, new_tokens, threads) if batch == 1 else None
    hf = load_hf(gguf)
    return lambda ids, batch, new_tokens: hf_run(hf, ids, batch, new_tokens, pad_id)


def _needs(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise EejaxError(f"this peer needs {module}: pip install 'eejax[{extra}]'")


def load_hf(gguf: Path, dtype: str = "float32", device: str = "cpu"):
    """HF transformers' model of a GGUF file (dequantised to `dtype`), in eval mode on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    return hf.to(device).eval()


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, pad_id: int, cache: str | None = None):
    """(wall seconds, generated ids per row) of HF `generate`: greedy, a left-padded batch, exactly
    `new_tokens` each, after a 2-token warm-up at the same shapes (a static cache compiles for
    them); `cache="static"` is HF's static cache."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
    if cache is not None:
        kw["cache_implementation"] = cache
    sync = torch.cuda.synchronize if hf.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        sync()
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kw)
        sync()
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return elapsed, out[:, width:].tolist()


def hf_run(hf, ids: list[list[int]], batch: int, new_tokens: int, pad_id: int) -> PeerResult:
    """HF over `ids`, `batch` rows at a time: end to end from `new_tokens`-token runs, decode from
    their time beyond 1-token runs of the same rows."""
    full = first = 0.0
    tokens = []
    for start in range(0, len(ids), batch):
        rows = ids[start : start + batch]
        seconds, out = hf_generate(hf, rows, new_tokens, pad_id)
        full += seconds
        first += hf_generate(hf, rows, 1, pad_id)[0]
        tokens += out
    return PeerResult(len(ids) * (new_tokens - 1) / (full - first), len(ids) * new_tokens / full, tokens)


def run_llamacpp(gguf: str, prompts: list[list[int]], new_tokens: int, threads: int) -> PeerResult:
    """llama.cpp's greedy decoding of each prompt in turn (after one warm-up prompt)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_ctx=max(map(len, prompts)) + new_tokens + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    prefill = decode = 0.0
    tokens = []
    for warm in (True, False):
        for prompt in prompts[:1] if warm else prompts:
            row = []
            start = time.perf_counter()
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                row.append(int(token))
                if len(row) == 1:
                    first = time.perf_counter()
                if len(row) == new_tokens:
                    break
            end = time.perf_counter()
            if not warm:
                prefill, decode = prefill + first - start, decode + end - first
                tokens.append(row)
    n = len(prompts)
    return PeerResult(
        n * (new_tokens - 1) / decode, n * new_tokens / (prefill + decode), tokens, sum(map(len, prompts)) / prefill
    )


def llamacpp_in_child(gguf, prompts: list[list[int]], new_tokens: int, threads: int) -> PeerResult:
    """`run_llamacpp` in a process of its own (`python -m eejax.bench.peers SPEC.json`)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "in.json"
        spec.write_text(
            json.dumps({"gguf": str(gguf), "prompts": prompts, "new_tokens": new_tokens, "threads": threads})
        )
        done = subprocess.run([sys.executable, "-m", "eejax.bench.peers", str(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        raise EejaxError(llamacpp_failure(done.returncode, done.stderr))
    return PeerResult(**json.loads(done.stdout.strip().splitlines()[-1]))


# llama-cpp-python built for a CPU with AMX (its default, native build) crashes in its AMX
# products on prompts of more than one token (llama.cpp issue #20824); a build without AMX runs.
NO_AMX_BUILD = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
    '-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" '
    "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36"
)


def llamacpp_failure(returncode: int, stderr: str, cpu_flags: str | None = None) -> str:
    """What to tell a user whose llama.cpp child exited with `returncode` (negative: killed by
    that signal) after writing `stderr`; on a CPU with AMX a crash names the build that runs."""
    import signal

    if returncode >= 0:
        last = stderr.strip().splitlines()[-1:]
        return f"llama.cpp's run failed (exit status {returncode}): {last[0] if last else 'no message'}"
    name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else str(-returncode)
    message = f"llama.cpp's run was killed by {name}"
    if cpu_flags is None:
        try:
            cpu_flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu_flags = ""
    if name == "SIGSEGV" and "amx_int8" in cpu_flags:
        message += (
            "; this CPU has AMX, and llama-cpp-python's native build crashes in its AMX products "
            f"(llama.cpp issue #20824). Build it without AMX: {NO_AMX_BUILD}"
        )
    return message


if __name__ == "__main__":
    a = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(dataclasses.asdict(run_llamacpp(a["gguf"], a["prompts"], a["new_tokens"], a["threads"]))))
