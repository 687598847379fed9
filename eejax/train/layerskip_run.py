"""A resumable LayerSkip training run: self-distillation data built once, optax steps on LoRA
factors (or the whole model) with checkpoints a later process continues from, a time budget per
invocation, and the trained model written at the end.

The run directory holds `run.json` (the settings; a resume must ask for the same), `data.npz`
(`DistillData`), `checkpoints/` (orbax: trainable params, optimizer state, step, and the log),
`loss.png`, and once the last step is done `delta.safetensors` (the LoRA factors) and `model/`
(the merged eejax checkpoint with its trained exits as the default check layers).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from eejax.errors import EejaxError
from eejax.train.distill import DistillData
from eejax.train.layerskip import LayerSkipConfig, enabled_exits, exit_loss_scales, layerskip_train_step, skipped_layers


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Everything that decides a run's result (stored in run.json)."""

    steps: int = 600
    batch_size: int = 8
    learning_rate: float = 2e-4
    lora_rank: int = 16  # 0: full fine-tuning
    exit_positions: int = 64  # positions per row of the early exits' losses (0: all)
    seed: int = 0
    layerskip: LayerSkipConfig = LayerSkipConfig()

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.lora_rank < 0 or self.exit_positions < 0:
            raise EejaxError("steps and batch_size must be >= 1, lora_rank and exit_positions >= 0")
        if not self.learning_rate > 0:
            raise EejaxError(f"the learning rate must be > 0, got {self.learning_rate}")
        if self.layerskip.total_steps != self.steps:  # the curricula's T is the run's length
            object.__setattr__(self, "layerskip", dataclasses.replace(self.layerskip, total_steps=self.steps))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RunSettings:
        ls = dict(d["layerskip"])
        if ls.get("exit_layers") is not None:
            ls["exit_layers"] = tuple(ls["exit_layers"])
        return cls(**{**d, "layerskip": LayerSkipConfig(**ls)})


def optimizer_for(settings: RunSettings):
    """adam with a linear warm-up over the first 5% of the steps, then cosine decay to 10%."""
    warmup = max(1, settings.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.learning_rate, warmup, max(settings.steps, warmup + 1), end_value=settings.learning_rate / 10
    )  # max: one step is a run too
    return optax.adam(schedule)


def initial_trainable(model, settings: RunSettings) -> tuple[dict, dict]:
    """(trainable, frozen) of `layerskip_train_step`: LoRA factors over the frozen model, or the
    whole params for full fine-tuning."""
    from eejax.models.lora import init_lora

    params = {k: v for k, v in model.params.items() if k != "exits"}
    if settings.lora_rank == 0:  # a copy: the step donates what it trains
        return jax.tree.map(jnp.copy, params), {"layers": {}}
    key = jax.random.PRNGKey(settings.seed)
    return {"layers": init_lora(params["layers"], settings.lora_rank, key)}, params


