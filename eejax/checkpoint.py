"""eejax checkpoints on disk: `eejax.json` (format, architecture, config), `params/` (orbax),
`tokenizer/` (HF tokenizer files)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eejax.config import LlamaConfig, T5Config, check_architecture
from eejax.errors import EejaxError

CONFIG_FILE = "eejax.json"
FORMAT_VERSION = 1
CONFIG_CLASSES = {"llama": LlamaConfig, "t5": T5Config}


def save_checkpoint(directory: str | Path, config, params, tokenizer=None, metadata: dict | None = None) -> None:
    """Writes a checkpoint into `directory`, which must not exist yet."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", jax.tree.map(np.asarray, params))
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(directory / "tokenizer")
    meta = {
        "format_version": FORMAT_VERSION,
        "architecture": config.architecture,
        "config": config.to_dict(),
        "dtype": str(jax.tree.leaves(params)[0].dtype),
        **(metadata or {}),
    }
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def write_checkpoint(dst: str | Path, config, params, tokenizer=None, metadata: dict | None = None, *,
                     overwrite: bool = False) -> Path:
    """Writes a checkpoint at `dst` atomically: into a hidden sibling directory first, renamed to
    `dst` when complete, so on any error nothing is left at `dst` (an existing `dst` is replaced
    only with `overwrite` and only once the new checkpoint is complete)."""
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise EejaxError(f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_checkpoint(partial, config, params, tokenizer, metadata)
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(partial, dst)
            shutil.rmtree(old)
        else:
            os.replace(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return dst


def read_metadata(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    if not directory.exists():
        raise EejaxError(f"no such file or directory: {directory}")
    if not (directory / CONFIG_FILE).is_file():
        hint = " (an HF model directory? convert it first: eejax convert SRC DST)" if (directory / "config.json").exists() else ""
        raise EejaxError(f"{directory} is not an eejax model: no {CONFIG_FILE}{hint}")
    return json.loads((directory / CONFIG_FILE).read_text())


def load_checkpoint(directory: str | Path):
    """Reads (config, params as jax arrays, tokenizer or None) from a checkpoint directory."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    meta = read_metadata(directory)
    arch = meta.get("architecture")
    check_architecture(arch, str(directory))
    config = CONFIG_CLASSES[arch].from_dict(meta["config"])
    # Quiet orbax's informational logs about restoring without a target.
    logging.getLogger("absl").setLevel(logging.WARNING)
    params = ocp.StandardCheckpointer().restore(directory / "params")
    params = jax.tree.map(jax.numpy.asarray, params)
    tokenizer = None
    if (directory / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory / "tokenizer"))
    return config, params, tokenizer
