"""eejax checkpoints on disk: `eejax.json` (format, architecture, config), `params/` (orbax),
`tokenizer/` (HF tokenizer files)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eejax.config import LlamaConfig, T5Config, check_architecture
from eejax.errors import EejaxError
from eejax.quantized import float_dtype, formats, from_tree, to_tree

CONFIG_FILE = "eejax.json"
FORMAT_VERSION = 1
CONFIG_CLASSES = {"llama": LlamaConfig, "t5": T5Config}


def save_checkpoint(directory: str | Path, config, params, tokenizer=None, metadata: dict | None = None) -> None:
    """Writes a checkpoint into `directory`, which must not exist yet."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / "params", jax.tree.map(np.asarray, to_tree(params)))
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(directory / "tokenizer")
    meta = {
        "format_version": FORMAT_VERSION,
        "architecture": config.architecture,
        "config": config.to_dict(),
        "dtype": str(float_dtype(params)),
        "params_files": params_file_sizes(directory / "params"),
        **({"quantization": "+".join(sorted(formats(params)))} if formats(params) else {}),
        **(metadata or {}),
    }
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def check_destination(dst: str | Path, overwrite: bool = False) -> Path:
    """`dst` as an absolute path, once it is known that a checkpoint can be written there: it
    does not exist (or `overwrite`), and its nearest existing ancestor is a writable directory."""
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise EejaxError(f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
    if dst.exists() and not dst.is_dir():
        raise EejaxError(f"{dst} exists and is not a directory; it cannot be replaced by a checkpoint")
    ancestor = dst.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise EejaxError(f"cannot create {dst}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise EejaxError(f"cannot create {dst}: {ancestor} is not writable")
    return dst


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale_partials(dst: Path) -> None:
    """Removes `.DST.partial-PID` / `.DST.old-PID` siblings of `dst` left by writers that died
    (killed mid-write: nothing could clean up after them)."""
    for leftover in dst.parent.glob(f".{dst.name}.*-*"):
        kind, _, pid = leftover.name[len(dst.name) + 2 :].rpartition("-")
        if kind in ("partial", "old") and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def params_file_sizes(weights: Path) -> dict[str, int]:
    """{path under params/: bytes} of every file orbax wrote, recorded in eejax.json so that
    `load_checkpoint` names a missing or truncated file before orbax reads it (orbax, on a
    truncated file, fails midway and its reads still in flight report on stderr after the error)."""
    return {f.relative_to(weights).as_posix(): f.stat().st_size for f in sorted(weights.rglob("*")) if f.is_file()}


def check_params_files(weights: Path, sizes) -> None:
    """An EejaxError naming the first file under params/ that is missing or not the size the
    checkpoint recorded (`params_file_sizes`); nothing to check for a checkpoint that recorded none."""
    if sizes is None:
        return
    if not isinstance(sizes, dict) or not all(isinstance(n, int) for n in sizes.values()):
        raise EejaxError(
            f"{weights.parent / CONFIG_FILE}: params_files is not a table of sizes; the checkpoint is damaged"
        )
    for name, size in sizes.items():
        path = weights / name
        if not path.is_file():
            raise EejaxError(f"{path}: no such file; the checkpoint is damaged: convert it again")
        actual = path.stat().st_size
        if actual != size:
            raise EejaxError(
                f"{path}: {actual} bytes where the checkpoint wrote {size}; the checkpoint is damaged: convert it again"
            )


def write_checkpoint(
    dst: str | Path, config, params, tokenizer=None, metadata: dict | None = None, *, overwrite: bool = False
) -> Path:
    """Writes a checkpoint at `dst` atomically: into a hidden sibling directory first, renamed to
    `dst` when complete, so on any error nothing is left at `dst` (an existing `dst` is replaced
    only with `overwrite` and only once the new checkpoint is complete). Partial writes of
    processes that died are removed first."""
    dst = check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(dst)
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
    """`eejax.json` of a checkpoint directory, or an EejaxError naming what is wrong with it."""
    directory = Path(directory)
    if not directory.exists():
        raise EejaxError(f"no such file or directory: {directory}")
    path = directory / CONFIG_FILE
    if not path.is_file():
        hint = (
            " (an HF model directory? convert it first: eejax convert SRC DST)"
            if (directory / "config.json").exists()
            else ""
        )
        raise EejaxError(f"{directory} is not an eejax model: no {CONFIG_FILE}{hint}")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EejaxError(f"{path} is not valid JSON ({e}); the checkpoint is damaged: convert it again") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise EejaxError(f"{path} has no config object; the checkpoint is damaged: convert it again")
    return meta


def read_config(directory: Path, meta: dict[str, Any]):
    """The model config from a checkpoint's metadata."""
    arch = meta.get("architecture")
    check_architecture(arch, str(directory))
    try:
        return CONFIG_CLASSES[arch].from_dict(meta["config"])
    except (TypeError, ValueError, KeyError) as e:
        raise EejaxError(f"{directory / CONFIG_FILE}: its config is not a valid {arch} config ({e})") from None


def _first_line(error: Exception) -> str:
    """An exception's message cut to its first line (libraries' messages run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _to_device(host_params):
    """Host (numpy) params -> device arrays, one array at a time, each host copy freed once its
    device copy is made: the process holds the weights about once, not twice (SmolLM2-135M's
    538 MB of fp32 weights: RSS +543 MB, against +724 MB converting the whole tree at once)."""
    leaves, treedef = jax.tree.flatten(host_params)
    del host_params
    on_device = []
    for i in range(len(leaves)):
        on_device.append(jax.device_put(leaves[i]).block_until_ready())
        leaves[i] = None
    return jax.tree.unflatten(treedef, on_device)


def _glibc():
    """glibc's malloc controls, or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hands the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters, and the values its dynamic mmap threshold starts from and ends at
# (64-bit): a freed mapped block raises the threshold to its size, up to 32 MiB, and the trim
# threshold to twice that.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_START, MMAP_THRESHOLD_MAX = 128 * 1024, 32 * 1024 * 1024
_loading = threading.Lock()
_depth = 0  # loads under way


@contextlib.contextmanager
def mapped_while_loading():
    """While loading, every allocation above 128 KiB is its own mapping, so freeing a host copy
    returns it to the OS at once; afterwards the heap's free pages go back too.

    A restore reads the weights into host buffers on orbax's threads and frees them once each is
    on the device. Where glibc had raised its mmap threshold (its first big free does), those
    buffers came from the threads' arenas, and ~30 MB of them stayed resident: SmolLM2's 97 MB
    of GGUF blocks and its tokenizer added RSS +145 MB, and +120 MB (1.25x the blocks) with this.
    Afterwards the thresholds are where glibc's own adjustment leaves them after such a load
    (32 MiB, trim at 64 MiB), so the process allocates as it did before. Nested and concurrent
    loads keep the mapping until the last one ends."""
    libc = _glibc()
    if libc is None:
        yield
        return
    global _depth
    with _loading:
        _depth += 1
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_START)
    try:
        yield
    finally:
        with _loading:
            _depth -= 1
            if _depth == 0:
                libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
                libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)
                libc.malloc_trim(0)


