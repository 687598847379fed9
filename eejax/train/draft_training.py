"""Stage 2 of draft-head training: optax steps over the feature cache (`draft_features`); the
frozen model is not run, only the draft head (fc + one decoder layer) and the head's rows.

At position p the draft reads the model's feature f_p (with uniform noise of `noise` x its RMS,
so it tolerates its own errors) and the embedding of token p+1, and is trained on:

- the soft cross-entropy of its head to the model's next-token distribution at p+1 (the cached
  top-K probabilities), over the reduced exit head's tokens when the model has one (the head that
  drafts: FR-Spec), else the full head;
- `feature_weight` x a smooth-L1 regression of its output to f_{p+1} (EAGLE's feature loss);
- with `unroll` = k > 1, the same losses on k - 1 more passes, each fed the previous pass's
  predicted features (EAGLE-3's training-time test: drafting from its own outputs is what decoding
  does). Pass k attends as the (k+1)-th draft of a round does (`draft_head.unrolled_forward`): to
  keys from the model's features before the round, and to the round's own earlier drafts.
  (Until 2026-11-26 pass k attended to pass k's own keys at every earlier position, which no
  round sees. On the shipped head and the held-out rows that mask gave 0.614 / 0.598 at the 2nd /
  3rd draft, the decoding one 0.599 / 0.559; decoding itself accepted the 2nd draft after the 1st
  0.56 of the time and the 3rd after two 0.47, at batch 20.)
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eejax.errors import EejaxError
from eejax.models import draft_head, exits
from eejax.models.modules import embed
from eejax.train import runs


def _reduced_index(params, vocab_size: int):
    """(head rows the draft's loss uses [K, D] or None for the full head, index [V] of each
    token among them, -1 outside)."""
    e = params.get("exits")
    if not exits.has_reduced_head(e):
        return None, jnp.arange(vocab_size, dtype=jnp.int32)
    ids = np.asarray(e["vocab_ids"])
    index = np.full((vocab_size,), -1, np.int32)
    index[ids] = np.arange(ids.size, dtype=np.int32)
    return e["vocab_head"], jnp.asarray(index)


def _counted(batch, width: int):
    """[B, width] which predictions count: those of a real next token (p + 1 < length), and with
    a batch["first"] [B], only those of tokens at or after it (the generated ones of an evaluation)."""
    p = jnp.arange(width)[None, :]
    valid = p < (batch["lengths"] - 1)[:, None]
    if "first" in batch:
        valid &= p + 1 >= batch["first"][:, None]
    return valid


def draft_losses(draft, params, batch, key, *, config, noise: float, feature_weight: float, unroll: int, index):
    """Loss and per-pass top-1 agreement of the draft on a batch of windows (see the module
    docstring). batch: tokens [B, T], lengths [B], features [B, T, D], top_ids/top_probs [B, T, K],
    optionally first [B] (`_counted`)."""
    tokens, lengths = batch["tokens"], batch["lengths"]
    feats = batch["features"].astype(jnp.float32)
    x = feats[:, :-1]  # f_p, p = 0..T-2
    if "fuse" in draft:  # the first draft also reads lower layers' states (EAGLE-3)
        x = draft_head.fused_feature(draft, x, batch["states"][:, :-1], config)
    rms = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True)))  # sqrt'(0) at padding is inf
    x = x + noise * rms * jax.random.uniform(key, x.shape, minval=-1.0, maxval=1.0)
    emb = embed(params, tokens[:, 1:]).astype(jnp.float32)  # token p+1
    target_f = feats[:, 1:]
    top_ids, top_p = batch["top_ids"][:, 1:], batch["top_probs"][:, 1:].astype(jnp.float32)
    valid = _counted(batch, x.shape[1])
    where = index[top_ids]  # [B, T-1, K] position in the drafting head, -1 outside
    weight = jnp.where(where >= 0, top_p, 0.0)
    total, agree = 0.0, []
    preds = draft_head.unrolled_forward(config, draft, x, emb, lengths - 1, unroll)
    for k in range(unroll):  # pass k: the (k+1)-th draft of the round starting at p - k
        counted = valid & (jnp.arange(x.shape[1]) >= k)[None]
        logits = draft_head.draft_logits(params, preds[k], config, reduced="vocab_head" in (params.get("exits") or {}))
        logq = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.sum(weight * jnp.take_along_axis(logq, jnp.maximum(where, 0), axis=-1), axis=-1)
        feat = jnp.mean(optax.huber_loss(preds[k], target_f, delta=1.0), axis=-1)
        per_pos = ce + feature_weight * feat
        n = jnp.maximum(counted.sum(), 1)
        total = total + jnp.sum(jnp.where(counted, per_pos, 0.0)) / n / unroll
        hit = jnp.argmax(logq, axis=-1) == where[..., 0]
        agree.append(jnp.sum(counted & hit) / n)
    return total, jnp.stack(agree)


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "noise", "feature_weight", "unroll"))
def train_step(draft, opt_state, params, batch, key, index, *, config, optimizer, noise, feature_weight, unroll):
    (loss, agree), grads = jax.value_and_grad(draft_losses, has_aux=True)(
        draft, params, batch, key, config=config, noise=noise, feature_weight=feature_weight, unroll=unroll, index=index
    )
    updates, opt_state = optimizer.update(grads, opt_state, draft)
    return optax.apply_updates(draft, updates), opt_state, loss, agree


WIDTH_STEP = 64  # batches are cut to their longest window rounded up to this: few compiled shapes


def _length_order(lengths: np.ndarray, seed: int) -> np.ndarray:
    """Window indices by width (lengths rounded up to WIDTH_STEP), shuffled within a width: a batch
    of neighbours has little padding yet mixes sources (sampled copies of one prompt have the same
    length and would otherwise fill a batch)."""
    shuffle = np.random.default_rng([seed, 2**31 - 1]).permutation(len(lengths))
    return np.lexsort((shuffle, -(-np.asarray(lengths) // WIDTH_STEP)))


def _batch(data: dict, by_length: np.ndarray, batch_size: int, rng: np.random.Generator) -> dict:
    """`batch_size` windows of similar lengths: consecutive ones in `_length_order` from a random
    start, cut to their longest rounded up to WIDTH_STEP (little padding)."""
    n = len(by_length)
    start = int(rng.integers(n))
    rows = by_length[(start + np.arange(min(batch_size, n))) % n]
    width = min(-(-int(data["lengths"][rows].max()) // WIDTH_STEP) * WIDTH_STEP, data["tokens"].shape[1])
    return {k: data[k][rows][:, :width] if data[k].ndim > 1 else data[k][rows] for k in data}


def train_draft(
    model,
    data: dict,
    *,
    steps: int,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    noise: float = 0.1,
    feature_weight: float = 0.1,
    unroll: int = 2,
    seed: int = 0,
    hours: float | None = None,
    checkpoint_dir: str | Path | None = None,
    save_every: int = 100,
    progress: bool = True,
    on_step=None,
):
    """Trains `model.params["draft"]` (initialised by `draft_head.init_draft` when absent) on a
    loaded feature cache `data` for `steps` steps (adamw, warmup then cosine decay), or until
    `hours` have passed. Returns (the draft params, losses [steps run], agreement [steps run,
    unroll]: the top-1 agreement of each pass with the model's next token)."""
    from tqdm.auto import tqdm

    config = model.config
    draft_head.check_model(config)
    if steps < 1 or batch_size < 1 or save_every < 1 or unroll not in (1, 2, 3):
        raise EejaxError(
            f"steps, batch_size and save_every must be >= 1 and unroll 1 to 3, got {steps}, "
            f"{batch_size}, {save_every} and {unroll}"
        )
    if learning_rate <= 0 or noise < 0 or feature_weight < 0 or (hours is not None and hours <= 0):
        raise EejaxError("learning_rate and hours must be > 0, noise and feature_weight >= 0")
    draft = model.params.get("draft") or draft_head.init_draft(config, jax.random.PRNGKey(seed))
    if "fuse" in draft and ("states" not in data or data["states"].shape[2] * config.hidden_size != len(draft["fuse"])):
        raise EejaxError(
            f"the draft fuses {len(draft['fuse']) // config.hidden_size} layers' states; the feature cache keeps "
            f"{data['states'].shape[2] if 'states' in data else 0} (build it with those layers)"
        )
    if data["features"].shape[-1] != config.hidden_size:
        raise EejaxError(
            f"the feature cache has features of width {data['features'].shape[-1]}, the model "
            f"{config.hidden_size}: it was built for another model"
        )
    params = {k: v for k, v in model.params.items() if k != "draft"}
    warmup = min(100, steps // 10 + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1))  # 1 step too
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    state = {"draft": draft, "opt": optimizer.init(draft), "step": jnp.int32(0)}
    manager, state, log = runs.resume(checkpoint_dir, state, {"losses": [], "agree": []})
    start = int(state["step"])
    draft, opt_state = state["draft"], state["opt"]
    _, index = _reduced_index(params, config.vocab_size)
    by_length = _length_order(data["lengths"], seed)
    began = time.monotonic()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="training draft", disable=not progress)
    done = start
    try:
        for step in bar:
            rng = np.random.default_rng([seed, step])
            batch = _batch(data, by_length, batch_size, rng)
            draft, opt_state, loss, agree = train_step(
                draft,
                opt_state,
                params,
                batch,
                jax.random.PRNGKey(rng.integers(2**31)),
                index,
                config=config,
                optimizer=optimizer,
                noise=float(noise),
                feature_weight=float(feature_weight),
                unroll=int(unroll),
            )
            log["losses"].append(float(loss))
            log["agree"].append([float(a) for a in agree])
            done = step + 1
            bar.set_postfix(loss=f"{log['losses'][-1]:.3f}", top1=f"{log['agree'][-1][0]:.2f}")
            out_of_time = hours is not None and time.monotonic() - began > hours * 3600
            if manager is not None and (done % save_every == 0 or done == steps or out_of_time):
                runs.save(manager, done, {"draft": draft, "opt": opt_state, "step": jnp.int32(done)}, log)
            if on_step is not None:
                on_step(step, log["losses"][-1])
            if out_of_time:
                break
    finally:
        bar.close()
        if manager is not None:
            manager.wait_until_finished()
            manager.close()
    return draft, np.asarray(log["losses"]), np.asarray(log["agree"])


@functools.partial(jax.jit, static_argnames=("config", "unroll"))
def _agreement(draft, params, batch, index, *, config, unroll):
    _, agree = draft_losses(
        draft,
        params,
        batch,
        jax.random.PRNGKey(0),
        config=config,
        noise=0.0,
        feature_weight=0.0,
        unroll=unroll,
        index=index,
    )
    counted = _counted(batch, batch["tokens"].shape[1] - 1)
    counts = jnp.stack([jnp.sum(counted[:, k:]) for k in range(unroll)])  # pass k counts p >= k
    return agree * jnp.maximum(counts, 1), counts


def heldout_agreement(model, data: dict, *, unroll: int = 3, first=None, batch_size: int = 8) -> np.ndarray:
    """Teacher-forced top-1 agreement [unroll] of `model`'s draft head with the model's next token
    on a loaded feature cache `data`, without noise: pass k after the first reads the draft's own
    predicted features and attends as the (k+1)-th draft of a round does after k accepted ones
    (`draft_head.unrolled_forward`). `first` [N]:
    per window, the first position counted (the tokens generated after a prompt); default all."""
    if not draft_head.has_draft(model.params):
        raise EejaxError("the model has no draft head to evaluate")
    params = {k: v for k, v in model.params.items() if k != "draft"}
    _, index = _reduced_index(params, model.config.vocab_size)
    n = len(data["lengths"])
    first = np.zeros(n, np.int32) if first is None else np.asarray(first, np.int32)
    hits, count = np.zeros(unroll), np.zeros(unroll)
    fused = ("states",) if "fuse" in model.params["draft"] else ()  # only a fused head reads them
    if fused and "states" not in data:
        raise EejaxError("the draft fuses lower layers' states; this feature cache keeps none (build it with layers)")
    for s in range(0, n, batch_size):
        rows = np.arange(s, min(s + batch_size, n))
        batch = {k: data[k][rows] for k in ("tokens", "lengths", "features", "top_ids", "top_probs") + fused}
        agree, c = _agreement(
            model.params["draft"], params, batch | {"first": first[rows]}, index, config=model.config, unroll=unroll
        )
        hits += np.asarray(agree)
        count += np.asarray(c)
    return hits / np.maximum(count, 1)