def step_rows(settings: RunSettings, num_rows: int, step: int) -> np.ndarray:
    """The data rows of `step`: epochs of a permutation drawn from (seed, epoch), cut into batches."""
    per_epoch = max(num_rows // settings.batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([settings.seed, epoch]).permutation(num_rows)
    rows = order[i * settings.batch_size : (i + 1) * settings.batch_size]
    return np.resize(rows, settings.batch_size)  # fewer rows than a batch: repeat them


def step_inputs(settings: RunSettings, data: DistillData, step: int, num_layers: int):
    """(batch, skip [L], exit_index [n], exit_scale [n], exit_positions [B, P] | None) of `step`,
    all drawn from (seed, step): a resumed run sees what an uninterrupted one would."""
    batch = data.batch(step_rows(settings, len(data.lengths), step))
    cfg = settings.layerskip
    skip = skipped_layers(cfg, step, num_layers, settings.seed)
    index, scale = enabled_exits(exit_loss_scales(cfg, step, num_layers))
    p = settings.exit_positions
    positions = None
    if p and p < batch.tokens.shape[1]:
        rng = np.random.default_rng([settings.seed, step, 11])
        positions = np.stack([np.sort(rng.choice(int(n), p, replace=int(n) < p)) for n in batch.lengths])
        positions = positions.astype(np.int32)
    return batch, skip, index, scale, positions


def _manager(checkpoint_dir: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(checkpoint_dir.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def train_layerskip(
    model,
    data: DistillData,
    settings: RunSettings,
    checkpoint_dir: str | Path,
    *,
    hours: float | None = None,
    save_every: int = 25,
    progress: bool = True,
    on_step=None,
):
    """Runs the steps from the latest checkpoint in `checkpoint_dir` (or from the start) until
    `settings.steps` are done or `hours` have passed, saving every `save_every` steps and at the
    end. `on_step(step, loss)` is called after each step. Returns (trainable, log, done): log
    holds per step the loss, the (layer index, KL) pairs of the heads evaluated (the last layer's
    included), the layers computed, the heads evaluated and the seconds; done is whether the last
    step ran."""
    import orbax.checkpoint as ocp

    if save_every < 1:
        raise EejaxError(f"save_every must be >= 1, got {save_every}")
    if hours is not None and not hours > 0:
        raise EejaxError(f"hours must be > 0, got {hours}")
    config = model.config
    optimizer = optimizer_for(settings)
    trainable, frozen = initial_trainable(model, settings)
    state = {"trainable": trainable, "opt": optimizer.init(trainable), "step": jnp.int32(0)}
    log = {"loss": [], "exit_losses": [], "layers_run": [], "heads": [], "seconds": []}
    manager = _manager(Path(checkpoint_dir))
    latest = manager.latest_step()
    if latest is not None:
        restored = manager.restore(
            latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(state), log=ocp.args.JsonRestore())
        )
        state, log = restored.state, {k: list(v) for k, v in restored.log.items()}
    start = int(state["step"])
    trainable, opt_state = state["trainable"], state["opt"]
    deadline = None if hours is None else time.monotonic() + hours * 3600
    bar = tqdm(
        range(start, settings.steps),
        initial=start,
        total=settings.steps,
        desc="LayerSkip training",
        unit="step",
        disable=not progress,
    )

    def save(done):
        # A copy of the log: orbax saves in the background while the next steps append to it (a
        # resumed run then re-ran steps its restored log already had).
        manager.save(
            done,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"trainable": trainable, "opt": opt_state, "step": jnp.int32(done)}),
                log=ocp.args.JsonSave({k: list(v) for k, v in log.items()}),
            ),
        )

    done = start
    try:
        for step in bar:
            t0 = time.perf_counter()
            batch, skip, index, scale, positions = step_inputs(settings, data, step, config.num_layers)
            trainable, opt_state, loss, (losses, layers_run, heads) = layerskip_train_step(
                trainable,
                opt_state,
                frozen,
                jax.tree.map(jnp.asarray, batch),
                jnp.asarray(skip),
                jnp.asarray(index),
                jnp.asarray(scale),
                None if positions is None else jnp.asarray(positions),
                config=config,
                optimizer=optimizer,
            )
            loss = float(loss)
            if not np.isfinite(loss):
                raise EejaxError(
                    f"the loss became {loss} at step {step}; lower the learning rate "
                    f"(the last checkpoint, before this step, is kept)"
                )
            log["loss"].append(loss)
            log["exit_losses"].append([[int(i), float(x)] for i, x in zip(index, np.asarray(losses))])
            log["layers_run"].append(int(layers_run))
            log["heads"].append(int(heads))
            log["seconds"].append(time.perf_counter() - t0)
            done = step + 1
            bar.set_postfix(loss=f"{loss:.3f}", final=f"{float(losses[-1]):.3f}")
            if on_step is not None:
                on_step(step, loss)
            out_of_time = deadline is not None and time.monotonic() > deadline
            if done % save_every == 0 or done == settings.steps or out_of_time:
                save(done)
            if out_of_time:
                break
    finally:
        bar.close()
        manager.wait_until_finished()
        manager.close()
    return trainable, log, done == settings.steps


