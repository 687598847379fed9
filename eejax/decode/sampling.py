"""Next-token choice from logits: greedy, or temperature with top-k / top-p filtering (after the
repetition / frequency / presence penalties of `penalties.py`, when a row has them).

Randomness is per row and per position: the token a row generates at (absolute) index t is drawn
with `token_keys(keys, t, stream)`, the row's own key folded with t and a stream id. So a row's
sampled tokens depend only on its key and its inputs: not on the other rows of the batch, the
batch's size, or a preemption that makes the engine recompute the row."""

from __future__ import annotations

import dataclasses
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from eejax.decode import early_exit
from eejax.decode.argmax import argmax
from eejax.errors import EejaxError
from eejax.models.common import log_softmax, softmax

# Samplers, the static part of sampling (the values ride per row in a `RowSampling`): every row
# greedy (the argmax alone); temperature only (no row filters: no sort); top-k / top-p filters.
GREEDY, TEMPERATURE, FILTERED = "greedy", "temperature", "filtered"


def _option(default: float, help: str, **bounds: float):
    """A sampling option's field: its default (its off value), what it does (`help`: the CLI's
    flags say it) and the bounds of its values (pydantic's ge / gt / le / lt: the HTTP schema's
    too); every value is a finite number."""
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds})


BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling options (host side), the one list of them: `generate`,
    `Engine`, `Engine.submit`, the CLI's flags and the HTTP schema's fields take these names
    (`override`) and read their bounds and help from here (`options`).
    temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off; the penalties
    (`penalties.py`: OpenAI's presence and frequency in [-2, 2], vLLM's and HF's repetition > 0)
    are off at 0, 0 and 1. On device they ride per row in a `RowSampling`."""

    temperature: float = _option(0.0, "0 is greedy (default)", ge=0)
    top_k: int = _option(0, "sample among the k most likely tokens (0 = off, the default)", ge=0)
    top_p: float = _option(1.0, "nucleus sampling mass (1.0 = off, the default)", gt=0, le=1)
    presence_penalty: float = _option(
        0.0, "subtract this from the logit of every token already in the output ([-2, 2]; 0 = off)", ge=-2, le=2
    )
    frequency_penalty: float = _option(
        0.0, "subtract this times a token's count in the output from its logit ([-2, 2]; 0 = off)", ge=-2, le=2
    )
    repetition_penalty: float = _option(
        1.0,
        "divide a positive logit (multiply a negative one) of every token already in the prompt or output by "
        "this (> 0; 1.0 = off, the default; 1.1-1.3 tames loops like SmolLM2's)",
        gt=0,
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise EejaxError(f"{f.name} must be a number, got {value!r}")
            if f.type == "int" and int(value) != value:
                raise EejaxError(f"{f.name} must be an integer, got {value!r}")
            value = int(value) if f.type == "int" else float(value)
            bounds = f.metadata["bounds"]
            if not math.isfinite(value) or not all(BOUNDS[op][1](value, bound) for op, bound in bounds.items()):
                spelled = " and ".join(f"{BOUNDS[op][0]} {bound:g}" for op, bound in bounds.items())
                kind = "an integer" if f.type == "int" else "a finite number"
                raise EejaxError(f"{f.name} must be {kind} {spelled} (default {f.default:g}), got {value}")
            object.__setattr__(self, f.name, value)

    @classmethod
    def options(cls) -> dict[str, tuple[type, dict[str, float], str]]:
        """Each option's (type, bounds, help), in order."""
        return {
            f.name: (int if f.type == "int" else float, f.metadata["bounds"], f.metadata["help"])
            for f in dataclasses.fields(cls)
        }

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def override(self, **values) -> SamplingParams:
        """These options with `values` (of `names()`; None keeps this one's) in their place: how a
        request's keywords meet the engine's defaults. An unknown name is an EejaxError."""
        unknown = sorted(set(values) - set(self.names()))
        if unknown:
            raise EejaxError(
                f"unknown option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; the sampling options "
                f"are {', '.join(self.names())}"
            )
        given = {k: v for k, v in values.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (a static program option: the counts are kept and read)."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def sampler(self) -> str:
        """The code that draws its tokens (a static program option; see `sample`)."""
        if self.greedy:
            return GREEDY
        return FILTERED if self.top_k > 0 or self.top_p < 1 else TEMPERATURE

    def check_vocab(self, vocab_size: int) -> None:
        """Refuses a top_k larger than the model's vocabulary."""
        if self.top_k > vocab_size:
            raise EejaxError(f"top_k must be <= the vocabulary size {vocab_size} (0 = off), got {self.top_k}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """Sampling options per row, traced (so a new temperature compiles nothing):
    temperature [B] f32 (0: greedy), top_k [B] int32 (0: off), top_p [B] f32 (1: off), and the
    presence [B], frequency [B] (0: off) and repetition [B] (1: off) penalties, f32."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array

    @classmethod
    def of(cls, params: SamplingParams | list[SamplingParams], rows: int | None = None) -> RowSampling:
        """Host arrays of one option set for `rows` rows, or of a list of them (one per row)."""
        params = [params] * rows if isinstance(params, SamplingParams) else list(params)
        return cls(
            np.asarray([p.temperature for p in params], np.float32),
            np.asarray([p.top_k for p in params], np.int32),
            np.asarray([p.top_p for p in params], np.float32),
            np.asarray([p.presence_penalty for p in params], np.float32),
            np.asarray([p.frequency_penalty for p in params], np.float32),
            np.asarray([p.repetition_penalty for p in params], np.float32),
        )

    @property
    def greedy(self):
        """[B] bool: rows that take the argmax."""
        return (self.temperature == 0) | (self.top_k == 1)


def filtered_logits(logits, rows: RowSampling, sampler: str = FILTERED):
    """Temperature-scaled logits `[B, V]` with each row's tokens outside its top-k / top-p set
    to -inf (a greedy row's are left unscaled: it draws nothing). With the TEMPERATURE sampler
    no row filters: the scaled logits, no sort; on a CPU neither does FILTERED when no row's
    top-k or top-p is on."""
    t = rows.temperature[:, None]
    logits = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    if sampler != FILTERED:
        return logits
    if not early_exit.static_loops():
        # Every prefill takes this sampler (one program for all). When no row filters, the sort
        # below changes nothing and costs 3% of a 256-token SmolLM2 prefill on a CPU; on a GPU
        # the conditional would read its predicate back to the host, so it always sorts there.
        filters = jnp.any((rows.top_k > 0) | (rows.top_p < 1))
        return jax.lax.cond(filters, _filtered, lambda logits, rows: logits, logits, rows)
    return _filtered(logits, rows)


def _filtered(logits, rows: RowSampling):
    """`filtered_logits` of the FILTERED sampler, every row's top-k and top-p applied."""
    vocab = logits.shape[-1]
    descending = -jnp.sort(-logits, axis=-1)
    k = rows.top_k[:, None]
    kth = jnp.take_along_axis(descending, jnp.clip(k - 1, 0, vocab - 1), axis=-1)
    kth = jnp.where(k > 0, kth, -jnp.inf)
    descending = jnp.where(descending < kth, -jnp.inf, descending)
    probs = softmax(descending)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < rows.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where(rows.top_p[:, None] < 1, cutoff, -jnp.inf)
    return jnp.where(logits < jnp.maximum(kth, cutoff), -jnp.inf, logits)


# Streams of random numbers a row draws at one position (see `token_keys`).
SAMPLE, DRAFT, ACCEPT, RESAMPLE = range(4)


def seed_key(seed: int):
    """The PRNG key of an integer seed, all 64 bits of it (`jax.random.PRNGKey` keeps only the low
    32 without x64): negative seeds are taken modulo 2^64."""
    seed = int(seed) % 2**64
    return jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), seed >> 32)


def row_keys(key, index):
    """Per-row PRNG keys [B, 2] from one key: row i of a call gets fold_in(key, index[i]), so a
    row draws the same whatever batch it runs in (and the engine's request with seed s and
    choice j draws what row j of `generate(seed=s)` draws)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(index, jnp.uint32))


def token_keys(keys, index, stream: int):
    """keys [B, 2], index [B] (each row's absolute token index) -> the rows' keys [B, 2] for that
    token in `stream` (SAMPLE, DRAFT, ACCEPT or RESAMPLE)."""
    return jax.vmap(lambda k, i: jax.random.fold_in(jax.random.fold_in(k, i), stream))(keys, index)


def sample(logits, keys, rows: RowSampling, sampler: str):
    """logits [B, V], keys [B, 2] (one per row, see `token_keys`) -> token ids [B] int32.
    `sampler` (static): GREEDY when every row is greedy (the argmax alone, nothing drawn),
    TEMPERATURE when no row filters, else FILTERED; greedy rows take the argmax in any case."""
    greedy = argmax(logits)
    if sampler == GREEDY:
        return greedy
    drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, rows, sampler)).astype(jnp.int32)
    return jnp.where(rows.greedy, greedy, drawn)


def logprobs_of(logits, rows: RowSampling, sampler: str):
    """Log-probabilities [B, V] f32 of the distribution a token is drawn from: a greedy row's
    are the model's softmax (it draws nothing), a sampled row's after temperature, top-k and
    top-p (tokens filtered out get -inf): vLLM's "processed" logprobs."""
    model = log_softmax(logits)
    if sampler == GREEDY:
        return model
    return jnp.where(rows.greedy[:, None], model, log_softmax(filtered_logits(logits, rows, sampler)))


def expand_logits(reduced, ids, vocab_size: int):
    """Reduced logits [..., K] of tokens `ids` [K] -> [..., V] with -inf for every other token."""
    full = jnp.full(reduced.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(reduced)


def draft_proposal(logits, vocab_ids, keys, rows: RowSampling, sampler: str, vocab_size: int):
    """A draft's token [B] and the distribution q it was drawn from ([B, V]; [B, 0] when greedy)
    from its head's logits: [B, V], or [B, K] of the reduced head's tokens `vocab_ids` [K] (None:
    the full head). Greedy over the reduced set takes its argmax (ids increase, so ties agree)."""
    if vocab_ids is not None and sampler == GREEDY:
        return vocab_ids[argmax(logits)].astype(jnp.int32), logits[:, :0]
    if vocab_ids is not None:
        logits = expand_logits(logits, vocab_ids, vocab_size)
    proposal = sample(logits, keys, rows, sampler)
    if sampler == GREEDY:
        return proposal, logits[:, :0]
    return proposal, softmax(filtered_logits(logits, rows, sampler))
