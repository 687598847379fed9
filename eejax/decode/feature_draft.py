"""Speculation with a trained draft head (EAGLE; `models.draft_head`): the draft reads the frozen
model's features, the verification is one full-depth pass, so the output is the full model's.

Per row, between rounds, `DecodeState.draft_hidden` [B, D] holds the draft's output at the last
cached position n-1: its prediction of the model's feature at n (of `last_token` x_n). A round
with d drafts:

- `draft`: x̂_1 from the head at draft_hidden; then for i = 1..d-1 the draft layer at position
  n+i-1 over (its previous output, embedding of x̂_i) gives x̂_{i+1} (d heads, d-1 layer passes,
  their K/V written at n..n+d-2 of cache layer L);
- `speculative.verify` (exit layer 0): the whole model over x_n, x̂_1..x̂_d at n..n+d, acceptance,
  and then `catch_up`: the draft layer over the same d+1 positions with the model's own features
  and the tokens that follow them, so the draft's K/V of every emitted position comes from the
  model, never from its guesses, and draft_hidden moves to the row's new last position.

With a confidence stop (`draft:d:stop=η`, Kangaroo) the draft passes run while a row's drafts stay
confident (`_draft_until_unconfident`), and verification scores only the positions drafted. With
a prompt lookup (`draft:d:lookup`) a row whose last tokens occurred before drafts the tokens that
followed them (`decode.lookup`), and the head's drafts stand for the others (`_draft_with_lookup`).

The prefill (`steps.prefill`) fills the draft's K/V of the prompt the same way (`prompt_draft`).
Plain steps in place of rounds (adaptive; `speculative.plain_step`) are full-depth decode steps,
then one `catch_up` over their positions from the features they computed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax import quantized
from eejax.cache import KVCache
from eejax.decode import early_exit, lookup
from eejax.decode.control_flow import run_if
from eejax.decode.drafts import Drafts, token_batch
from eejax.decode.sampling import DRAFT, draft_proposal, token_keys
from eejax.decode.state import DecodeState
from eejax.models import draft_head, exits
from eejax.models.modules import embed
from eejax.options import StepOptions


def uses_reduced_head(params, options: StepOptions) -> bool:
    return options.spec.uses_reduced_head(exits.has_reduced_head(params.get("exits")))


def _propose(params, predicted, state: DecodeState, i, config, options: StepOptions):
    """(draft token [B], q [B, V] or [B, 0] when greedy, the head's top probability [B]) of the
    head at predicted features [B, D]."""
    reduced = uses_reduced_head(params, options)
    logits = draft_head.draft_logits(params, predicted, config, reduced)
    token, q = draft_proposal(
        logits,
        params["exits"]["vocab_ids"] if reduced else None,
        token_keys(state.keys, state.position + i, DRAFT),
        state.sampling,
        options.sampler,
        config.vocab_size,
    )
    return token, q, jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))


def draft(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """d = options.spec.num_speculations drafts per row from the draft head. Returns (drafts,
    state, cache) as `speculative.draft` does: drafts.tokens [B, d+1] (x_n, then the drafts),
    drafts.hidden [B, d+1, D] the embeddings verification starts from, drafts.probs [B, d, V]
    (greedy: [B, d, 0])."""
    if options.spec.confidence_stop is not None and options.spec.num_speculations > 1:
        return _draft_until_unconfident(params, cache, state, block_table, config, options)
    if options.spec.lookup:
        return _draft_with_lookup(params, cache, state, block_table, config, options)
    tokens, probs, cache = _head_chain(params, cache, state, block_table, config, options)
    return _drafts(params, state, tokens, probs), state, cache


def _drafts(params, state: DecodeState, tokens, probs, **counted) -> Drafts:
    """Drafts of tokens [B, d] after each row's last token."""
    tokens = jnp.concatenate([state.last_token[:, None], tokens], axis=1)
    return Drafts(tokens=tokens, hidden=embed(params, tokens), probs=probs, **counted)


def _next_draft(params, cache, state: DecodeState, block_table, predicted, token, i, config, options):
    """The draft layer at position n+i-1 over (predicted [B, D], embedding of token [B]), then the
    head: (proposal, q, confidence, output [B, D], cache)."""
    batch = token_batch(config, state, jnp.reshape(i - 1, (1,)), block_table, cache.page_size, options.attention)
    out, cache = draft_head.draft_layer(params, predicted[:, None], embed(params, token[:, None]), cache, batch, config)
    proposal, q, conf = _propose(params, out[:, 0], state, i, config, options)
    return proposal, q, conf, out[:, 0].astype(predicted.dtype), cache


def _put(tokens, probs, i, proposal, q):
    """tokens [B, d] and probs [B, d, V] with draft i's proposal [B] and q [B, V] written."""
    tokens = jax.lax.dynamic_update_slice(tokens, proposal[:, None], (0, i))
    return tokens, jax.lax.dynamic_update_slice(probs, q[:, None], (0, i) + (0,) * (q.ndim - 1))


def _head_chain(params, cache: KVCache, state: DecodeState, block_table, config, options: StepOptions):
    """The head's chain of d drafts: (tokens [B, d], probs [B, d, V] or [B, d, 0], cache)."""
    d = options.spec.num_speculations
    first, q1, _ = _propose(params, state.draft_hidden, state, 0, config, options)

    def step(carry, i):
        cache, predicted, token = carry
        proposal, q, _, out, cache = _next_draft(
            params, cache, state, block_table, predicted, token, i, config, options
        )
        return (cache, out, proposal), (proposal, q)

    tokens, probs = first[:, None], q1[:, None]
    if d > 1:
        (cache, _, _), (more, more_q) = jax.lax.scan(
            step, (cache, state.draft_hidden, first), jnp.arange(1, d, dtype=jnp.int32)
        )
        tokens = jnp.concatenate([tokens, more.T], axis=1)
        probs = jnp.concatenate([probs, more_q.swapaxes(0, 1)], axis=1)
    return tokens, probs, cache


def _draft_with_lookup(params, cache: KVCache, state: DecodeState, block_table, config, options: StepOptions):
    """A prompt lookup's drafts (`decode.lookup`, up to k = `spec.lookup`) for the rows whose last
    tokens occurred before, as many counting as the match gives (`valid`); the head's chain of d
    for the others. Drafts [B, max(d, k)]. Where a round scores only the positions drafted (not
    a GPU's `early_exit.static_loops`: `speculative.verify`), copies past d need a match of
    `lookup.NGRAM_MAX` tokens, the matches that go on. A copied draft was drawn from a q all on
    it: rejection sampling then accepts it with the model's probability of it, and resamples from
    the model's distribution without it, which is exact. Returns (drafts with `valid`, state, cache).

    On float weights on a CPU a round where every active row copies runs none of the head's
    passes (`_skips_idle_head`)."""
    d, k = options.spec.num_speculations, options.spec.lookup
    short = None if early_exit.static_loops() else d  # copies past d where a round then scores k + 1
    copied, count = lookup.propose(state.prompt, state.tokens, state.num_generated, k, short)
    copying = (count > 0) & ~state.done

    def chain(cache):
        return _head_chain(params, cache, state, block_table, config, options)

    if _skips_idle_head(params):  # the head's passes only where a row drafts from them
        drafting = ~jnp.all(copying | state.done)
        none = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(lambda c: chain(c)[:2], cache))
        tokens, probs, cache = run_if(drafting, lambda t, p, c: chain(c), (*none, cache))
        passes = jnp.where(drafting, d, 0).astype(jnp.int32)
    else:
        tokens, probs, cache = chain(cache)
        passes = jnp.int32(d)
    width = max(d, k)
    copied, tokens = jnp.pad(copied, ((0, 0), (0, width - k))), jnp.pad(tokens, ((0, 0), (0, width - d)))
    tokens = jnp.where(copying[:, None], copied, tokens)
    probs = jnp.pad(probs, ((0, 0), (0, width - d)) + ((0, 0),) * (probs.ndim - 2))
    if probs.shape[-1]:  # rows that sample: q of a copied draft
        probs = jnp.where(copying[:, None, None], jax.nn.one_hot(tokens, probs.shape[-1], dtype=probs.dtype), probs)
    counted = {"valid": jnp.where(copying, count, d), "head_passes": passes}  # of max(d, k) drafts
    return _drafts(params, state, tokens, probs, **counted), state, cache


