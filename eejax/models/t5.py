"""Pure-functional T5 (v1.0, v1.1, Flan-T5, CALM-style) with the decoder on the paged KV cache.

Params (x @ W convention, per-layer weights stacked on a leading axis):
    embed [V, D] (shared by encoder, decoder and, when tied, the head); lm_head [D, V] (untied only)
    encoder: rel_bias [num_buckets, H], final_norm [D],
        layers: attn_norm, wq, wk, wv [L, D, H*Dk], wo [L, H*Dk, D], mlp_norm,
                wi [L, D, F] (or wi_0, wi_1 when gated), wo_ff [L, F, D]
    decoder: rel_bias, final_norm, layers: the encoder's keys plus
                cross_norm, cq, ck, cv [L, D, H*Dk], co [L, H*Dk, D]

T5 attention has no 1/sqrt(Dk) scaling; the relative-position bias table of the first layer is
shared by all layers (bidirectional buckets in the encoder, causal in the decoder). The encoder
runs once per request (dense attention over the prompt); each decoder layer's cross-attention
K/V of the encoder output are computed once (`cross_kv`) and kept per row in `CrossKV`: they do
not depend on the decoder state, so early exit's KV fill never touches them. Decoder
self-attention K/V live in the paged cache like a Llama's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eejax.cache import KVCache, slot_indices, write_layer_kv
from eejax.config import T5Config
from eejax.errors import UnsupportedModelError
from eejax.kernels import paged_attention
from eejax.models.common import embed, head_matmul, rms_norm
from eejax.models.stack import run_layer_range
from eejax.kernels.position_bias import RelativePositionBias, relative_position_bucket

ENCODER_DECODER = True  # the prompt goes to the encoder; the paged cache holds decoder tokens
DECODE_ONLY_SKIPS = ("ck", "cv")  # cross-attention K/V weights: read once per request, by `cross_kv`
ENCODER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "wo_ff")
CROSS_KEYS = ("cross_norm", "cq", "ck", "cv", "co")


def ff_keys(config: T5Config) -> tuple[str, ...]:
    return ("wi_0", "wi_1") if config.gated else ("wi",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CrossKV:
    """Every decoder layer's cross-attention keys/values of the encoder output: k, v tuples of
    L arrays [B, H, S, Dk], and the encoder length of each row enc_len [B] int32.

    One array per layer, picked with `lax.switch` on the traced layer index: slicing one
    stacked [L, ...] array inside the layer loop copies the layer's K/V every step (measured on
    CPU at batch 32: cross-attention of 8 layers 63 ms sliced, 15 ms switched). Heads come
    before positions so the score and value matmuls need no transpose."""

    k: tuple
    v: tuple
    enc_len: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenBatch:
    """Decoder tokens of one step: positions/pages/slots [B, T], block_table [B, M], kv_len [B],
    the rows' cross-attention K/V, and the attention implementation (static)."""

    positions: jax.Array
    pages: jax.Array
    slots: jax.Array
    block_table: jax.Array
    kv_len: jax.Array
    cross: CrossKV
    attention: str = dataclasses.field(default="auto", metadata=dict(static=True))


def token_batch(config: T5Config, positions, valid, block_table, kv_len, page_size, attention="auto", *,
                context: CrossKV) -> TokenBatch:
    """`context`: the rows' cross-attention K/V (`cross_kv`)."""
    pages, slots = slot_indices(block_table, positions, valid, page_size)
    return TokenBatch(positions, pages, slots, block_table, kv_len, context, attention)


def gelu_new(x):
    """HF's gelu_new: the tanh approximation."""
    return 0.5 * x * (1.0 + jnp.tanh(jnp.sqrt(2.0 / jnp.pi) * (x + 0.044715 * x**3)))


def feed_forward(lp, x, config: T5Config):
    act = jax.nn.relu if config.activation == "relu" else gelu_new
    if config.gated:
        return (act(x @ lp["wi_0"]) * (x @ lp["wi_1"])) @ lp["wo_ff"]
    return act(x @ lp["wi"]) @ lp["wo_ff"]


def position_bias(config: T5Config, bidirectional: bool) -> RelativePositionBias:
    return RelativePositionBias(config.num_buckets, config.max_distance, bidirectional)


def dense_attention(q, k, v, mask, bias=None):
    """q [B, T, H, Dk], k/v [B, S, H, Dk], mask [B, T, S] bool, bias [H, T, S] or None ->
    [B, T, H*Dk]. No score scaling (T5); rows without a valid key give zeros."""
    b, t, h, dk = q.shape
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
    if bias is not None:
        scores = scores + bias[None]
    mask = mask[:, None]
    has_key = mask.any(-1, keepdims=True)
    scores = jnp.where(mask, scores, jnp.where(has_key, -jnp.inf, 0.0))
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(has_key.transpose(0, 2, 1, 3), out, 0.0)
    return out.astype(q.dtype).reshape(b, t, h * dk)


