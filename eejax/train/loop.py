"""The exit-training loop: optax steps over a fixed list of batches, a progress bar, and orbax
checkpoints that a rerun resumes from (to the same state as an uninterrupted run)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from eejax.errors import EejaxError
from eejax.train.exit_training import layer_weights, train_step


def train_exit_adapters(model, batches, *, steps: int, learning_rate: float = 1e-3, weights: str = "calm",
                        checkpoint_dir: str | Path | None = None, save_every: int = 50, progress: bool = True):
    """Trains `model.params["exits"]` adapters by self-distillation for `steps` optax (adam)
    steps; step i uses batches[i % len(batches)] (tokens [B, T], lengths [B]). With
    `checkpoint_dir`, (exits, optimizer state, step, losses) are saved every `save_every` steps
    and at the end, and a rerun resumes from the latest. Returns (exit_params, losses [steps],
    the step it started from)."""
    import orbax.checkpoint as ocp

    if steps < 1 or save_every < 1:
        raise EejaxError(f"steps and save_every must be >= 1, got {steps} and {save_every}")
    if not batches:
        raise EejaxError("no training batches")
    optimizer = optax.adam(learning_rate)
    w = jnp.asarray(layer_weights(weights, model.config.num_layers))
    state = {"exits": model.params["exits"], "opt": optimizer.init(model.params["exits"]), "step": jnp.int32(0)}
    history: list[float] = []
    manager = None
    if checkpoint_dir is not None:
        manager = ocp.CheckpointManager(Path(checkpoint_dir).absolute(),
                                        options=ocp.CheckpointManagerOptions(max_to_keep=2))
        latest = manager.latest_step()
        if latest is not None:
            restored = manager.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(state), log=ocp.args.JsonRestore()))
            state, history = restored.state, list(restored.log["losses"])
    start = int(state["step"])
    if start > steps:
        raise EejaxError(f"the checkpoint in {checkpoint_dir} is at step {start}, past the {steps} steps asked")
    exit_params, opt_state = state["exits"], state["opt"]
    losses = np.zeros((steps,), np.float32)
    losses[:start] = history[:start]
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="training exits", disable=not progress)
    for step in bar:
        tokens, lengths = batches[step % len(batches)]
        exit_params, opt_state, loss = train_step(exit_params, opt_state, model.params, tokens, lengths, w,
                                                  config=model.config, optimizer=optimizer)
        losses[step] = float(loss)
        bar.set_postfix(loss=f"{losses[step]:.4f}")
        done = step + 1
        if manager is not None and (done % save_every == 0 or done == steps):
            manager.save(done, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"exits": exit_params, "opt": opt_state, "step": jnp.int32(done)}),
                log=ocp.args.JsonSave({"losses": losses[:done].tolist()})))
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return jax.tree.map(jnp.asarray, exit_params), losses, start
