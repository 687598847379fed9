"""What training runs share: orbax checkpoints a rerun resumes from, and the probe a shipped delta
is checked against when it is applied."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eejax.errors import EejaxError


def resume(checkpoint_dir: str | Path | None, state: dict, log: dict):
    """(manager, state, log): an orbax CheckpointManager over `checkpoint_dir` (the latest two
    kept; None without a directory) and the latest saved state and log, or the given ones."""
    import orbax.checkpoint as ocp

    if checkpoint_dir is None:
        return None, state, log
    manager = ocp.CheckpointManager(Path(checkpoint_dir).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    latest = manager.latest_step()
    if latest is not None:
        restored = manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state), log=ocp.args.JsonRestore()))
        state, log = restored.state, dict(restored.log)
    return manager, state, log


def save(manager, step: int, state: dict, log: dict) -> None:
    """Saves `state` (arrays) and `log` (JSON) as checkpoint `step` (in the background)."""
    import orbax.checkpoint as ocp

    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), log=ocp.args.JsonSave(log)))


def check_probe(path, meta: dict, ids: list[int], logits: np.ndarray, tolerance: float) -> None:
    """EejaxError unless the probe's logits (`ids` its tokens, logits [V]) reproduce those a delta
    at `path` recorded (`meta`: probe_ids, probe_top_ids, probe_top_logits, base) within
    `tolerance` x the largest."""
    want = np.asarray(meta["probe_top_logits"], np.float32)
    got = logits[np.asarray(meta["probe_top_ids"])]
    if ids != meta["probe_ids"] or not np.allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max()):
        raise EejaxError(f"the delta {path} does not reproduce the logits recorded when it was trained "
                         f"(largest difference {np.abs(got - want).max():.3g}): is the base model "
                         f"{meta.get('base')!r}?")
