"""Pure-functional Llama on the paged KV cache.

Params (x @ W convention, per-layer weights stacked on a leading L axis):
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied to embed)
    layers: attn_norm [L, D], wq [L, D, Hq*Dh], wk/wv [L, D, Hkv*Dh], wo [L, Hq*Dh, D],
            mlp_norm [L, D], w_gate/w_up [L, D, F], w_down [L, F, D]

A step processes T new tokens per row (T = prompt bucket for prefill, 1 for decode): every
layer writes the new tokens' K/V into the cache, then attends through the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import KVCache, slot_indices, write_layer_kv
from eejax.config import LlamaConfig
from eejax.kernels import paged_attention
from eejax.models.common import embed, head_matmul, rms_norm
from eejax.models.stack import on_layer, run_layer_range, split_stack
from eejax.models.rope import apply_rope, inv_frequencies, rope_tables

ENCODER_DECODER = False  # the prompt is decoded into the paged cache (see `eejax.models.registry`)
DECODE_ONLY_SKIPS = ()  # layer weights a decode step never reads (none)
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
KV_KEYS = ("attn_norm", "wk", "wv")
QKV_KEYS = ("attn_norm", "wq", "wk", "wv")
OUT_KEYS = ("wo", "mlp_norm", "w_gate", "w_up", "w_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenBatch:
    """Where each new token sits and what it attends to; built once per step, shared by layers.

    positions [B, T] int32, pages/slots [B, T] int32 (cache destination; invalid -> null page),
    block_table [B, M] int32, kv_len [B] int32 (valid keys after the step), cos/sin [B, T, Dh];
    attention: the attention implementation (static; see `eejax.kernels.attention`).
    """

    positions: jax.Array
    pages: jax.Array
    slots: jax.Array
    block_table: jax.Array
    kv_len: jax.Array
    cos: jax.Array
    sin: jax.Array
    attention: str = dataclasses.field(default="auto", metadata=dict(static=True))


def token_batch(config: LlamaConfig, positions, valid, block_table, kv_len, page_size,
                attention: str = "auto", *, context=None) -> TokenBatch:
    """`context` is the rows' per-request state besides the KV cache: a Llama has none."""
    pages, slots = slot_indices(block_table, positions, valid, page_size)
    inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    cos, sin = rope_tables(positions, inv_freq)
    return TokenBatch(positions, pages, slots, block_table, kv_len, cos, sin, attention)


def linear(x, lp, name):
    """x @ lp[name], plus LoRA's low-rank update x @ a @ b when the layer params carry one
    (`name + "_a"` [D, r], `name + "_b"` [r, O]: training, before the update is merged).
    Accumulated in float32 and rounded once to x's dtype (bf16 weights: as cuBLAS does)."""
    y = jnp.matmul(x, lp[name], preferred_element_type=jnp.float32)
    if name + "_a" in lp:
        y = y + (x @ lp[name + "_a"]) @ lp[name + "_b"]
    return y.astype(x.dtype)


def _qkv(lp, h, cos, sin, config: LlamaConfig):
    """Rotated q `[B, T, Hq, Dh]`, k and v `[B, T, Hkv, Dh]` of hidden states h."""
    b, t, _ = h.shape
    x = rms_norm(h, lp["attn_norm"], config.rms_norm_eps)
    q = apply_rope(linear(x, lp, "wq").reshape(b, t, config.num_heads, config.head_dim), cos, sin)
    k, v = _kv(lp, x, cos, sin, config)
    return q, k, v


def _kv(lp, x, cos, sin, config: LlamaConfig):
    b, t, _ = x.shape
    k = linear(x, lp, "wk").reshape(b, t, config.num_kv_heads, config.head_dim)
    v = linear(x, lp, "wv").reshape(b, t, config.num_kv_heads, config.head_dim)
    return apply_rope(k, cos, sin), v


def _residual_mlp(lp, h, attn, config: LlamaConfig):
    """The attention output projection and the gated MLP, each with its residual."""
    h = h + linear(attn.reshape(*h.shape[:2], -1), lp, "wo")
    x = rms_norm(h, lp["mlp_norm"], config.rms_norm_eps)
    return h + linear(jax.nn.silu(linear(x, lp, "w_gate")) * linear(x, lp, "w_up"), lp, "w_down")


def layer_kv(lp, h, batch: TokenBatch, config: LlamaConfig):
    """This layer's K and V `[B, T, Hkv, Dh]` for hidden states h (input norm, projection, rotary)."""
    return _kv(lp, rms_norm(h, lp["attn_norm"], config.rms_norm_eps), batch.cos, batch.sin, config)


def kv_of_layer(params, h, layer, batch: TokenBatch, config: LlamaConfig):
    """Layer `layer`'s (traced) K and V `[B, T, Hkv, Dh]` of hidden states h (KV fill); reads
    only that layer's input norm, wk and wv."""
    return on_layer(params["layers"], KV_KEYS, layer, lambda lp: layer_kv(lp, h, batch, config))


def causal_layer(lp, h, cos, sin, valid, config: LlamaConfig):
    """One decoder layer over whole right-padded sequences without a KV cache (training):
    h [B, T, D], cos/sin [B, T, Dh], valid [B, T] bool -> h [B, T, D]. `lp` may carry LoRA
    updates (see `linear`)."""
    q, k, v = _qkv(lp, h, cos, sin, config)
    return _residual_mlp(lp, h, causal_attention(q, k, v, valid), config)


