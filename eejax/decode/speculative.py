"""Self-speculative decoding (LayerSkip) on the paged KV cache, batched.

A round has two jitted programs:

- `draft`: d passes of layers [0, E) over one token per row (x_0 = the row's last token,
  then each draft), writing those layers' K/V at positions seq_len + i. The draft head after E
  layers (the reduced-vocabulary exit head when the checkpoint has one) proposes x_{i+1}
  (greedy, or sampled from its distribution q_i); the layer-E hidden state of every x_i is kept
  (the exit query cache). With the **bonus** pass, x_d runs layers [0, E) too (no head), so
  that verification also yields the full model's token after x_d: it buys one token when all
  d drafts are accepted (probability ~α^d) for E layers every round, so the host turns it on
  only when that pays (`spec_policy`).
- `verify`: ONE pass of layers [E, L) over the P scored positions (d + 1 with the bonus pass,
  else d), starting from the kept states and writing those layers' K/V; the full model's
  distributions p_0..p_{P-1} decide:
  greedy accepts the longest prefix of drafts equal to argmax p (`greedy_accept`); with
  temperature > 0 speculative rejection sampling keeps the output distribution exactly the
  full model's (`speculative_sample`). With penalties, p_i is penalised as if x_1..x_i had been
  emitted, so that both stay exact. Either way a row emits n accepted drafts plus one token of
  the full model (none when all d were accepted without the bonus pass), cut at EOS and at the
  row's own limit.

Every row keeps x_0..x_{k-1} of the k tokens it emitted in the cache and the rest is rolled
back by `seq_len` alone: the K/V at an accepted position were computed from the same tokens
as a full-depth decode would have used. Positions a row can never emit (beyond its limit)
are written to the null page, so a row never writes past the pages of prompt + limit tokens.
Random draws are per row and position (`sampling.token_keys`): a row's sampled tokens do not
depend on the rest of the batch.

The engine runs these over a group of its decode slots while the others wait (`*_slots`):
whole rounds in one program (`spec_round_slots`, several per dispatch as decode steps are), or,
when the policy times them, draft and verify apart, or plain steps in place of a round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax.cache import KVCache
from eejax.decode import early_exit, feature_draft, tree
from eejax.decode.argmax import argmax
from eejax.decode.control_flow import one_of
from eejax.decode.drafts import Drafts, token_batch
from eejax.decode.penalties import apply_to_positions, count_tokens
from eejax.decode.sampling import ACCEPT, DRAFT, GREEDY, RESAMPLE, draft_proposal, filtered_logits, token_keys
from eejax.decode.state import DecodeState, is_eos, only_group, record_logprobs, ungrouped
from eejax.decode.steps import decode_and_hidden, decode_steps, exit_logits, reduced_logits, repeat
from eejax.models import exits
from eejax.models.common import softmax
from eejax.models.registry import model_module
from eejax.options import StepOptions

COUNTED_DEPTHS = 8  # draft positions whose acceptance is counted apart (`SpecCounters.depth_judged`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecCounters:
    """Per row, summed over rounds: drafts that could count (at most the tokens the row still
    had room for), drafts accepted, rounds, rounds that rejected a draft, layer passes run
    (draft + verify), draft-head evaluations, passes of a draft head's module (its layer, the
    catch-up included), and plain full-depth steps run instead of a round (`plain_step`), each
    [B]; and by depth, [B, COUNTED_DEPTHS]: rounds in which draft k + 1 was judged (the k before
    it accepted) and in which it was accepted, so that k + 1's acceptance given the k before is
    `depth_accepted / depth_judged` (the adaptive policy's `depth_alphas`)."""

    drafted: jax.Array
    accepted: jax.Array
    rounds: jax.Array
    rejections: jax.Array
    layer_passes: jax.Array
    draft_heads: jax.Array
    draft_layers: jax.Array
    plain_steps: jax.Array
    depth_judged: jax.Array
    depth_accepted: jax.Array

    @classmethod
    def zeros(cls, batch: int) -> SpecCounters:
        def zeros(field):
            return jnp.zeros((batch, COUNTED_DEPTHS) if field.name.startswith("depth_") else (batch,), jnp.int32)

        return cls(*(zeros(f) for f in dataclasses.fields(cls)))  # distinct buffers: donated


def draft(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """d = options.spec.num_speculations drafts per row with layers [0, E) and the draft head
    (the reduced exit head when the spec uses it). `options.bonus`: one more pass of layers
    [0, E) over x_d, so that verification also scores the token after the last draft (a round
    emits up to d + 1 tokens instead of d). Returns (drafts, state, cache); the state is
    unchanged."""
    spec, sampler, attention, bonus = options.spec, options.sampler, options.attention, options.bonus
    if spec.tree is not None:
        return tree.draft(params, cache, state, block_table, config=config, options=options)
    if spec.draft_head:
        return feature_draft.draft(params, cache, state, block_table, config=config, options=options)
    e, m = spec.exit_layer, model_module(config)
    exit_params = params.get("exits")
    reduced = spec.uses_reduced_head(exits.has_reduced_head(exit_params))

    def draft_pass(cache, token, i):
        batch = token_batch(config, state, jnp.reshape(i, (1,)), block_table, cache.page_size, attention)
        h, cache = m.run_layers(params, m.embed(params, token[:, None]), cache, batch, config, 0, e)
        return h[:, 0], cache

    def propose(h, i):
        """(proposal [B], q [B, V] or [B, 0] when greedy) of the draft head at hidden state h."""
        logits = reduced_logits(params, h, e, config) if reduced else exit_logits(params, h, e, config)
        return draft_proposal(
            logits,
            exit_params["vocab_ids"] if reduced else None,
            token_keys(state.keys, state.position + i, DRAFT),
            state.sampling,
            sampler,
            config.vocab_size,
        )

    d = spec.num_speculations
    q_width = 0 if sampler == GREEDY else config.vocab_size

    def step(carry, i):
        cache, token = carry
        h, cache = draft_pass(cache, token, i)
        if bonus and early_exit.static_loops():  # a GPU: the head runs at the bonus pass too, unused
            proposal, q = propose(h, i)
            proposal, q = jnp.where(i < d, proposal, token), jnp.where(i < d, q, 0.0).astype(jnp.float32)
        elif bonus:  # the bonus pass (i = d) runs the layers only
            proposal, q = jax.lax.cond(
                i < d, lambda: propose(h, i), lambda: (token, jnp.zeros((token.shape[0], q_width), jnp.float32))
            )
        else:
            proposal, q = propose(h, i)
        return (cache, proposal), (token, h, q)

    # One scan runs every pass, the bonus one included: a second loop over the layers after it
    # would cost a copy of the weights it reads (see `early_exit`).
    (cache, last), (tokens, hidden, probs) = jax.lax.scan(
        step, (cache, state.last_token), jnp.arange(d + bonus, dtype=jnp.int32)
    )
    tokens, hidden, probs = tokens.T, hidden.swapaxes(0, 1), probs.swapaxes(0, 1)
    if not bonus:  # x_d: the last proposal, never run through the layers
        tokens = jnp.concatenate([tokens, last[:, None]], axis=1)
    drafts = Drafts(tokens=tokens, hidden=hidden, probs=probs[:, :d])
    return drafts, state, cache


def greedy_accept(logits, drafts):
    """logits [B, P, V] of the full model at x_0..x_{P-1} (P = d + 1, or d without the bonus
    pass), drafts [B, d] (x_1..x_d) -> (n [B] accepted drafts, tokens [B, P]): the row emits
    tokens[:, :min(n+1, P)] (the accepted drafts equal the full model's argmax, so all emitted
    tokens are the argmax)."""
    target = argmax(logits)
    match = target[:, : drafts.shape[1]] == drafts
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    return n, target


def speculative_sample(p, q, drafts, accept_keys, resample_keys, valid=None):
    """Speculative rejection sampling. p [B, P, V] full-model probabilities at x_0..x_{P-1}
    (P = d + 1, or d without the bonus pass), q [B, d, V] draft probabilities, drafts [B, d]
    sampled from q, per-row keys [B, 2] for the acceptance tests and the final draw, valid [B]
    (a confidence stop: the row's drafts that count; None: all d) -> (n [B], tokens [B, P]).

    Draft i is accepted with probability min(1, p_i(x)/q_i(x)); the row keeps the accepted
    prefix, then samples once more: from max(0, p_n - q_n) normalised after a rejection, from
    p_n when all its valid drafts were accepted (with the bonus pass; without it the row emits
    the d drafts). Each emitted token is then distributed exactly as p."""
    b, d = drafts.shape
    valid = jnp.full((b,), d, jnp.int32) if valid is None else valid
    positions = p.shape[1]
    px = jnp.take_along_axis(p[:, :d], drafts[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda k: jax.random.uniform(k, (d,)))(accept_keys)
    accepted = (u * qx < px) & (jnp.arange(d)[None] < valid[:, None])  # u < p/q without dividing (q(x) > 0)
    n = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(b)
    p_n = p[rows, jnp.minimum(n, positions - 1)]  # n = P = d: nothing more is emitted
    q_n = jnp.where((n < valid)[:, None], q[rows, jnp.minimum(n, d - 1)], 0.0) if d else jnp.zeros_like(p_n)
    residual = jnp.maximum(p_n - q_n, 0.0)
    total = residual.sum(-1, keepdims=True)
    # p_n == q_n leaves no residual mass; a rejection then has probability 0, keep p_n.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_n)
    extra = jax.vmap(jax.random.categorical)(resample_keys, jnp.log(residual)).astype(jnp.int32)
    tokens = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1).at[rows, n].set(extra)
    return n, tokens[:, :positions]


def verify(
    params,
    cache: KVCache,
    state: DecodeState,
    drafts: Drafts,
    counters: SpecCounters,
    block_table,
    *,
    config,
    options: StepOptions,
):
    """Layers [E, L) over the d + 1 drafted positions (a tree's nodes: `tree.score`), acceptance,
    and the new tokens recorded (with `options.logprobs`, their log-probabilities under the full
    model). Each row accepts at most its `drafts.valid` drafts (a confidence stop, a prompt
    lookup). After a confidence stop only the first k + 1 positions are scored, k the most drafts
    a row made: one branch per k (`control_flow.one_of`), so the positions no row drafted cost nothing; a
    GPU's structure (`early_exit.static_loops`) scores them all, with no conditional. A prompt
    lookup of k > d copies has two branches, d + 1 positions and k + 1 where a row copied more
    than d (a long match, `feature_draft._draft_with_lookup`). Returns (state, cache, counters)."""
    d = options.spec.num_speculations
    width = drafts.tokens.shape[1] - 1  # max(d, k) with a lookup
    if drafts.valid is None or early_exit.static_loops() or (options.spec.lookup and width == d):  # no switch
        return _verify(params, cache, state, drafts, counters, block_table, config=config, options=options)

    def scoring(k):
        first_k = dataclasses.replace(
            drafts, tokens=drafts.tokens[:, : k + 1], hidden=drafts.hidden[:, : k + 1], probs=drafts.probs[:, :k]
        )
        return lambda state, cache, counters: _verify(
            params, cache, state, first_k, counters, block_table, config=config, options=options
        )

    most = jnp.max(drafts.valid)
    if options.spec.lookup:  # the chain's positions, or the long copies'
        return one_of((most > d).astype(jnp.int32), [scoring(d), scoring(width)], state, cache, counters)
    return one_of(jnp.clip(most, 1, width) - 1, [scoring(k) for k in range(1, width + 1)], state, cache, counters)


def _verify(params, cache: KVCache, state: DecodeState, drafts: Drafts, counters, block_table, *, config, options):
    """`verify` over every position of `drafts`."""
    sampler, attention, eos_ids = options.sampler, options.attention, options.eos_ids
    e, num_layers, is_tree = options.spec.exit_layer, config.num_layers, options.spec.tree is not None
    # t positions scored: d + 1 with the bonus pass (a tree: its depth + 1 along the accepted path), else d
    t = options.spec.num_speculations + 1 if is_tree else drafts.hidden.shape[1]
    offsets = jnp.arange(t, dtype=jnp.int32)
    batch = token_batch(config, state, offsets, block_table, cache.page_size, attention)
    if is_tree:  # the accepted path's logits, states, tokens and acceptance, as a chain's (never penalised)
        logits, h, tokens, (n, new), cache = tree.score(
            params, cache, state, drafts, block_table, config=config, options=options
        )
    else:
        tokens, m = drafts.tokens, model_module(config)
        h, cache = m.run_layers(params, drafts.hidden, cache, batch, config, e, num_layers)
        logits = m.lm_head(params, h, config, triton=attention == "triton")  # [B, d+1, V]
        if options.penalties:  # each position as if the drafts before it were emitted
            logits = apply_to_positions(logits, state.sampling, state.counts, tokens[:, 1:t])
        n, new = greedy_accept(logits, tokens[:, 1:])  # [B], [B, t]
    b, d = tokens.shape[0], tokens.shape[1] - 1
    valid = jnp.full((b,), d, jnp.int32) if drafts.valid is None else drafts.valid  # a confidence stop's
    n = jnp.minimum(n, valid)
    if sampler != GREEDY:  # rejection sampling for the rows that sample; greedy rows keep the argmax
        per_position = jax.tree.map(lambda x: jnp.repeat(x, t), state.sampling)
        p = softmax(filtered_logits(logits.reshape(b * t, -1), per_position, sampler)).reshape(logits.shape)
        n_sampled, new_sampled = speculative_sample(
            p,
            drafts.probs,
            tokens[:, 1:],
            token_keys(state.keys, state.position, ACCEPT),
            token_keys(state.keys, state.position, RESAMPLE),
            valid,
        )
        greedy = state.sampling.greedy
        n, new = jnp.where(greedy, n, n_sampled), jnp.where(greedy[:, None], new, new_sampled)

    active = ~state.done
    room = state.limit - state.num_generated
    eos = is_eos(new, eos_ids) & (offsets[None] <= n[:, None])
    first_eos = jnp.where(eos.any(1), jnp.argmax(eos, axis=1), t)
    count = jnp.where(active, jnp.minimum(jnp.minimum(jnp.minimum(n + 1, t), room), first_eos + 1), 0)
    emitted = offsets[None] < count[:, None]
    rows = jnp.arange(b)[:, None]
    idx = jnp.where(emitted, state.num_generated[:, None] + offsets[None], options.max_new_tokens)  # dropped
    # accepted drafts came from layer E (a draft head's from the draft: 0 of the model's layers)
    layers = jnp.where(offsets[None] < n[:, None], e, num_layers)

    num_generated = state.num_generated + count
    new_state = dataclasses.replace(
        state,
        last_token=jnp.where(count > 0, new[jnp.arange(b), jnp.maximum(count - 1, 0)], state.last_token),
        seq_len=state.seq_len + count,
        num_generated=num_generated,
        done=state.done | (active & (first_eos < count)) | (num_generated >= state.limit),
        tokens=state.tokens.at[rows, idx].set(new, mode="drop"),
        exit_layers=state.exit_layers.at[rows, idx].set(layers, mode="drop"),
        confident_layers=state.confident_layers.at[rows, idx].set(layers, mode="drop"),
        logprobs=record_logprobs(state, logits, new, idx, emitted, sampler) if options.logprobs else state.logprobs,
        counts=count_tokens(state.counts, new, emitted) if options.penalties else state.counts,
    )
    if options.spec.draft_head:  # the draft's K/V of the verified positions, from the model's features
        new_state, cache = feature_draft.catch_up(params, cache, state, new_state, h, new, count, batch, config)
    judged = jnp.where(active, jnp.minimum(valid, room), 0)  # drafts past the row's room never count
    accepted = jnp.minimum(n, judged)
    depth = jnp.arange(1, COUNTED_DEPTHS + 1, dtype=jnp.int32)[None]  # draft k + 1 judged where the k before were taken
    depth_judged = (depth <= judged[:, None]) & (depth <= accepted[:, None] + 1)
    heads = d if drafts.head_passes is None else drafts.head_passes  # a draft head's module ran max(heads, 1)
    new_counters = SpecCounters(
        drafted=counters.drafted + judged,
        accepted=counters.accepted + accepted,
        rounds=counters.rounds + active,
        rejections=counters.rejections + (n < judged),
        layer_passes=counters.layer_passes + active * (t * e + num_layers - e),
        draft_heads=counters.draft_heads + active * heads,
        draft_layers=counters.draft_layers + active * (jnp.maximum(heads, 1) if options.spec.draft_head else 0),
        plain_steps=counters.plain_steps,
        depth_judged=counters.depth_judged + depth_judged,
        depth_accepted=counters.depth_accepted + (depth <= accepted[:, None]),
    )
    return new_state, cache, new_counters


def plain_step(
    params, cache: KVCache, state: DecodeState, counters: SpecCounters, block_table, *, config, options: StepOptions
):
    """`options.num_steps` full-depth decode tokens (`steps.decode_steps`) in place of a round,
    when speculation does not pay (`spec_policy`); counted in `counters.plain_steps`. With a
    draft head, its K/V and draft_hidden then follow from the model's features at those
    positions in one pass of the draft layer (`feature_draft.catch_up`, as after a verification).
    Returns (state, cache, counters)."""
    decoding = options.decoding(options.num_steps)
    if options.spec is not None and options.spec.draft_head:

        def step(carry, _):
            state, cache = carry
            new, cache, hidden = decode_and_hidden(params, cache, state, block_table, config=config, options=decoding)
            return (new, cache), (hidden, new.last_token)

        (new, cache), (hidden, tokens) = jax.lax.scan(step, (state, cache), None, length=options.num_steps)
        batch = token_batch(
            config,
            state,
            jnp.arange(options.num_steps, dtype=jnp.int32),
            block_table,
            cache.page_size,
            options.attention,
        )
        count = new.num_generated - state.num_generated
        new, cache = feature_draft.catch_up(
            params, cache, state, new, hidden.swapaxes(0, 1), tokens.T, count, batch, config
        )
    else:
        new, cache = decode_steps(params, cache, state, block_table, config=config, options=decoding)
    made = new.num_generated - state.num_generated
    return new, cache, dataclasses.replace(counters, plain_steps=counters.plain_steps + made)


def plain_step_slots(params, cache, state, counters, block_table, group, *, config, options: StepOptions):
    """`options.num_steps` full-depth decode steps of the slots in `group` in place of a
    speculation round (`plain_step`: counted). Returns (state, cache, counters)."""
    masked, waiting = only_group(state, group)
    new, cache, counters = plain_step(params, cache, masked, counters, block_table, config=config, options=options)
    return ungrouped(new, waiting), cache, counters


def draft_slots(params, cache, state, block_table, group, *, config, options: StepOptions):
    """A round's drafts (`draft`) for the slots in `group`. Returns (drafts, cache)."""
    drafts, _, cache = draft(
        params, cache, only_group(state, group)[0], block_table, config=config, options=options.drafting()
    )
    return drafts, cache


def verify_slots(params, cache, state, counters, drafts, block_table, group, *, config, options: StepOptions):
    """A round's verification (`verify`) for the slots in `group`. Returns (state, cache,
    counters)."""
    masked, waiting = only_group(state, group)
    new, cache, counters = verify(
        params, cache, masked, drafts, counters, block_table, config=config, options=options.verifying()
    )
    return ungrouped(new, waiting), cache, counters


def spec_round_slots(params, cache, state, counters, block_table, group, *, config, options: StepOptions):
    """`options.num_steps` self-speculation rounds (d drafts from layers [0, E), one verify pass
    of the rest) of the slots in `group` that are not done, in one program (`steps.repeat`, as
    decode steps run): the host dispatches and reads once per several rounds. The other slots
    wait. Returns (state, cache, counters)."""
    masked, waiting = only_group(state, group)

    def one_round(carry):
        state, cache, counters = carry
        drafts, _, cache = draft(params, cache, state, block_table, config=config, options=options.drafting())
        return verify(params, cache, state, drafts, counters, block_table, config=config, options=options.verifying())

    new, cache, counters = repeat(one_round, options.num_steps, (masked, cache, counters), lambda c: c[0].done)
    return ungrouped(new, waiting), cache, counters
