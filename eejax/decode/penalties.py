"""Repetition, frequency and presence penalties over a per-row count of the tokens a row has seen.

The penalties are vLLM's (and OpenAI's for the last two), applied to the model's logits before
temperature, top-k and top-p, in this order:
- repetition p (vLLM / HF, CTRL's): a token seen in the prompt or the output has its logit
  divided by p when positive, multiplied by p otherwise (1: off);
- frequency f: minus f times the token's count in the output (0: off);
- presence r: minus r once the token occurs in the output (0: off).
The values ride per row in `RowSampling` (traced: a new value compiles nothing); the counts are
`TokenCounts`, on the device, grown by every token a row emits. Every penalty at its "off"
value leaves the logits bit for bit as they were."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenCounts:
    """output [B, V] int32: each token's occurrences among the row's generated tokens (those a
    preempted row generated before included); prompt [B, V] bool: the tokens of its prompt."""

    output: jax.Array
    prompt: jax.Array

    @classmethod
    def zeros(cls, rows: int, vocab_size: int) -> TokenCounts:
        return cls(jnp.zeros((rows, vocab_size), jnp.int32), jnp.zeros((rows, vocab_size), bool))

    @classmethod
    def of(cls, prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, rows: int) -> TokenCounts:
        """Host arrays for `rows` rows: row i's prompt tokens `prompts[i]` and generated ones
        `outputs[i]` (rows past the lists: none)."""
        output = np.zeros((rows, vocab_size), np.int32)
        prompt = np.zeros((rows, vocab_size), bool)
        for i, (p, o) in enumerate(zip(prompts, outputs)):
            prompt[i, np.asarray(p, np.int64)] = True
            output[i] = np.bincount(np.asarray(o, np.int64), minlength=vocab_size)
        return cls(output, prompt)


def apply_penalties(logits, sampling, counts: TokenCounts, extra=None):
    """logits [B, V] -> penalised float32 logits [B, V]; `sampling`: the rows' `RowSampling`;
    `extra` [B, V] int32: tokens to count as generated besides `counts.output` (a speculation
    round's earlier drafts)."""
    output = counts.output if extra is None else counts.output + extra
    logits = logits.astype(jnp.float32)
    repetition = sampling.repetition[:, None]
    seen = counts.prompt | (output > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - sampling.frequency[:, None] * output.astype(jnp.float32)
    return logits - sampling.presence[:, None] * (output > 0)


def apply_to_positions(logits, sampling, counts: TokenCounts, drafts):
    """logits [B, P, V] of P consecutive positions, drafts [B, P - 1]: the tokens between them
    -> penalised logits [B, P, V]; position j counts drafts[:, :j] as generated (a speculation
    round's verification: each draft is scored as if the ones before it were emitted)."""
    b, positions, vocab = logits.shape
    onehot = jax.nn.one_hot(drafts, vocab, dtype=jnp.int32)  # [B, P-1, V]
    before = jnp.concatenate([jnp.zeros((b, 1, vocab), jnp.int32), jnp.cumsum(onehot, axis=1)], axis=1)
    per_position = jax.tree.map(lambda x: jnp.repeat(x, positions, axis=0), (sampling, counts))
    flat = apply_penalties(logits.reshape(b * positions, vocab), *per_position, before.reshape(b * positions, vocab))
    return flat.reshape(b, positions, vocab)


def count_tokens(counts: TokenCounts, tokens, emitted) -> TokenCounts:
    """`counts` with tokens [B, T] added to the output counts where `emitted` [B, T]."""
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    output = counts.output.at[rows, tokens].add(emitted.astype(jnp.int32))
    return dataclasses.replace(counts, output=output)
