"""Token sequences made beforehand (a prompt and the model's continuation of it, say), kept in one
compressed npz: the tokens as one uint16 array, each sequence's length, and what made them.

`scripts/gpu_train_draft.py answer` writes the model's answers so; `eejax train-draft
--sequences-file` and the script's `run --continuations` train on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eejax.errors import EejaxError


def save_sequences(path: str | Path, sequences, made) -> None:
    """Writes `sequences` (lists of token ids < 65536) and `made` (JSON: what made them) to `path`,
    whole or not at all (a run stopped while it saves keeps the file before)."""
    path = Path(path)
    past = max((max(s) for s in sequences if len(s)), default=0)
    if past >= 2**16:
        raise EejaxError(f"token id {past} does not fit this format's uint16 (a vocabulary of at most 65536)")
    flat = np.concatenate([np.asarray(s, np.uint16) for s in sequences]) if sequences else np.zeros(0, np.uint16)
    lengths = np.asarray([len(s) for s in sequences], np.int64)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, tokens=flat, lengths=lengths, made=np.asarray(json.dumps(made)))
    tmp.replace(path)


def load_sequences(path: str | Path) -> tuple[list[list[int]], list]:
    """(sequences, what made them) of `save_sequences`' file; a missing or malformed file is
    refused by name."""
    path = Path(path)
    if not path.is_file():
        raise EejaxError(f"token sequences file not found: {path}")
    try:
        with np.load(path) as f:
            tokens, lengths = f["tokens"].astype(np.int64), f["lengths"]
            made = json.loads(str(f["made"])) if "made" in f else [["an earlier run", None, None, len(lengths)]]
    except (OSError, ValueError, KeyError) as e:
        raise EejaxError(f"{path} is not a token sequences file (tokens, lengths, made): {e}") from None
    if lengths.sum() != len(tokens) or (lengths < 0).any():
        raise EejaxError(f"{path}: its lengths add up to {lengths.sum()}, its tokens are {len(tokens)}")
    ends = np.cumsum(lengths)
    return ([x.tolist() for x in np.split(tokens, ends[:-1])] if len(ends) else []), made