def _skips_idle_head(params) -> bool:
    """Whether a prompt lookup's round where every active row copies skips the head's d passes (in
    a loop that runs once or not at all, `control_flow.run_if`): on a CPU, where the model's
    weights are float. The news head's float32 `auto` on news (about half its rounds copy; 8
    prompts, 64 tokens, 12 paired runs of each build, 2026-12-03) ran 1.992x -> 2.030x full
    depth with the skip (medians), while on the default load's blocks (the same head and set,
    `draft:2:adaptive:lookup`) it ran 1.380x -> 1.344x, though a copying round alone was cheaper
    with it (why, not found: neither program copies the cache). A first try (2026-12-01) skipped
    them behind a `lax.cond`, which copied the KV cache. A GPU's round (`early_exit.static_loops`)
    runs them for every row, with no data-dependent loop."""
    model = {k: v for k, v in params.items() if k != "draft"}  # a float model's head may draft from blocks
    return not early_exit.static_loops() and not quantized.formats(model)


def _draft_until_unconfident(params, cache, state: DecodeState, block_table, config, options: StepOptions):
    """A chain with Kangaroo's confidence stop η: draft i + 1 counts for a row while its drafts 1..i
    had top probability >= η; the batch drafts on while any active row still does (a while loop:
    the passes after the last such row are not run). Returns (drafts with `valid`, state, cache);
    the positions no pass reached hold token 0 (scored by verification, never accepted)."""
    d, eta = options.spec.num_speculations, options.spec.confidence_stop
    first, q1, confidence = _propose(params, state.draft_hidden, state, 0, config, options)
    b = first.shape[0]
    tokens = jnp.zeros((b, d), jnp.int32).at[:, 0].set(first)
    probs = jnp.zeros((b, d) + q1.shape[1:], q1.dtype).at[:, 0].set(q1)
    drafting = ~state.done & (confidence >= eta)

    def more(carry):
        i, drafting = carry[0], carry[-1]
        return (i < d) & drafting.any()

    def body(carry):
        i, cache, predicted, token, tokens, probs, valid, drafting = carry
        proposal, q, conf, out, cache = _next_draft(
            params, cache, state, block_table, predicted, token, i, config, options
        )
        tokens, probs = _put(tokens, probs, i, proposal, q)
        return i + 1, cache, out, proposal, tokens, probs, valid + drafting, drafting & (conf >= eta)

    start = (jnp.int32(1), cache, state.draft_hidden, first, tokens, probs, jnp.ones((b,), jnp.int32), drafting)
    if early_exit.static_loops():  # a GPU: all d passes, the rows past their stop masked out
        _, cache, _, _, tokens, probs, valid, _ = jax.lax.fori_loop(1, d, lambda i, carry: body(carry), start)
        return _drafts(params, state, tokens, probs, valid=valid, head_passes=jnp.int32(d)), state, cache
    passes, cache, _, _, tokens, probs, valid, _ = jax.lax.while_loop(more, body, start)
    return _drafts(params, state, tokens, probs, valid=valid, head_passes=passes), state, cache


