"""A tree of drafts from a draft head, verified in one pass (EAGLE-2's tree, with a static shape):
where the head is unsure it proposes its 2nd likeliest token too, the model scores every node at
once, and each row keeps the longest path of drafts the model agrees with. Greedy rows only.

The tree (`SpecConfig.tree`) is the nodes' rank paths in lexicographic order: node 0 is the row's
last token x_n, node i > 0 the draft at `tree[i - 1]` (the path (0, 1): the head's 2nd likeliest
token after its likeliest first draft). Each node comes after its ancestors, and the likeliest
chain first, at the positions a chain's drafts would take. The depth D is the round's d: a
round emits at most D + 1 tokens.

- `draft`: one pass of the draft layer per depth over the nodes that have children (node i's K/V
  at cache position n + i - 1 of layer L, rotated as n + depth(i) - 1), then the head's top
  tokens of each; depth 1 comes from `draft_hidden`, as in a chain (`feature_draft`).
- `score`: the model over all N + 1 nodes at positions n..n+N, node i rotated as n + depth(i)
  and attending to the row's cache before n, its ancestors and itself (`TreeMask`); the row
  follows its accepted path from the root (a node is accepted when its token is the model's
  argmax at its parent), the path's K/V move to n + 1..n + k (`compact_path`), and the path's
  logits, states and tokens go on to `speculative.verify`'s acceptance as a chain's would.

So the cache after a round is what a chain of the same tokens writes: every emitted position's
K/V came from its ancestors only, at its own rotary position (greedy output is full depth's).
Positions past the accepted path hold K/V that no later query sees (past `seq_len`). A node at
n + i past the row's room (its last tokens) writes to the null page and is never accepted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import KVCache, slot_indices
from eejax.cache.paged import scatter_set
from eejax.decode.argmax import argmax
from eejax.decode.drafts import Drafts, token_batch
from eejax.decode.feature_draft import uses_reduced_head
from eejax.decode.state import DecodeState
from eejax.kernels.attention import TreeMask
from eejax.models import draft_head
from eejax.models.modules import embed
from eejax.models.registry import model_module
from eejax.options import StepOptions


@dataclasses.dataclass(frozen=True)
class Tree:
    """The static shape of a tree of N drafts: per node (0 the root) its parent, depth and rank
    among its siblings; `visible` [N+1, N+1] its ancestors and itself; `expanded[l]` the nodes
    at depth l that have children (the draft layer runs over them)."""

    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    visible: np.ndarray
    expanded: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.parent) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def children(self, level: int):
        """(child, its parent's index in expanded[level], rank) of every node at depth level + 1."""
        return [
            (i, self.expanded[level].index(self.parent[i]), self.rank[i])
            for i in range(1, self.size + 1)
            if self.depth[i] == level + 1
        ]

    @staticmethod
    @functools.cache
    def of(paths: tuple[tuple[int, ...], ...]) -> Tree:
        """The tree of `SpecConfig.tree` (checked, in order)."""
        index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
        nodes = [()] + list(paths)
        parent = (0,) + tuple(index[p[:-1]] for p in paths)
        visible = np.zeros((len(nodes), len(nodes)), bool)
        for i, p in enumerate(nodes):
            for k in range(len(p) + 1):
                visible[i, index[p[:k]]] = True
        depth = tuple(len(p) for p in nodes)
        has_children = set(parent[1:])
        expanded = tuple(
            tuple(i for i in range(len(nodes)) if depth[i] == level and i in has_children)
            for level in range(max(depth))
        )
        return Tree(parent, depth, (0,) + tuple(p[-1] for p in paths), visible, expanded)


def _batch(config, state: DecodeState, nodes, rope_depths, visible, block_table, page_size, window: int):
    """The token batch of tree `nodes` at cache offsets `nodes` past seq_len, rotated at
    seq_len + rope_depths, each attending to the rows' cache before seq_len and to the offsets
    `visible` [len(nodes), window] marks."""
    return token_batch(
        config,
        state,
        jnp.asarray(nodes, jnp.int32),
        block_table,
        page_size,
        "reference",  # the Triton kernel has no tree mask
        width=window,
        rope_positions=state.seq_len[:, None] + jnp.asarray(rope_depths, jnp.int32)[None, :],
        tree=TreeMask(state.seq_len, jnp.asarray(visible)),
    )


def draft(params, cache: KVCache, state: DecodeState, block_table, *, config, options: StepOptions):
    """The tree's drafts for every row. Returns (drafts, state, cache) as `speculative.draft`
    does: drafts.tokens [B, N+1] (x_n, then node 1..N's token), drafts.hidden [B, N+1, D] their
    embeddings, drafts.probs [B, N, 0] (greedy)."""
    tree = Tree.of(options.spec.tree)
    reduced = uses_reduced_head(params, options)
    b = state.last_token.shape[0]
    tokens = jnp.zeros((b, tree.size + 1), jnp.int32).at[:, 0].set(state.last_token)
    outputs = {0: state.draft_hidden}  # node -> the draft's prediction of the feature after it
    for level, nodes in enumerate(tree.expanded):
        if level == 0:
            predicted = state.draft_hidden[:, None]
        else:  # the draft layer over this depth's nodes with children: node i at n + i - 1
            batch = _batch(
                config,
                state,
                [i - 1 for i in nodes],
                [level - 1] * len(nodes),
                tree.visible[list(nodes), 1:],
                block_table,
                cache.page_size,
                tree.size,
            )
            fed = jnp.stack([outputs[tree.parent[i]] for i in nodes], axis=1)
            out, cache = draft_head.draft_layer(
                params, fed, embed(params, tokens[:, list(nodes)]), cache, batch, config
            )
            predicted = out.astype(state.draft_hidden.dtype)
            outputs |= {i: predicted[:, j] for j, i in enumerate(nodes)}
        children = tree.children(level)
        logits = draft_head.draft_logits(params, predicted, config, reduced)  # [B, len(nodes), K]
        _, top = jax.lax.top_k(logits, max(r for _, _, r in children) + 1)
        ids = params["exits"]["vocab_ids"][top] if reduced else top
        for child, j, r in children:
            tokens = tokens.at[:, child].set(ids[:, j, r].astype(jnp.int32))
    probs = jnp.zeros((b, tree.size, 0), jnp.float32)
    return Drafts(tokens=tokens, hidden=embed(params, tokens), probs=probs), state, cache


def compact_path(cache: KVCache, state: DecodeState, path, found, block_table):
    """Moves the K/V of every layer at positions n + path[:, j] to n + j where found[:, j]
    (path [B, D+1] node indices, found [B, D+1] bool): the accepted path, in place of the
    drafts a chain would have written there."""
    page_size = cache.page_size
    src = slot_indices(block_table, state.seq_len[:, None] + path, found, page_size)
    move = found & (path != jnp.arange(path.shape[1])[None, :])
    dst = slot_indices(block_table, state.seq_len[:, None] + jnp.arange(path.shape[1])[None, :], move, page_size)
    heads = jnp.arange(cache.k.shape[1])[None, :, None, None]
    layers = jnp.arange(cache.k.shape[0])[:, None, None, None]

    def move_kv(buffer):
        values = buffer[layers, heads, src[0][None, None], src[1][None, None]]  # [L, Hkv, B, D+1, Dh]
        return scatter_set(buffer, (layers, heads, dst[0][None, None], dst[1][None, None]), values)

    return KVCache(k=move_kv(cache.k), v=move_kv(cache.v))


def score(params, cache: KVCache, state: DecodeState, drafts: Drafts, block_table, *, config, options: StepOptions):
    """The model over the tree (one pass), each row's accepted path, and its K/V compacted.
    Returns (logits [B, D+1, V], last-layer states h [B, D+1, D], tokens [B, D+1], (n [B],
    new [B, D+1]), cache), at the path's nodes, the root first; tokens are x_n then the path's
    drafts, -1 past its end (as a chain whose later drafts were rejected); n drafts accepted and
    the model's argmax at each path node, as `speculative.greedy_accept` gives them for a chain."""
    tree = Tree.of(options.spec.tree)
    count = tree.size + 1
    batch = _batch(config, state, range(count), tree.depth, tree.visible, block_table, cache.page_size, count)
    m = model_module(config)
    h, cache = m.run_layers(params, drafts.hidden, cache, batch, config, 0, config.num_layers)
    logits = m.lm_head(params, h, config)  # [B, N+1, V]
    target = argmax(logits)
    room = state.limit - state.num_generated
    accepted = [~state.done]  # the root; a node: its parent accepted and its token the argmax there
    for i in range(1, count):
        p = tree.parent[i]
        accepted.append(accepted[p] & (drafts.tokens[:, i] == target[:, p]) & (i < room))
    accepted = jnp.stack(accepted, axis=1)  # [B, N+1]: the nodes on the row's path
    depths = np.arange(tree.max_depth + 1)[:, None] == np.asarray(tree.depth)[None, :]  # [D+1, N+1]
    on_path = accepted[:, None, :] & jnp.asarray(depths)[None]  # [B, D+1, N+1]: at most one per depth
    found = on_path.any(-1)
    path = jnp.argmax(on_path, axis=-1).astype(jnp.int32)  # 0 where none
    rows = jnp.arange(path.shape[0])[:, None]
    tokens = jnp.where(found, drafts.tokens[rows, path], -1)
    cache = compact_path(cache, state, path, found, block_table)
    accepted = jnp.sum(found[:, 1:], axis=1).astype(jnp.int32), target[rows, path]
    return logits[rows, path], h[rows, path], tokens, accepted, cache
