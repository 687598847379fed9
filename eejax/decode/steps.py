"""The jitted steps of generation: prefill and one decode token (full depth or early exit).

Both are pure functions of (params, cache, ...) returning the updated cache; the caller donates
the cache so it is updated in place. `DecodeState` holds everything the token loop carries on
device, so the host only checks `done` now and then.

One implementation serves every architecture: `model_module(config)` gives the model's pure
functions (`eejax.models.registry.ModelModule`): a decoder-only Llama, or the decoder of an
encoder-decoder T5 whose per-row cross-attention K/V ride in `DecodeState.context`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eejax.cache import KVCache
from eejax.options import StepOptions
from eejax.decode.confidence import exit_threshold
from eejax.decode.early_exit import ExitFns, early_exit_layers
from eejax.decode.sampling import SAMPLE, RowSampling, SamplingParams, logprobs_of, row_keys, sample, token_keys
from eejax.models import exits
from eejax.models.registry import model_module


TOP_LOGPROBS = 20  # the most alternatives a row's log-prob record keeps (OpenAI's bound)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogprobRecord:
    """Per generated token (see `sampling.logprobs_of` for which distribution):
    chosen [B, N] f32: the token's log-probability; top_ids [B, N, K] int32 and top [B, N, K]
    f32: the K = TOP_LOGPROBS most likely tokens and their log-probabilities."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array

    @classmethod
    def zeros(cls, rows: int, max_new_tokens: int) -> LogprobRecord:
        shape = (rows, max_new_tokens)
        return cls(jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (TOP_LOGPROBS,), jnp.int32),
                   jnp.zeros(shape + (TOP_LOGPROBS,), jnp.float32))


