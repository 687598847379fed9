"""What training runs share: orbax checkpoints a rerun resumes from."""

from __future__ import annotations

from pathlib import Path


def resume(checkpoint_dir: str | Path | None, state: dict, log: dict):
    """(manager, state, log): an orbax CheckpointManager over `checkpoint_dir` (the latest two
    kept; None without a directory) and the latest saved state and log, or the given ones."""
    import orbax.checkpoint as ocp

    if checkpoint_dir is None:
        return None, state, log
    manager = ocp.CheckpointManager(
        Path(checkpoint_dir).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    latest = manager.latest_step()
    if latest is not None:
        restored = manager.restore(
            latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(state), log=ocp.args.JsonRestore())
        )
        state, log = restored.state, dict(restored.log)
    return manager, state, log


def save(manager, step: int, state: dict, log: dict) -> None:
    """Saves `state` (arrays) and `log` (JSON) as checkpoint `step` (in the background)."""
    import orbax.checkpoint as ocp

    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), log=ocp.args.JsonSave(log)))