def catch_up(params, cache: KVCache, state: DecodeState, new: DecodeState, h, emitted_tokens, count, batch, config):
    """After verification: the draft layer over the verified positions (batch: those of the round)
    from the model's features of last-layer states h [B, P, D] and the tokens after them
    (emitted_tokens [B, P]: the model's token at each; right for the `count` [B] emitted), and
    `new.draft_hidden` from the row's last emitted position. Returns (new, cache)."""
    feats = draft_head.features(params, h, config)
    out, cache = draft_head.draft_layer(params, feats, embed(params, emitted_tokens), cache, batch, config)
    last = out[jnp.arange(out.shape[0]), jnp.maximum(count - 1, 0)]
    hidden = jnp.where((count > 0)[:, None], last.astype(state.draft_hidden.dtype), state.draft_hidden)
    return dataclasses.replace(new, draft_hidden=hidden), cache


def prompt_draft(params, cache: KVCache, h, tokens, lengths, offset, first, next_token, batch, config):
    """The prefill's part: the draft's K/V of prompt positions offset..lengths-1 from the model's
    features (h [B, T, D] its last-layer states) and the token after each (the prompt's own; after
    the chunk's last position `next_token` [B], or the sampled `first` token where next_token < 0:
    the prompt ends there). Returns (draft_hidden [B, D] at the last position, cache)."""
    b = tokens.shape[0]
    last = jnp.maximum(lengths - offset - 1, 0)
    after = jnp.where(next_token >= 0, next_token, first)
    following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1).at[jnp.arange(b), last].set(after)
    out, cache = draft_head.draft_layer(
        params, draft_head.features(params, h, config), embed(params, following), cache, batch, config
    )
    return out[jnp.arange(b), last].astype(jnp.float32), cache
