"""The log-probabilities of a prompt's own tokens, from the prefill's hidden states (OpenAI's
`echo` with `logprobs`; vLLM's prompt_logprobs): position p's distribution scores token p + 1.

They are the model's own (no temperature, filters or penalties), as vLLM and OpenAI give them.
The head runs over blocks of positions, so a long prompt never holds [B, T, V] logits at once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax.decode.sampling import GREEDY, RowSampling, SamplingParams
from eejax.decode.state import token_logprobs

BLOCK = 16  # positions per head evaluation


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptScores:
    """chosen [B, T] f32: log p(target at each position); top_ids [B, T, K] int32 and top
    [B, T, K] f32: the K = TOP_LOGPROBS likeliest tokens there and their log-probabilities."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def score_prompt(lm_head, h, targets) -> PromptScores:
    """h [B, T, D]: the last layer's states of T prompt positions; targets [B, T] int32: the token
    each position's distribution scores (anything where there is none: its score is then
    meaningless); lm_head: [B, N, D] -> logits [B, N, V]."""
    b, t, d = h.shape
    blocks = -(-t // BLOCK)
    pad = blocks * BLOCK - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, blocks, BLOCK, d).swapaxes(0, 1)
    targets = jnp.pad(jnp.clip(targets, 0), ((0, 0), (0, pad))).reshape(b, blocks, BLOCK).swapaxes(0, 1)
    model_softmax = jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(), b))

    def block(args):
        h_block, target_block = args
        return token_logprobs(lm_head(h_block), target_block, model_softmax, GREEDY)

    chosen, top_ids, top = jax.lax.map(block, (h, targets))

    def unblock(x):  # [blocks, B, BLOCK, ...] -> [B, T, ...]
        return x.swapaxes(0, 1).reshape((b, blocks * BLOCK) + x.shape[3:])[:, :t]

    return PromptScores(unblock(chosen), unblock(top_ids), unblock(top))
