"""What a draft hands to verification (`Drafts`), and the token batch of each row's next positions
that drafting and verification run their layers on."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax.decode.state import DecodeState
from eejax.models.registry import model_module


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
    """tokens [B, d+1] int32: x_0 (the last token) then the d drafts; hidden [B, P, D]: the
    hidden state after E layers of x_0..x_{P-1}, the positions verification scores (P = d + 1
    with the bonus pass, else d); probs [B, d, V] f32: the draft distribution q_i each draft was
    sampled from ([B, d, 0] when greedy); valid [B] int32 or None: the drafts that count for
    each row (the rest are never accepted): with a confidence stop those before its first
    unconfident one, with a prompt lookup its match's; head_passes (int32 scalar) or None: the
    draft head's passes the round ran, when not d."""

    tokens: jax.Array
    hidden: jax.Array
    probs: jax.Array
    valid: jax.Array | None = None
    head_passes: jax.Array | None = None


def token_batch(config, state: DecodeState, offsets, block_table, page_size, attention, *, width=None, **tree):
    """Positions seq_len + offsets [T] of every row; the ones a row may never emit (past its
    limit; all of an inactive row) go to the null page. Keys valid up to the last offset, or
    up to offset `width` - 1. `tree`: a tree of drafts' rotary positions and mask
    (`rope_positions`, `tree`: see `llama.token_batch`)."""
    active = ~state.done
    room = state.limit - state.num_generated
    positions = state.seq_len[:, None] + offsets[None, :]
    valid = active[:, None] & (offsets[None, :] < room[:, None])
    kv_len = state.seq_len + jnp.where(active, offsets[-1] + 1 if width is None else width, 0)
    return model_module(config).token_batch(
        config, positions, valid, block_table, kv_len, page_size, attention, context=state.context, **tree
    )
