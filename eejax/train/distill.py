"""Self-distillation data for LayerSkip training: windows of the prompt texts, each followed by
the model's own continuation (greedy, or sampled), with the original model's next-token
distribution (its top k, and the rest of its mass as one outcome) at every position as the target."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eejax.errors import EejaxError
from eejax.models.registry import model_module
from eejax.train.forward import layer_states


def text_windows(token_lists: list[list[int]], window: int, max_windows: int) -> list[list[int]]:
    """Consecutive `window`-token pieces of each token list (at most `max_windows` per list; a
    list shorter than one window gives itself)."""
    if window < 1 or max_windows < 1:
        raise EejaxError(f"window and max_windows must be >= 1, got {window} and {max_windows}")
    pieces = []
    for ids in token_lists:
        starts = range(0, max(len(ids) - window, 0) + 1, window)
        pieces += [ids[s : s + window] for s in list(starts)[:max_windows]]
    return [p for p in pieces if p]


def continue_windows(
    model,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    sampled_every: int = 2,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = True,
) -> list[list[int]]:
    """Each prompt followed by `new_tokens` of the model's greedy continuation; every
    `sampled_every`-th prompt (0: none) also once with a sampled one (temperature, top_p)."""
    from tqdm.auto import tqdm

    from eejax.engine.generate import generate

    groups = [(prompts, 0.0)] + ([(prompts[::sampled_every], temperature)] if sampled_every else [])
    sequences = []
    with tqdm(
        total=sum(len(g) for g, _ in groups), desc="generating continuations", unit="seq", disable=not progress
    ) as bar:
        for group, temp in groups:
            for start in range(0, len(group), batch_size):
                chunk = group[start : start + batch_size]
                res = generate(
                    model,
                    chunk,
                    max_new_tokens=new_tokens,
                    batch_size=batch_size,
                    temperature=temp,
                    top_p=top_p if temp else 1.0,
                    seed=seed + start,
                    spec=None,  # full depth's samples
                )
                sequences += [list(p) + list(o) for p, o in zip(chunk, res.tokens)]
                bar.update(len(chunk))
    return sequences


@dataclasses.dataclass
class DistillData:
    """Right-padded sequences and their teacher targets (numpy; saved with `save`).

    tokens [N, T] int32, lengths [N] int32, target_ids [N, T, K] int32, target_probs [N, T, K]
    float16 (the teacher's top-K next-token probabilities at each position; 1 - their sum is its tail)."""

    tokens: np.ndarray
    lengths: np.ndarray
    target_ids: np.ndarray
    target_probs: np.ndarray

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(".partial.npz")
        np.savez(tmp, **dataclasses.asdict(self))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> DistillData:
        with np.load(path) as f:
            return cls(**{k.name: f[k.name] for k in dataclasses.fields(cls)})

    def batch(self, rows: np.ndarray):
        """A `layerskip.DistillBatch` of `rows`, cut to their longest length; every position
        of a sequence counts (the teacher has a target at each)."""
        from eejax.train.layerskip import DistillBatch

        lengths = self.lengths[rows]
        t = int(lengths.max())
        weights = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
        return DistillBatch(
            self.tokens[rows, :t],
            lengths,
            weights,
            self.target_ids[rows, :t],
            self.target_probs[rows, :t].astype(np.float32),
        )


@functools.partial(jax.jit, static_argnames=("config", "top_k"))
def _teacher_top_k(params, tokens, lengths, *, config, top_k):
    logits = model_module(config).lm_head(params, layer_states(params, tokens, lengths, config)[-1], config)
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)
    return ids, jnp.exp(logp)  # not renormalised: the rest of the mass is the tail's


def teacher_targets(
    model, sequences: list[list[int]], *, top_k: int = 32, batch_size: int = 8, progress: bool = True
) -> DistillData:
    """The model's own next-token distribution at every position of `sequences`: its `top_k`
    most likely ids and their probabilities, whose sum falls short of 1 by the tail's mass."""
    from tqdm.auto import tqdm

    if not sequences or min(map(len, sequences)) < 1:
        raise EejaxError("no sequences to compute teacher targets for")
    if not 1 <= top_k <= model.config.vocab_size:
        raise EejaxError(f"top_k must lie in [1, {model.config.vocab_size}], got {top_k}")
    n, t = len(sequences), max(map(len, sequences))
    tokens = np.zeros((n, t), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    lengths = np.asarray([len(s) for s in sequences], np.int32)
    ids = np.zeros((n, t, top_k), np.int32)
    probs = np.zeros((n, t, top_k), np.float16)
    for start in tqdm(range(0, n, batch_size), desc="teacher targets", unit="batch", disable=not progress):
        rows = np.arange(start, min(start + batch_size, n))
        rows = np.pad(rows, (0, batch_size - len(rows)), mode="edge")  # one program for the last batch too
        i, p = _teacher_top_k(
            model.params, jnp.asarray(tokens[rows]), jnp.asarray(lengths[rows]), config=model.config, top_k=top_k
        )
        ids[rows], probs[rows] = np.asarray(i), np.asarray(p).astype(np.float16)
    return DistillData(tokens, lengths, ids, probs)
