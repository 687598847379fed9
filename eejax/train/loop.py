"""The exit-training loop: optax steps over a fixed list of batches, a progress bar, and orbax
checkpoints that a rerun resumes from (to the same state as an uninterrupted run)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from eejax.errors import EejaxError, UnsupportedModelError
from eejax.models.registry import model_module
from eejax.train import runs
from eejax.train.data import exit_batch
from eejax.train.exit_training import check_exit_layers, layer_weights, train_step


def check_decoder_only(config, what: str) -> None:
    """`what` trains on whole sequences of a decoder-only model (LayerSkip's layer dropout and
    its self-speculation): refused by name for an encoder-decoder."""
    if model_module(config).ENCODER_DECODER:
        raise UnsupportedModelError(f"{what} runs on decoder-only (Llama-family) models, not {config.architecture}")


def train_exit_adapters(
    model,
    batches,
    *,
    steps: int,
    learning_rate: float = 1e-3,
    weights: str = "calm",
    exit_layers=None,
    ce_weight: float = 0.0,
    positions_per_row: int | None = None,
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    save_every: int = 50,
    progress: bool = True,
    on_step=None,
):
    """Trains the adapters in `model.params["exits"]` by self-distillation for `steps` optax
    steps (adam, learning rate decayed to 0 on a cosine); step i uses batches[i % len(batches)]
    (tokens [B, T], lengths [B]) and trains the exits after `exit_layers` layers (default all
    1..L-1) on `positions_per_row` positions of each row drawn with (seed, i) (None: all).
    `ce_weight` adds that much cross-entropy on the data's next tokens. With `checkpoint_dir`,
    (exits, optimizer state, step, losses) are saved every `save_every` steps and at the end, and
    a rerun resumes from the latest (a checkpoint being written when the run is interrupted is
    finished first). `on_step(step, loss)` is called after each step. Only the adapters and
    classifiers train. Returns (exit_params: the model's exits with the trained ones and
    `exit_layers`, the trained exits; losses [steps]; the step it started from)."""
    from eejax.models.exits import ADAPTER_KEYS, CLASSIFIER_KEYS, has_adapters

    config = model.config
    if not has_adapters(model.params.get("exits")):
        raise EejaxError(
            "the model has no exit adapters to train; add them with eejax.init_exits(model, adapter_rank=R)"
        )
    if steps < 1 or save_every < 1:
        raise EejaxError(f"steps and save_every must be >= 1, got {steps} and {save_every}")
    if not batches:
        raise EejaxError("no training batches")
    if learning_rate <= 0 or ce_weight < 0:
        raise EejaxError(f"learning_rate must be > 0 and ce_weight >= 0, got {learning_rate} and {ce_weight}")
    trained = check_exit_layers(range(1, config.num_layers) if exit_layers is None else exit_layers, config.num_layers)
    optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, steps))
    w = jnp.asarray(layer_weights(weights, config.num_layers, trained))
    stored = model.params["exits"]
    trainable = {k: v for k, v in stored.items() if k in ADAPTER_KEYS + CLASSIFIER_KEYS}
    state = {"exits": trainable, "opt": optimizer.init(trainable), "step": jnp.int32(0)}
    manager, state, log = runs.resume(checkpoint_dir, state, {"losses": []})
    history = list(log["losses"])
    start = int(state["step"])
    if start > steps:
        raise EejaxError(f"the checkpoint in {checkpoint_dir} is at step {start}, past the {steps} steps asked")
    exit_params, opt_state = state["exits"], state["opt"]
    losses = np.zeros((steps,), np.float32)
    losses[:start] = history[:start]
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="training exits", disable=not progress)
    try:
        for step in bar:
            batch = exit_batch(batches[step % len(batches)], positions_per_row, np.random.default_rng([seed, step]))
            exit_params, opt_state, loss = train_step(
                exit_params,
                opt_state,
                model.params,
                batch,
                trained,
                w,
                jnp.float32(ce_weight),
                config=config,
                optimizer=optimizer,
            )
            losses[step] = float(loss)
            bar.set_postfix(loss=f"{losses[step]:.4f}")
            done = step + 1
            if manager is not None and (done % save_every == 0 or done == steps):
                runs.save(
                    manager,
                    done,
                    {"exits": exit_params, "opt": opt_state, "step": jnp.int32(done)},
                    {"losses": losses[:done].tolist()},
                )
            if on_step is not None:
                on_step(step, losses[step])
    finally:
        bar.close()
        if manager is not None:
            manager.wait_until_finished()
            manager.close()
    # The trained exits become the default check points of early exit (`ExitConfig.check_layers`).
    kept = {**stored, **jax.tree.map(jnp.asarray, exit_params), "exit_layers": jnp.asarray(trained, jnp.int32)}
    return kept, losses, start


def fit_exit_adapters(
    model,
    prompts,
    *,
    adapter_rank: int = 128,
    continuation_tokens: int = 64,
    max_len: int = 512,
    batch_size: int = 4,
    steps: int = 200,
    progress: bool = True,
    **train_options,
):
    """Makes `model` exit-capable: adds identity exit adapters of rank `adapter_rank` (unless it
    has adapters, which then train further), builds the data (each prompt followed by
    `continuation_tokens` greedy tokens of the model itself, at most `max_len` tokens, in batches
    of `batch_size`; an encoder-decoder's rows are its decoder's start token and continuation,
    attending to the prompt: `train.data.training_batches`) and trains the adapters for `steps`
    steps (`train_options` go to `train_exit_adapters`). `prompts` are strings or token-id
    lists. Returns (the model with trained exits, losses [steps])."""
    from eejax.decode.prompts import prompt_token_ids
    from eejax.loading.model import init_exits
    from eejax.models.exits import has_adapters
    from eejax.train.data import training_batches

    if not 0 <= continuation_tokens < max_len:
        raise EejaxError(f"continuation_tokens must lie in [0, max_len = {max_len}), got {continuation_tokens}")
    if train_options.get("exit_layers") is not None:
        check_exit_layers(train_options["exit_layers"], model.config.num_layers)
    ids, _ = prompt_token_ids(model.tokenizer, prompts)
    exits = model.params.get("exits") or {}
    if not has_adapters(exits):
        adapters = init_exits(model, adapter_rank=adapter_rank, classifier=False).params["exits"]
        model = model.with_params({**model.params, "exits": {**exits, **adapters}})
    cut = [p[: max_len - continuation_tokens] for p in ids]
    batches = training_batches(model, cut, continuation_tokens, batch_size, max_len, progress=progress)
    trained, losses, _ = train_exit_adapters(model, batches, steps=steps, progress=progress, **train_options)
    return model.with_params({**model.params, "exits": trained}), losses