def cross_attention(q, cross: CrossKV, layer):
    """q [B, T, H, Dk] against layer `layer` of the encoder K/V -> [B, T, H*Dk] (no scaling,
    no position bias; padding positions of the encoder masked)."""
    b, t, h, dk = q.shape

    def attend(k, v):  # [B, H, S, Dk] each
        scores = jnp.einsum("bthd,bhsd->bhts", q, k, preferred_element_type=jnp.float32)
        valid = (jnp.arange(k.shape[2])[None, :] < cross.enc_len[:, None])[:, None, None, :]
        probs = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
        probs = jnp.where(cross.enc_len[:, None, None, None] > 0, probs, 0.0)  # padding rows: zeros
        return jnp.einsum("bhts,bhsd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)

    branches = [lambda k=k, v=v: attend(k, v) for k, v in zip(cross.k, cross.v)]
    out = jax.lax.switch(layer, branches) if len(branches) > 1 else branches[0]()
    return out.astype(q.dtype).reshape(b, t, h * dk)


SCORES_CHUNK_BYTES = 32 << 20


def encoder_attention(q, k, v, mask, bias):
    """`dense_attention` over groups of rows whose float32 scores [rows, H, S, S] stay within
    SCORES_CHUNK_BYTES: the softmax passes then run in cache, not memory (measured on CPU for
    batch 32 x 512 tokens: the encoder's attention 1.9 s whole, 0.9 s in groups of 4 rows)."""
    b, s, h, _ = q.shape
    per_row = h * s * k.shape[1] * 4
    rows = max([r for r in range(1, b + 1) if b % r == 0 and r * per_row <= SCORES_CHUNK_BYTES] or [1])
    if rows == b:
        return dense_attention(q, k, v, mask, bias)

    def group(x):
        return x.reshape(b // rows, rows, *x.shape[1:])

    out = jax.lax.map(lambda a: dense_attention(*a, bias), tuple(map(group, (q, k, v, mask))))
    return out.reshape(b, *out.shape[2:])


def _heads(x, config: T5Config):
    return x.reshape(*x.shape[:-1], config.num_heads, config.head_dim)


def layer_params(stack, layer, keys):
    return {k: jax.lax.dynamic_index_in_dim(stack[k], layer, keepdims=False) for k in keys}


def encode(params, tokens, lengths, config: T5Config):
    """The encoder over right-padded prompts: tokens [B, S] int32, lengths [B] -> [B, S, D]."""
    enc = params["encoder"]
    _, s = tokens.shape
    pos = jnp.arange(s, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]
    mask = jnp.broadcast_to(valid[:, None, :], (tokens.shape[0], s, s))
    buckets = relative_position_bucket(pos[None, :] - pos[:, None], position_bias(config, True))  # [S, S]
    bias = enc["rel_bias"].astype(jnp.float32)[buckets].transpose(2, 0, 1)  # [H, S, S]
    keys = ENCODER_KEYS + ff_keys(config)

    def body(layer, h):
        lp = layer_params(enc["layers"], layer, keys)
        x = rms_norm(h, lp["attn_norm"], config.layer_norm_eps)
        q, k, v = (_heads(x @ lp[w], config) for w in ("wq", "wk", "wv"))
        h = h + encoder_attention(q, k, v, mask, bias) @ lp["wo"]
        return h + feed_forward(lp, rms_norm(h, lp["mlp_norm"], config.layer_norm_eps), config)

    h = jax.lax.fori_loop(0, config.num_encoder_layers, body, embed(params, tokens))
    return rms_norm(h, enc["final_norm"], config.layer_norm_eps)


def cross_kv(params, enc_out, lengths, config: T5Config) -> CrossKV:
    """Every decoder layer's cross-attention K/V of the encoder output (computed once)."""
    layers = params["decoder"]["layers"]

    def project(w):  # [D, H*Dk] -> [B, H, S, Dk]
        return jnp.einsum("bsd,dhe->bhse", enc_out, w.reshape(w.shape[0], config.num_heads, config.head_dim))

    k = tuple(project(layers["ck"][layer]) for layer in range(config.num_layers))
    v = tuple(project(layers["cv"][layer]) for layer in range(config.num_layers))
    return CrossKV(k, v, lengths)


def encode_context(params, tokens, lengths, config: T5Config) -> CrossKV:
    """What a decode step needs of the prompt besides the cache: the encoder over right-padded
    prompts tokens [B, S] (lengths [B]), projected into every decoder layer's cross K/V."""
    return cross_kv(params, encode(params, tokens, lengths, config), lengths, config)


def layer_kv(lp, h, batch: TokenBatch, config: T5Config):
    """This decoder layer's self-attention K and V [B, T, H, Dk] of hidden states h."""
    x = rms_norm(h, lp["attn_norm"], config.layer_norm_eps)
    return _heads(x @ lp["wk"], config), _heads(x @ lp["wv"], config)


def kv_of_layer(params, h, layer, batch: TokenBatch, config: T5Config):
    """Decoder layer `layer`'s (traced) self-attention K/V [B, T, H, Dk] of h (KV fill)."""
    return layer_kv(layer_params(params["decoder"]["layers"], layer, ("attn_norm", "wk", "wv")), h, batch, config)


def decoder_layer(params, h, cache: KVCache, layer, batch: TokenBatch, config: T5Config):
    """One decoder layer (self-attention on the paged cache, cross-attention, feed-forward);
    writes its K/V for the new tokens. Returns (h, cache)."""
    dec = params["decoder"]
    lp = layer_params(dec["layers"], layer, ENCODER_KEYS + CROSS_KEYS + ff_keys(config))
    b, t, _ = h.shape
    x = rms_norm(h, lp["attn_norm"], config.layer_norm_eps)
    q = _heads(x @ lp["wq"], config)
    k, v = layer_kv(lp, h, batch, config)
    cache = write_layer_kv(cache, layer, k, v, batch.pages, batch.slots)
    attn = paged_attention(q, cache.k, cache.v, layer, batch.block_table, batch.positions, batch.kv_len,
                           impl=batch.attention, scale=1.0, bias_table=dec["rel_bias"],
                           bias=position_bias(config, False))
    h = h + attn.reshape(b, t, -1) @ lp["wo"]

    x = rms_norm(h, lp["cross_norm"], config.layer_norm_eps)
    q = _heads(x @ lp["cq"], config)
    h = h + cross_attention(q, batch.cross, layer) @ lp["co"]
    return h + feed_forward(lp, rms_norm(h, lp["mlp_norm"], config.layer_norm_eps), config), cache


def run_layers(params, h, cache: KVCache, batch: TokenBatch, config: T5Config, start=0, stop=None,
               length: int | None = None):
    """Decoder layers [start, stop), or [start, start + length), with a traced layer index."""
    return run_layer_range(decoder_layer, params, h, cache, batch, config, start, stop, length)


def with_layer_buffers(params) -> dict:
    """T5 keeps its stacked layout (its decoder layers pick weights by dynamic slices)."""
    return params


def decoder_layers(params) -> dict:
    """The stacked weights of the decoder layers, {name: [L, ...]}."""
    return params["decoder"]["layers"]


def forward_states(params, tokens, lengths, config: T5Config, skip=None):
    """The training forward (`llama.forward_states`) is written for decoder-only models."""
    raise UnsupportedModelError("training exits runs decoder-only (Llama) models; T5 decodes with exits it was "
                                "given (CALM-style checkpoints)")


def lm_head(params, h, config: T5Config, weight=None):
    """Decoder final norm (+ v1.0's d_model^-0.5 scaling) + head: [..., D] -> float32 [..., V];
    `weight` as in `llama.lm_head`."""
    x = rms_norm(h, params["decoder"]["final_norm"], config.layer_norm_eps)
    if config.scale_decoder_outputs:
        x = x * config.hidden_size**-0.5
    return head_matmul(x, params, config.tie_embeddings, weight)


def init_params(config: T5Config, key, dtype=jnp.float32, scale: float = 0.05):
    """Random params with the eejax T5 layout (normal(0, scale) weights, unit norms)."""
    c = config
    D, F, HD = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    keys = iter(jax.random.split(key, 64))

    def normal(*shape):
        return scale * jax.random.normal(next(keys), shape, dtype)

    def stack(n, cross: bool):
        layers = {"attn_norm": jnp.ones((n, D), dtype), "mlp_norm": jnp.ones((n, D), dtype),
                  "wq": normal(n, D, HD), "wk": normal(n, D, HD), "wv": normal(n, D, HD), "wo": normal(n, HD, D),
                  "wo_ff": normal(n, F, D)}
        for k in ff_keys(c):
            layers[k] = normal(n, D, F)
        if cross:
            layers.update(cross_norm=jnp.ones((n, D), dtype), cq=normal(n, D, HD), ck=normal(n, D, HD),
                          cv=normal(n, D, HD), co=normal(n, HD, D))
        return layers

    params = {
        "embed": normal(c.vocab_size, D) / scale,
        "encoder": {"layers": stack(c.num_encoder_layers, False), "rel_bias": normal(c.num_buckets, c.num_heads),
                    "final_norm": jnp.ones((D,), dtype)},
        "decoder": {"layers": stack(c.num_layers, True), "rel_bias": normal(c.num_buckets, c.num_heads),
                    "final_norm": jnp.ones((D,), dtype)},
    }
    if not c.tie_embeddings:
        params["lm_head"] = normal(D, c.vocab_size)
    return params