def load_checkpoint(directory: str | Path):
    """Reads (config, params as jax arrays, tokenizer or None) from a checkpoint directory.
    A damaged checkpoint (bad JSON, missing or truncated weights: files checked against the sizes
    eejax.json recorded, a broken tokenizer) is an EejaxError naming the file; whether the weights
    fit the config is the model's to check (`eejax.loading.model.check_params`)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    meta = read_metadata(directory)
    config = read_config(directory, meta)
    weights = directory / "params"
    if not weights.is_dir():
        raise EejaxError(f"{weights}: no such directory; the checkpoint is damaged: convert it again")
    check_params_files(weights, meta.get("params_files"))
    # Quiet orbax's informational logs about restoring without a target.
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        params = from_tree(_to_device(ocp.StandardCheckpointer().restore(weights)))
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise many kinds for damaged files
        raise EejaxError(
            f"cannot read the weights in {weights} ({_first_line(e)}); the checkpoint is damaged: convert it again"
        ) from None
    if not isinstance(params, dict):
        raise EejaxError(f"{weights} does not hold a weights dictionary; the checkpoint is damaged")
    tokenizer = None
    if (directory / "tokenizer").is_dir():
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(directory / "tokenizer"))
        except Exception as e:  # noqa: BLE001 - tokenizers raise many kinds for damaged files
            raise EejaxError(f"cannot read the tokenizer in {directory / 'tokenizer'} ({_first_line(e)})") from None
    return config, params, tokenizer