def token_logprobs(logits, tokens, rows: RowSampling, sampler: str):
    """logits [B, T, V], tokens [B, T] -> (chosen [B, T], top_ids [B, T, K], top [B, T, K])."""
    shape = tokens.shape
    per_token = jax.tree.map(lambda x: jnp.repeat(x, shape[1]), rows)  # [B * T]
    lp = logprobs_of(logits.reshape(-1, logits.shape[-1]), per_token, sampler)
    chosen = jnp.take_along_axis(lp, tokens.reshape(-1, 1), axis=-1)[:, 0]
    top, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    pad = ((0, 0), (0, TOP_LOGPROBS - top.shape[-1]))  # a vocabulary smaller than the record
    top, top_ids = jnp.pad(top, pad, constant_values=-jnp.inf), jnp.pad(top_ids, pad)
    return (chosen.reshape(shape), top_ids.astype(jnp.int32).reshape(shape + (TOP_LOGPROBS,)),
            top.reshape(shape + (TOP_LOGPROBS,)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-row generation state, all on device.

    last_token [B] int32: the newest token, not yet in the cache
    seq_len [B] int32:    tokens already in the cache
    num_generated [B]:    tokens produced so far (EOS included)
    done [B] bool:        row finished (EOS, its limit, or padding row)
    tokens [B, N] int32:  generated ids (N = max_new_tokens, the record's width)
    exit_layers [B, N]:   layers run for each token (the batch's exit layer)
    confident_layers [B, N]: the row's first confident layer (the exit layer if none)
    keys [B, 2] uint32:   each row's PRNG key; token t is drawn with `token_keys(keys, t, ...)`
    start [B] int32:      tokens the request generated before this state took it over (the
                          engine recomputes a preempted row; 0 in `generate`): the absolute
                          index of a row's token i is start + i
    limit [B] int32:      the row's own max new tokens counted from `start` (<= N); the
                          decaying exit threshold runs over start + limit
    sampling:             each row's temperature / top-k / top-p (`RowSampling`, traced)
    context:              per-row model state besides the KV cache (T5: `t5_attention.CrossKV`; Llama: None)
    logprobs:             a `LogprobRecord`, or None when nobody asks for log-probabilities
    """

    last_token: jax.Array
    seq_len: jax.Array
    num_generated: jax.Array
    done: jax.Array
    tokens: jax.Array
    exit_layers: jax.Array
    confident_layers: jax.Array
    keys: jax.Array
    start: jax.Array
    limit: jax.Array
    sampling: RowSampling
    context: Any = None
    logprobs: LogprobRecord | None = None

    @property
    def position(self):
        """[B] the absolute index of each row's next token."""
        return self.start + self.num_generated


def record_logprobs(state: DecodeState, logits, tokens, idx, emitted, sampler: str):
    """`state.logprobs` with the scores of tokens [B, T] (logits [B, T, V]) written at record
    indices idx [B, T] where `emitted` [B, T]; unchanged when there is no record."""
    if state.logprobs is None:
        return None
    idx = jnp.where(emitted, idx, state.tokens.shape[1])  # out of range: dropped
    rows = jnp.arange(tokens.shape[0])[:, None]
    scores = token_logprobs(logits, tokens, state.sampling, sampler)
    return jax.tree.map(lambda buf, new: buf.at[rows, idx].set(new, mode="drop"), state.logprobs,
                        LogprobRecord(*scores))


def is_eos(tokens, eos_ids: tuple[int, ...]):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def prefill(params, cache: KVCache, tokens, lengths, block_table, keys, start=None, limit=None, sampling=None,
            offset=None, *, config, options: StepOptions):
    """Runs all layers over right-padded prompts and samples the first new token.

    tokens [B, T] int32, lengths [B] int32 (0 = padding row), block_table [B, M] int32; offset
    [B] (Llama only; default 0): the row's first `offset` positions are already in the cache
    (a shared prefix), tokens holds positions offset..lengths-1 and lengths stays the whole
    prompt's; keys:
    one PRNG key (row i then draws with fold_in(key, i)) or per-row keys [B, 2]; start [B] (the
    absolute index of each row's first new token; default 0), limit [B] (each row's max new
    tokens; default options.max_new_tokens, the record's width), sampling: the rows'
    `RowSampling` (default greedy); `options` (`StepOptions.prefilling`): the first token's
    sampler, EOS ids, attention, and whether a `LogprobRecord` is kept.
    Returns (DecodeState, cache). A T5 encodes the prompts and decodes its first token.
    """
    max_new_tokens, sampler = options.max_new_tokens, options.sampler
    b = tokens.shape[0]
    keys = row_keys(keys, jnp.arange(b)) if keys.ndim == 1 else keys
    start = jnp.zeros((b,), jnp.int32) if start is None else start
    limit = jnp.full((b,), max_new_tokens, jnp.int32) if limit is None else jnp.minimum(limit, max_new_tokens)
    sampling = jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(), b) if sampling is None else sampling)
    record = LogprobRecord.zeros(b, max_new_tokens) if options.logprobs else None
    m = model_module(config)
    if m.ENCODER_DECODER:
        return _prefill_encoder_decoder(params, cache, tokens, lengths, block_table, keys, start, limit, sampling,
                                        record, config=config, options=options)
    t = tokens.shape[1]
    offset = jnp.zeros((b,), jnp.int32) if offset is None else offset
    positions = offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = positions < lengths[:, None]
    batch = m.token_batch(config, positions, valid, block_table, lengths, cache.page_size, options.attention)
    h, cache = m.run_layers(params, m.embed(params, tokens), cache, batch, config)
    last = h[jnp.arange(b), jnp.maximum(lengths - offset - 1, 0)]
    logits = m.lm_head(params, last, config)
    first = sample(logits, token_keys(keys, start, SAMPLE), sampling, sampler)
    padding = lengths == 0
    first = jnp.where(padding, 0, first)
    done = padding | is_eos(first, options.eos_ids) | (limit <= 1)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    exit_layers = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(config.num_layers)
    state = DecodeState(
        last_token=first,
        seq_len=lengths,
        num_generated=jnp.where(padding, 0, 1).astype(jnp.int32),
        done=done,
        tokens=out,
        exit_layers=exit_layers,
        confident_layers=exit_layers,
        keys=keys,
        start=start,
        limit=limit,
        sampling=sampling,
        logprobs=record,
    )
    scores = record_logprobs(state, logits[:, None], first[:, None], jnp.zeros((b, 1), jnp.int32),
                             ~padding[:, None], sampler)
    return dataclasses.replace(state, logprobs=scores), cache


def _prefill_encoder_decoder(params, cache: KVCache, tokens, lengths, block_table, keys, start, limit, sampling,
                             record, *, config, options: StepOptions):
    """An encoder-decoder (T5): the encoder over the prompts and whatever context the decoder
    needs of them (`encode_context`), then one full-depth decode step from the decoder start
    token (position 0)."""
    b = tokens.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    logprob_record, record = record, jnp.zeros((b, options.max_new_tokens), jnp.int32)
    state = DecodeState(
        last_token=jnp.full((b,), config.decoder_start_token_id, jnp.int32),
        seq_len=zeros,
        num_generated=zeros,
        done=lengths == 0,
        tokens=record,
        exit_layers=record,
        confident_layers=record,
        keys=keys,
        start=start,
        limit=limit,
        sampling=sampling,
        context=model_module(config).encode_context(params, tokens, lengths, config),
        logprobs=logprob_record,
    )
    return decode(params, cache, state, block_table, config=config, options=options.decoding())


def adapted(params, x, layers_run, config):
    """x [B, D] through the adapter of the exit after `layers_run` layers (none at full depth,
    or without adapters)."""
    exit_params = params.get("exits")
    if not exits.has_adapters(exit_params):
        return x
    return jnp.where(layers_run < config.num_layers, exits.adapt(exit_params, x, jnp.maximum(layers_run - 1, 0)), x)


def exit_logits(params, x, layers_run, config):
    """The exit head after `layers_run` layers (adapter, if any, then the shared final norm and
    LM head): x [B, D] -> float32 logits [B, V]. At full depth it is the model's own head."""
    return model_module(config).lm_head(params, adapted(params, x, layers_run, config), config)


def reduced_logits(params, x, layers_run, config):
    """The reduced-vocabulary exit head (`exits.set_exit_vocab`): x [B, D] -> float32 [B, K],
    logits of the tokens `params["exits"]["vocab_ids"]` only (the same values the full head
    gives them)."""
    weight = params["exits"]["vocab_head"]
    return model_module(config).lm_head(params, adapted(params, x, layers_run, config), config, weight=weight)


def expand_logits(reduced, ids, vocab_size: int):
    """Reduced logits [..., K] of tokens `ids` [K] -> [..., V] with -inf for every other token."""
    full = jnp.full(reduced.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(reduced)


def exit_fns(params, batch, config, *, check_reduced: bool = False, emit_reduced: bool = False) -> ExitFns:
    """The early-exit loop's view of a model: layers, exit heads (+ adapters), classifier, KV.
    `check_reduced` / `emit_reduced`: softmax checks / the emitted token use the reduced head."""
    exit_params = params.get("exits")
    m = model_module(config)

    def full(h, layers_run):
        return exit_logits(params, h[:, -1], layers_run, config)

    def reduced(h, layers_run):
        return reduced_logits(params, h[:, -1], layers_run, config)

    def emit(h, layers_run):
        return expand_logits(reduced(h, layers_run), exit_params["vocab_ids"], config.vocab_size)

    def exit_prob(h, layers_run):
        return exits.classifier_prob(exit_params, h[:, -1], layers_run - 1)

    return ExitFns(
        run_layers=lambda h, cache, start, stop=None, length=None: m.run_layers(params, h, cache, batch, config,
                                                                             start, stop, length),
        exit_logits=full,
        check_logits=reduced if check_reduced else full,
        emit_logits=emit if emit_reduced else full,
        exit_prob=exit_prob if exits.has_classifier(exit_params) else None,
        layer_kv=lambda layer, h: m.kv_of_layer(params, h, layer, batch, config),
    )


def decode(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """One decode token for every row that is not done; a row ends at EOS or its own limit.
    Returns (state, cache).

    Full depth when `options.exit` is None; otherwise the early-exit loop decides how many
    layers run and fills the KV of the rest, with λ(t) at each row's absolute position over its
    own limit. Rows sample with their own `state.sampling` (`options.sampler`: see
    `sampling.sample`); `options.logprobs` records the tokens' log-probabilities in
    `state.logprobs`.
    """
    exit_config, sampler, attention = options.exit, options.sampler, options.attention
    m = model_module(config)
    active = ~state.done
    positions = state.seq_len[:, None]
    kv_len = state.seq_len + active
    batch = m.token_batch(config, positions, active[:, None], block_table, kv_len, cache.page_size, attention,
                          context=state.context)
    h = m.embed(params, state.last_token[:, None])
    if exit_config is None:
        h, cache = m.run_layers(params, h, cache, batch, config)
        logits = m.lm_head(params, h[:, 0], config)
        exit_layer = confident = jnp.full(active.shape, config.num_layers, jnp.int32)
    else:
        threshold = exit_threshold(exit_config, state.position, state.start + state.limit)
        check_reduced, emit_reduced = exit_config.uses_reduced_head(exits.has_reduced_head(params.get("exits")))
        fns = exit_fns(params, batch, config, check_reduced=check_reduced, emit_reduced=emit_reduced)
        out = early_exit_layers(
            fns, h, cache, active, threshold, batch.pages, batch.slots, config=exit_config,
            num_layers=config.num_layers, vocab_size=config.vocab_size,
            reuse_check_logits=exit_config.measure == "softmax" and not (check_reduced or emit_reduced),
        )
        logits, cache, confident = out.logits, out.cache, out.confident_layer
        exit_layer = jnp.full(active.shape, out.exit_layer, jnp.int32)
    token = jnp.where(active, sample(logits, token_keys(state.keys, state.position, SAMPLE), state.sampling, sampler),
                      state.last_token)
    idx = jnp.minimum(state.num_generated, options.max_new_tokens - 1)
    rows = jnp.arange(token.shape[0])

    def record(buffer, values):
        return buffer.at[rows, idx].set(jnp.where(active, values, buffer[rows, idx]))

    num_generated = state.num_generated + active
    done = state.done | (active & is_eos(token, options.eos_ids)) | (num_generated >= state.limit)
    scores = (record_logprobs(state, logits[:, None], token[:, None], idx[:, None], active[:, None], sampler)
              if options.logprobs else state.logprobs)
    return dataclasses.replace(
        state,
        last_token=token,
        seq_len=kv_len,
        num_generated=num_generated,
        done=done,
        tokens=record(state.tokens, token),
        exit_layers=record(state.exit_layers, exit_layer),
        confident_layers=record(state.confident_layers, confident),
        logprobs=scores,
    ), cache


def decode_steps(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """`options.num_steps` decode steps (`decode`) in one program: a loop of known trip
    count, so the host dispatches and syncs once per `num_steps` tokens, and a GPU reads nothing
    back between them. Rows that end inside idle through the rest. Returns (state, cache)."""

    def body(_, carry):
        state, cache = carry
        return decode(params, cache, state, block_table, config=config, options=options)

    if options.num_steps == 1:
        return body(0, (state, cache))
    return jax.lax.fori_loop(0, options.num_steps, body, (state, cache))
