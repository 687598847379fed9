"""The jitted steps of generation: prefill and decode tokens (full depth or early exit), over a
batch of rows or into the serving engine's decode slots (`prefill_slots`, `decode_slots`).

All are pure functions of (params, cache, ...) returning the updated cache; the caller donates
the cache so it is updated in place. `DecodeState` (`state.py`) holds everything the token loop
carries on device, so the host only reads it once per program.

One implementation serves every architecture: `model_module(config)` gives the model's pure
functions (`eejax.models.registry.ModelModule`): a decoder-only Llama, or the decoder of an
encoder-decoder T5 whose per-row cross-attention K/V ride in `DecodeState.context`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax import quantized
from eejax.cache import KVCache
from eejax.decode import early_exit, feature_draft
from eejax.decode.confidence import exit_threshold
from eejax.decode.early_exit import ExitFns, early_exit_layers
from eejax.decode.penalties import apply_penalties, count_tokens
from eejax.decode.prompt_scores import score_prompt
from eejax.decode.sampling import SAMPLE, RowSampling, SamplingParams, expand_logits, row_keys, sample, token_keys
from eejax.decode.slot_args import PrefillChunk
from eejax.decode.state import DecodeState, LogprobRecord, insert_rows, is_eos, only_group, record_logprobs, ungrouped
from eejax.models import draft_head, exits
from eejax.models.registry import model_module
from eejax.options import StepOptions


def prefill(
    params,
    cache: KVCache,
    tokens,
    lengths,
    block_table,
    keys,
    start=None,
    limit=None,
    sampling=None,
    offset=None,
    next_token=None,
    counts=None,
    targets=None,
    *,
    config,
    options: StepOptions,
):
    """Runs all layers over right-padded prompts and samples the first new token.

    tokens [B, T] int32, lengths [B] int32 (0 = padding row), block_table [B, M] int32; offset
    [B] (Llama only; default 0): the row's first `offset` positions are already in the cache
    (a shared prefix), tokens holds positions offset..lengths-1 and lengths stays the whole
    prompt's; keys:
    one PRNG key (row i then draws with fold_in(key, i)) or per-row keys [B, 2]; start [B] (the
    absolute index of each row's first new token; default 0), limit [B] (each row's max new
    tokens; default options.max_new_tokens, the record's width), sampling: the rows'
    `RowSampling` (default greedy); next_token [B] (with a draft head): the prompt token after
    this chunk, or -1 where the prompt ends in it (default); counts (with `options.penalties`):
    the rows' `TokenCounts` so far (their whole prompts, not only this chunk); `options`
    (`StepOptions.prefilling`): the first token's sampler, EOS ids, attention, penalties and
    whether a `LogprobRecord` is kept. With a draft head the draft's K/V of the prompt is
    written too (`feature_draft.prompt_draft`).
    Returns (DecodeState, cache). A T5 encodes the prompts and decodes its first token.
    With `options.prompt_logprobs` (Llama only) it returns (DecodeState, cache, PromptScores
    [B, T] of the chunk's positions, scoring targets [B, T]: each position's next prompt token).
    Quantized matrices take x as their prompt activations here (`quantized.for_prompts`).
    """
    params = quantized.for_prompts(params)
    max_new_tokens, sampler = options.max_new_tokens, options.sampler
    b = tokens.shape[0]
    keys = row_keys(keys, jnp.arange(b)) if keys.ndim == 1 else keys
    start = jnp.zeros((b,), jnp.int32) if start is None else start
    limit = jnp.full((b,), max_new_tokens, jnp.int32) if limit is None else jnp.minimum(limit, max_new_tokens)
    sampling = jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(), b) if sampling is None else sampling)
    record = LogprobRecord.zeros(b, max_new_tokens) if options.logprobs else None
    m = model_module(config)
    if m.ENCODER_DECODER:
        return _prefill_encoder_decoder(
            params,
            cache,
            tokens,
            lengths,
            block_table,
            keys,
            start,
            limit,
            sampling,
            record,
            counts,
            config=config,
            options=options,
        )
    t = tokens.shape[1]
    offset = jnp.zeros((b,), jnp.int32) if offset is None else offset
    positions = offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = positions < lengths[:, None]
    batch = m.token_batch(config, positions, valid, block_table, lengths, cache.page_size, options.attention)
    h, cache = m.run_layers(params, m.embed(params, tokens), cache, batch, config)
    last = h[jnp.arange(b), jnp.maximum(lengths - offset - 1, 0)]
    logits = m.lm_head(params, last, config, triton=options.attention == "triton")
    if options.penalties:
        logits = apply_penalties(logits, sampling, counts)
    first = sample(logits, token_keys(keys, start, SAMPLE), sampling, sampler)
    padding = lengths == 0
    first = jnp.where(padding, 0, first)
    if options.penalties:
        counts = count_tokens(counts, first[:, None], ~padding[:, None])
    done = padding | is_eos(first, options.eos_ids) | (limit <= 1)
    draft_hidden = None
    if draft_head.has_draft(params):
        next_token = jnp.full((b,), -1, jnp.int32) if next_token is None else next_token
        draft_hidden, cache = feature_draft.prompt_draft(
            params, cache, h, tokens, lengths, offset, first, next_token, batch, config
        )
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
        draft_hidden=draft_hidden,
        counts=counts if options.penalties else None,
    )
    scores = record_logprobs(
        state, logits[:, None], first[:, None], jnp.zeros((b, 1), jnp.int32), ~padding[:, None], sampler
    )
    state = dataclasses.replace(state, logprobs=scores)
    if options.prompt_logprobs:
        return state, cache, score_prompt(lambda x: m.lm_head(params, x, config), h, targets)
    return state, cache


def _prefill_encoder_decoder(
    params,
    cache: KVCache,
    tokens,
    lengths,
    block_table,
    keys,
    start,
    limit,
    sampling,
    record,
    counts,
    *,
    config,
    options: StepOptions,
):
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
        counts=counts if options.penalties else None,
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
        run_layers=lambda h, cache, start, stop=None, length=None: m.run_layers(
            params, h, cache, batch, config, start, stop, length
        ),
        exit_logits=full,
        check_logits=reduced if check_reduced else full,
        emit_logits=emit if emit_reduced else full,
        exit_prob=exit_prob if exits.has_classifier(exit_params) else None,
        layer_kv=lambda layer, h: m.kv_of_layer(params, h, layer, batch, config),
        layers_kv=lambda start, stop, h: m.kv_of_layers(params, h, start, stop, batch, config),
    )


def decode(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """One decode token for every row that is not done (`decode_and_hidden`). Returns (state, cache)."""
    new, cache, _ = decode_and_hidden(params, cache, state, block_table, config=config, options=options)
    return new, cache


def decode_and_hidden(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """One decode token for every row that is not done; a row ends at EOS or its own limit.
    Returns (state, cache, hidden): hidden [B, D] the last layer's state at each row's input
    token (full depth; None with early exit), what a draft head's K/V are made from.

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
    batch = m.token_batch(
        config, positions, active[:, None], block_table, kv_len, cache.page_size, attention, context=state.context
    )
    h = m.embed(params, state.last_token[:, None])
    hidden = None
    if exit_config is None:
        h, cache = m.run_layers(params, h, cache, batch, config)
        hidden = h[:, 0]
        logits = m.lm_head(params, hidden, config, triton=attention == "triton")
        exit_layer = confident = jnp.full(active.shape, config.num_layers, jnp.int32)
    else:
        threshold = exit_threshold(exit_config, state.position, state.start + state.limit)
        check_reduced, emit_reduced = exit_config.uses_reduced_head(exits.has_reduced_head(params.get("exits")))
        fns = exit_fns(params, batch, config, check_reduced=check_reduced, emit_reduced=emit_reduced)
        out = early_exit_layers(
            fns,
            h,
            cache,
            active,
            threshold,
            batch.pages,
            batch.slots,
            config=exit_config,
            num_layers=config.num_layers,
            vocab_size=config.vocab_size,
            reuse_check_logits=exit_config.measure == "softmax" and not (check_reduced or emit_reduced),
        )
        logits, cache, confident = out.logits, out.cache, out.confident_layer
        exit_layer = jnp.full(active.shape, out.exit_layer, jnp.int32)
    if options.penalties:
        logits = apply_penalties(logits, state.sampling, state.counts)
    token = jnp.where(
        active,
        sample(logits, token_keys(state.keys, state.position, SAMPLE), state.sampling, sampler),
        state.last_token,
    )
    idx = jnp.minimum(state.num_generated, options.max_new_tokens - 1)
    rows = jnp.arange(token.shape[0])

    def record(buffer, values):
        return buffer.at[rows, idx].set(jnp.where(active, values, buffer[rows, idx]))

    num_generated = state.num_generated + active
    done = state.done | (active & is_eos(token, options.eos_ids)) | (num_generated >= state.limit)
    scores = (
        record_logprobs(state, logits[:, None], token[:, None], idx[:, None], active[:, None], sampler)
        if options.logprobs
        else state.logprobs
    )
    return (
        dataclasses.replace(
            state,
            last_token=token,
            seq_len=kv_len,
            num_generated=num_generated,
            done=done,
            tokens=record(state.tokens, token),
            exit_layers=record(state.exit_layers, exit_layer),
            confident_layers=record(state.confident_layers, confident),
            logprobs=scores,
            counts=count_tokens(state.counts, token[:, None], active[:, None]) if options.penalties else state.counts,
        ),
        cache,
        hidden,
    )


def ends_with_its_rows() -> bool:
    """Whether a program of several steps or rounds (`repeat`) ends once every row in it is
    done: on a CPU; a GPU's loop (`early_exit.static_loops`) runs its trip count."""
    return not early_exit.static_loops()


def repeat(body, times: int, carry, done):
    """`body` applied `times` times to `carry` in one program (`done(carry)` [B] bool: the rows
    that are done), so the host dispatches and reads once per several steps or rounds. On a GPU
    (`early_exit.static_loops`) a loop of known trip count, which reads nothing back between
    them: rows that end inside idle through the rest. On a CPU the loop also ends once every row
    is done, so the steps after the last row ended cost nothing."""
    if times == 1:
        return body(carry)
    if not ends_with_its_rows():
        return jax.lax.fori_loop(0, times, lambda _, c: body(c), carry)

    def more(counted):
        i, c = counted
        return (i < times) & ~jnp.all(done(c))

    return jax.lax.while_loop(more, lambda counted: (counted[0] + 1, body(counted[1])), (jnp.int32(0), carry))[1]


def decode_steps(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """`options.num_steps` decode steps (`decode`) in one program (`repeat`): the host dispatches
    and syncs once per `num_steps` tokens. Returns (state, cache)."""

    def step(carry):
        state, cache = carry
        return decode(params, cache, state, block_table, config=config, options=options)

    return repeat(step, options.num_steps, (state, cache), lambda carry: carry[0].done)


def prefill_slots(params, cache, state, chunk: PrefillChunk, *, config, options: StepOptions):
    """Prefills right-padded prompts into decode slots `chunk.slots` [b] of `state`: the
    `PrefillChunk`'s tokens [b, T] are positions offset..lengths-1 of each row (offset [b]: a
    shared prefix or earlier chunks already cached); see `PrefillChunk` and `prefill`. Returns
    (state, cache), and with `options.prompt_logprobs` the chunk's `PromptScores`."""
    out = prefill(
        params,
        cache,
        chunk.tokens,
        chunk.lengths,
        chunk.block_table,
        chunk.keys,
        chunk.start,
        chunk.limit,
        chunk.sampling,
        chunk.offset,
        chunk.next_token,
        chunk.counts,
        chunk.targets,
        config=config,
        options=options,
    )
    return (insert_rows(state, out[0], chunk.slots),) + out[1:]


def decode_slots(params, cache, state, block_table, group, *, config, options: StepOptions):
    """`options.num_steps` decode steps of the slots in `group` [S] bool that are not done (the
    others wait: they run with their own options in another program)."""
    masked, waiting = only_group(state, group)
    new, cache = decode_steps(params, cache, masked, block_table, config=config, options=options)
    return ungrouped(new, waiting), cache