def causal_attention(q, k, v, valid):
    """Dense causal GQA attention: q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh], keys masked by valid
    [B, T] -> [B, T, Hq, Dh] (a query with no valid key gets zeros). Heads lead and each KV head's
    G query heads are stacked along the query axis, so both products are plain batched matmuls
    (on CPU 2.5x faster forward than contracting the [B, T, Hkv, G, Dh] layout directly)."""
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qh = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkqd,bksd->bkqs", qh, kh, preferred_element_type=jnp.float32) * dh**-0.5
    query_pos = jnp.tile(jnp.arange(t), g)
    mask = (query_pos[:, None] >= jnp.arange(t)[None, :])[None, None] & valid[:, None, None, :]  # [B, 1, G*T, T]
    has_key = mask.any(-1, keepdims=True)
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.where(has_key, -jnp.inf, 0.0)), axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(v.dtype), vh, preferred_element_type=jnp.float32)
    return out.reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dh).astype(q.dtype)


def forward_states(params, tokens, lengths, config: LlamaConfig, skip=None):
    """The training forward: whole right-padded sequences tokens [B, T] (lengths [B]) through
    dense causal attention, no KV cache. Returns (states [L, B, T, D], layers computed int32);
    states[l] is the hidden state after layer l. skip [L] bool: layer l passes its input through
    unchanged, and a `lax.cond` runs nothing else for it (LayerSkip's layer dropout, one decision
    per layer for the whole batch). The layers may carry LoRA factors (see `linear`)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    cos, sin = rope_tables(positions, inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling))
    if skip is None:
        skip = jnp.zeros((config.num_layers,), bool)

    def compute(h, lp):
        return causal_layer(lp, h, cos, sin, valid, config), jnp.int32(1)

    def body(carry, xs):
        h, count = carry
        lp, skipped = xs
        h, ran = jax.lax.cond(skipped, lambda h, lp: (h, jnp.int32(0)), compute, h, lp)
        return (h, count + ran), h

    (_, count), states = jax.lax.scan(body, (embed(params, tokens), jnp.int32(0)), (params["layers"], skip))
    return states, count


def decoder_layer(params, h, cache: KVCache, layer, batch: TokenBatch, config: LlamaConfig):
    """Layer `layer` (possibly traced) of the whole params: writes its K/V for the new tokens,
    returns (h, cache). The projections before and after attention each read the layer's
    weights (`on_layer`); the cache write and the attention over the cache run between them."""
    layers = params["layers"]
    q, k, v = on_layer(layers, QKV_KEYS, layer, lambda lp: _qkv(lp, h, batch.cos, batch.sin, config))
    cache = write_layer_kv(cache, layer, k, v, batch.pages, batch.slots)
    attn = paged_attention(q, cache.k, cache.v, layer, batch.block_table, batch.positions, batch.kv_len,
                           impl=batch.attention)
    return on_layer(layers, OUT_KEYS, layer, lambda lp: _residual_mlp(lp, h, attn, config)), cache


def run_layers(params, h, cache: KVCache, batch: TokenBatch, config: LlamaConfig, start=0, stop=None,
               length: int | None = None):
    """Layers [start, stop), or [start, start + length), with a traced layer index (`run_layer_range`)."""
    return run_layer_range(decoder_layer, params, h, cache, batch, config, start, stop, length)


def with_layer_buffers(params) -> dict:
    """params with each layer's weights in their own buffers (`stack.split_stack`): how a CPU
    decode step reads them once."""
    return {**params, "layers": split_stack(params["layers"])}


def decoder_layers(params) -> dict:
    """The stacked weights of the layers a decode step runs, {name: [L, ...]}."""
    return params["layers"]


def lm_head(params, h, config: LlamaConfig, weight=None):
    """Final norm + LM head: hidden [..., D] -> float32 logits [..., V]. `weight` replaces the
    head's matrix in its own layout ([K, D] tied, [D, K] untied): a reduced head gives [..., K]."""
    x = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    return head_matmul(x, params, config.tie_embeddings, weight)


def init_params(config: LlamaConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random params with the eejax layout (normal(0, scale) weights, unit norms)."""
    c = config
    L, D, F = c.num_layers, c.hidden_size, c.intermediate_size
    shapes = {
        "wq": (L, D, c.num_heads * c.head_dim),
        "wk": (L, D, c.num_kv_heads * c.head_dim),
        "wv": (L, D, c.num_kv_heads * c.head_dim),
        "wo": (L, c.num_heads * c.head_dim, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {n: scale * jax.random.normal(k, s, dtype) for k, (n, s) in zip(keys, shapes.items())}
    layers["attn_norm"] = jnp.ones((L, D), dtype)
    layers["mlp_norm"] = jnp.ones((L, D), dtype)
    params = {
        "embed": scale * jax.random.normal(keys[-2], (c.vocab_size, D), dtype),
        "layers": layers,
        "final_norm": jnp.ones((D,), dtype),
    }
    if not c.tie_embeddings:
        params["lm_head"] = scale * jax.random.normal(keys[-1], (D, c.vocab_size), dtype)
    return params


def param_bytes_per_token(params, config: LlamaConfig) -> int:
    """Weight bytes one decode token reads at full depth (layers + final norm + LM head)."""
    layers = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
    head = params["embed"] if config.tie_embeddings else params["lm_head"]
    return layers + head.size * head.dtype.itemsize + params["final_norm"].nbytes