def trained_model(model, trainable: dict, settings: RunSettings, data: DistillData, *, exit_vocab_size: int = 8192):
    """The model the run trained: the LoRA factors merged (or the fine-tuned params), its trained
    exits recorded as the default check layers, and a reduced exit head of the `exit_vocab_size`
    most frequent tokens of the training data (0: none)."""
    from eejax.models.exits import set_exit_vocab
    from eejax.models.lora import merge_lora
    from eejax.train.exit_vocab import most_frequent

    base = {k: v for k, v in model.params.items() if k != "exits"}
    params = base | trainable if settings.lora_rank == 0 else merge_lora(base, trainable["layers"])
    exits = {}
    if settings.layerskip.exit_layers is not None:
        exits["exit_layers"] = jnp.asarray(settings.layerskip.exit_layers, jnp.int32)
    params = {**params, "exits": exits} if exits else params
    if exit_vocab_size:
        counts = np.bincount(
            data.tokens[np.arange(data.tokens.shape[1])[None] < data.lengths[:, None]],
            minlength=model.config.vocab_size,
        )
        ids = most_frequent(counts, exit_vocab_size, always=model.eos_token_ids)
        params = set_exit_vocab(params, ids, model.config.tie_embeddings)
    return model.with_params(params)


def export_run(
    model,
    trainable: dict,
    settings: RunSettings,
    data: DistillData,
    run_dir: str | Path,
    *,
    base_name: str,
    exit_vocab_size: int = 8192,
) -> Path:
    """Writes `run_dir/model` (the trained eejax checkpoint) and, for LoRA, `run_dir/delta.safetensors`:
    the factors, the exit vocabulary and metadata (base model, settings, the probe's 64 largest
    logits and their ids)."""
    from eejax.loading.deltas import probe_logits, probe_record, save_delta
    from eejax.loading.model import save

    run_dir = Path(run_dir)
    trained = trained_model(model, trainable, settings, data, exit_vocab_size=exit_vocab_size)
    meta = {"base": base_name, "settings": settings.to_json(), "exit_vocab_size": exit_vocab_size}
    save(trained, run_dir / "model", overwrite=True, metadata={"layerskip": meta})
    if settings.lora_rank:
        extra = {"exit_vocab_ids": np.asarray(trained.params["exits"]["vocab_ids"])} if exit_vocab_size else {}
        save_delta(
            run_dir / "delta.safetensors",
            {k: np.asarray(v) for k, v in trainable["layers"].items()},
            extra,
            {**meta, **probe_record(*probe_logits(trained), top=64)},
        )
    return run_dir / "model"


def load_run(run_dir: str | Path):
    """(the model at a run's latest checkpoint, as `trained_model` builds it; the step it is at):
    for looking at a run while it trains, or after."""
    import orbax.checkpoint as ocp

    from eejax.loading import load

    run_dir = Path(run_dir)
    if not (run_dir / "run.json").exists():
        raise EejaxError(f"{run_dir} is not a LayerSkip run directory (no run.json)")
    run = json.loads((run_dir / "run.json").read_text())
    settings = RunSettings.from_json(run["settings"])
    model = load(run["model"], quantization=None)
    trainable, _ = initial_trainable(model, settings)
    manager = _manager(run_dir / "checkpoints")
    try:
        step = manager.latest_step()
        if step is None:
            raise EejaxError(f"{run_dir} has no checkpoint yet")
        optimizer = optimizer_for(settings)
        state = {"trainable": trainable, "opt": optimizer.init(trainable), "step": jnp.int32(0)}
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(state)))
    finally:
        manager.close()
    data = DistillData.load(run_dir / "data.npz")
    trained = trained_model(
        model, restored.state["trainable"], settings, data, exit_vocab_size=run.get("exit_vocab_size", 8192)
    )
    return trained, step
