"""Reading HF checkpoints: an HF model directory (safetensors or pytorch_model.bin, sharded or
not; torch reads them) or a `.gguf` file (Llama: `gguf_source`, gguf-py dequantises it, no torch;
another architecture: transformers' GGUF loader).
Tensors are read lazily, one at a time."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eejax.config import check_model_type
from eejax.errors import EejaxError, UnsupportedModelError

WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclasses.dataclass
class HFCheckpoint:
    """What a conversion needs: config dicts, tensor names, a reader and the tokenizer."""

    config: dict[str, Any]
    generation_config: dict[str, Any] | None
    names: list[str]
    read: Callable[[str], np.ndarray]  # name -> float32 array in HF layout
    tokenizer: Any
    source: str


def open_checkpoint(src: str | Path) -> HFCheckpoint:
    src = Path(src).expanduser()
    if not src.exists():
        raise EejaxError(f"no such file or directory: {src}")
    if src.is_file():
        if src.suffix != ".gguf":
            raise EejaxError(f"{src} is a file but not a .gguf file; give an HF model directory or a .gguf file")
        return _open_gguf(src)
    return _open_hf_dir(src)


def _to_numpy(tensor) -> np.ndarray:
    import torch

    return tensor.detach().to(torch.float32).numpy()


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or an EejaxError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EejaxError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise EejaxError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _open_hf_dir(src: Path) -> HFCheckpoint:
    if not (src / "config.json").is_file():
        raise EejaxError(f"{src} is not an HF model directory: no config.json")
    config = _read_json(src / "config.json")
    check_model_type(config.get("model_type"), str(src))
    gen_path = src / "generation_config.json"
    generation_config = _read_json(gen_path) if gen_path.is_file() else None
    found = next((name for name in WEIGHT_FILES if (src / name).is_file()), None)
    if found is None:
        raise EejaxError(f"no weights in {src} (looked for {', '.join(WEIGHT_FILES)})")
    if found.endswith(".index.json"):
        weight_map = _read_json(src / found).get("weight_map")
        if not isinstance(weight_map, dict):
            raise EejaxError(f"{src / found} has no weight_map object")
        shards = {name: src / file for name, file in weight_map.items()}
    else:
        shards = None
    if "safetensors" in found:
        from safetensors import safe_open

        files = sorted(set(shards.values())) if shards else [src / found]
        try:
            handles = {f: safe_open(str(f), framework="pt") for f in files}
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise EejaxError(f"cannot read weights in {src}: {e}") from e
        where = shards or {k: files[0] for k in handles[files[0]].keys()}
        names = list(where)

        def read(name: str) -> np.ndarray:
            return _to_numpy(handles[where[name]].get_tensor(name))

    else:
        import torch

        files = sorted(set(shards.values())) if shards else [src / found]
        state: dict[str, Any] = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        names = list(state)

        def read(name: str) -> np.ndarray:
            return _to_numpy(state[name])

    return HFCheckpoint(config, generation_config, names, read, _tokenizer(src), str(src))


def _open_gguf(src: Path) -> HFCheckpoint:
    """A Llama, Qwen2 or Qwen3 GGUF file through `gguf_source` (no torch); another architecture (a
    T5 GGUF file) through transformers' GGUF loader, which needs torch."""
    from conversion.gguf_source import GGUF_ARCHITECTURES, open_gguf, open_gguf_file

    metadata, tensors = open_gguf_file(src)
    if metadata.get("general.architecture") in GGUF_ARCHITECTURES:
        config, generation_config, names, read, tokenizer = open_gguf(metadata, tensors)
        return HFCheckpoint(config, generation_config, names, read, tokenizer, str(src))
    return _open_gguf_with_transformers(src)


def _open_gguf_with_transformers(src: Path) -> HFCheckpoint:
    import torch
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except ValueError as e:  # transformers names the GGUF architectures it cannot read
        raise UnsupportedModelError(f"cannot load {src.name}: {str(e).splitlines()[0]}") from e
    check_model_type(model.config.model_type, str(src))
    state = model.state_dict()
    generation_config = model.generation_config.to_dict() if model.generation_config else None
    return HFCheckpoint(
        model.config.to_dict(),
        generation_config,
        list(state),
        lambda n: _to_numpy(state[n]),
        _tokenizer(src.parent, gguf_file=src.name),
        str(src),
    )


def _tokenizer(directory: Path, **kwargs):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, TypeError) as e:
        logging.getLogger(__name__).warning("no tokenizer converted from %s: %s", directory, e)
        return None


def tensor_reader(ckpt: HFCheckpoint):
    """`read(name) -> np.ndarray` over the checkpoint, naming a missing tensor in its error."""
    names = set(ckpt.names)

    def read(name: str) -> np.ndarray:
        if name not in names:
            raise EejaxError(f"checkpoint {ckpt.source} lacks the tensor {name!r}")
        return ckpt.read(name)

    return read


def stack_layers(read, name_of_layer, num_layers: int, dtype, bar) -> np.ndarray:
    """Tensor `name_of_layer(i)` of every layer i stacked on a leading axis; 2-D (linear)
    weights transposed to eejax's [in, out]. Ticks `bar` once per tensor."""
    stacked = None
    for i in range(num_layers):
        w = read(name_of_layer(i))
        w = w.T if w.ndim == 2 else w
        if stacked is None:
            stacked = np.empty((num_layers, *w.shape), dtype)
        stacked[i] = w
        bar.update()
    return stacked
