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
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from eejax.cache import KVCache, slot_indices, write_layer_kv
from eejax.config import T5Config
from eejax.errors import EejaxError
from eejax.kernels import paged_attention
from eejax.kernels.position_bias import RelativePositionBias, relative_position_bucket
from eejax.models import modules
from eejax.models.modules import (
    Dtype,
    Embedder,
    Linear,
    RMSNorm,
    Unembed,
    embed,
    normal,
    scan_layers,
    share_scope,
    unboxed_init,
)
from eejax.models.stack import on_layers, run_layer_range, scan_states
from eejax.models.t5_attention import CrossKV, cross_attention, dense_attention, encoder_attention

ENCODER_DECODER = True  # the prompt goes to the encoder; the paged cache holds decoder tokens
DECODE_ONLY_SKIPS = ("ck", "cv")  # cross-attention K/V weights: read once per request, by `cross_kv`
SPLITS_LAYERS = False  # `with_layer_buffers` keeps the stack (its decoder layers pick weights by dynamic slices)
ENCODER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "wo_ff")
CROSS_KEYS = ("cross_norm", "cq", "ck", "cv", "co")


def ff_keys(config: T5Config) -> tuple[str, ...]:
    return ("wi_0", "wi_1") if config.gated else ("wi",)


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


def token_batch(
    config: T5Config, positions, valid, block_table, kv_len, page_size, attention="auto", *, context: CrossKV
) -> TokenBatch:
    """`context`: the rows' cross-attention K/V (`cross_kv`)."""
    pages, slots = slot_indices(block_table, positions, valid, page_size)
    return TokenBatch(positions, pages, slots, block_table, kv_len, context, attention)


def gelu_new(x):
    """HF's gelu_new: the tanh approximation."""
    return 0.5 * x * (1.0 + jnp.tanh(jnp.sqrt(2.0 / jnp.pi) * (x + 0.044715 * x**3)))


def position_bias(config: T5Config, bidirectional: bool) -> RelativePositionBias:
    return RelativePositionBias(config.num_buckets, config.max_distance, bidirectional)


class T5Block(nn.Module):
    """One T5 layer (Flax): self-attention, cross-attention over the encoder output (decoder
    layers, `cross`), and the feed-forward, each pre-norm with its residual. Weights in the eejax
    layout (the module docstring, less the L axis) with logical axes; products in the weights'
    dtype, as HF's T5. The paged decode step runs it in pieces around the cache write and the
    attentions (`self_qkv`, `attn_out`, `cross_q`, `cross_out`, `feed_forward`); `__call__` is the
    whole layer over dense attention (the encoder, the no-cache forward)."""

    config: T5Config
    cross: bool = False
    init_scale: float = 0.05
    param_dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        linear = functools.partial(Linear, init_scale=self.init_scale, param_dtype=self.param_dtype, accumulate=False)
        norm = functools.partial(RMSNorm, eps=c.layer_norm_eps, param_dtype=self.param_dtype)
        hd, d, f = c.num_heads * c.head_dim, c.hidden_size, c.intermediate_size
        self.input_norm, self.post_norm = norm("attn_norm"), norm("mlp_norm")
        self.q_proj = linear("wq", hd, ("embed", "heads"))
        self.k_proj, self.v_proj = (linear(w, hd, ("embed", "kv_heads")) for w in ("wk", "wv"))  # the paged cache's
        self.o_proj = linear("wo", d, ("heads", "embed"))
        self.in_projs = [linear(w, f, ("embed", "mlp")) for w in ff_keys(c)]
        self.ff_out = linear("wo_ff", d, ("mlp", "embed"))
        blocks = [
            self.input_norm,
            self.post_norm,
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.o_proj,
            *self.in_projs,
            self.ff_out,
        ]
        if self.cross:
            self.cross_input_norm = norm("cross_norm")
            self.cq_proj, self.ck_proj, self.cv_proj = (linear(w, hd, ("embed", "heads")) for w in ("cq", "ck", "cv"))
            self.co_proj = linear("co", d, ("heads", "embed"))
            blocks += [self.cross_input_norm, self.cq_proj, self.ck_proj, self.cv_proj, self.co_proj]
        share_scope(self, *blocks)

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)

    def self_qkv(self, h):
        """Self-attention q, k, v [B, T, H, Dk] of hidden states h [B, T, D]."""
        x = self.input_norm(h)
        return tuple(self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))

    def self_kv(self, h):
        """Self-attention K and V [B, T, H, Dk] of h (KV fill)."""
        x = self.input_norm(h)
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def attn_out(self, h, attn):
        """h + the output projection of self-attention attn [B, T, H*Dk]."""
        return h + self.o_proj(attn)

    def cross_q(self, h):
        return self._heads(self.cq_proj(self.cross_input_norm(h)))

    def cross_out(self, h, attn):
        return h + self.co_proj(attn)

    def cross_kv(self, enc_out):
        """Cross-attention K and V [B, H, S, Dk] of the encoder output [B, S, D]: heads first,
        straight out of the product (no transpose copy)."""
        c = self.config
        if self.is_initializing():  # the projections declare their weights
            self.ck_proj(enc_out), self.cv_proj(enc_out)
        ws = (nn.unbox(self.get_variable("params", w)) for w in ("ck", "cv"))
        return tuple(jnp.einsum("bsd,dhe->bhse", enc_out, w.reshape(w.shape[0], c.num_heads, c.head_dim)) for w in ws)

    def feed_forward(self, h):
        act = jax.nn.relu if self.config.activation == "relu" else gelu_new
        x = self.post_norm(h)
        if self.config.gated:
            wi_0, wi_1 = self.in_projs
            return h + self.ff_out(act(wi_0(x)) * wi_1(x))
        return h + self.ff_out(act(self.in_projs[0](x)))

    def __call__(self, h, mask, bias, enc_out=None, enc_mask=None):
        """The whole layer without a cache: h [B, T, D], self-attention mask [B, T, T] bool and
        position bias [H, T, T]; decoder layers also attend to enc_out [B, S, D] under enc_mask
        [B, T, S]."""
        h = self.attn_out(h, encoder_attention(*self.self_qkv(h), mask, bias))
        if self.cross:
            k, v = (x.transpose(0, 2, 1, 3) for x in self.cross_kv(enc_out))
            h = self.cross_out(h, dense_attention(self.cross_q(h), k, v, enc_mask))
        return self.feed_forward(h)


class PositionBiasTable(nn.Module):
    """The relative-position bias table `rel_bias` [num_buckets, H]: buckets [T, S] -> float32
    bias [H, T, S]."""

    num_buckets: int
    num_heads: int
    init_scale: float = 0.05
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, buckets):
        table = self.param(
            "rel_bias",
            normal(self.init_scale, ("relpos_buckets", "heads")),
            (self.num_buckets, self.num_heads),
            self.param_dtype,
        )
        return table.astype(jnp.float32)[buckets].transpose(2, 0, 1)


class T5Stack(nn.Module):
    """The encoder or the decoder (Flax): stacked `T5Block`s, the relative-position bias table
    `rel_bias` [num_buckets, H] of the first layer (shared by all) and the final norm."""

    config: T5Config
    decoder: bool
    init_scale: float = 0.05
    param_dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.layers = T5Block(c, self.decoder, self.init_scale, self.param_dtype)
        self.bias = PositionBiasTable(c.num_buckets, c.num_heads, self.init_scale, self.param_dtype)
        self.norm = RMSNorm("final_norm", c.layer_norm_eps, self.param_dtype)
        share_scope(self, self.bias, self.norm)

    def position_bias(self, t: int):
        """The bias [H, T, T] between T positions (bidirectional in the encoder, causal in the decoder)."""
        pos = jnp.arange(t, dtype=jnp.int32)
        return self.bias(
            relative_position_bucket(pos[None, :] - pos[:, None], position_bias(self.config, not self.decoder))
        )

    def final_norm(self, h):
        return self.norm(h)

    def __call__(self, h, valid, enc_out=None, enc_valid=None):
        """The stack without a cache over right-padded h [B, T, D] (valid [B, T] bool); the
        decoder is causal and attends to enc_out [B, S, D] (enc_valid [B, S])."""
        b, t, _ = h.shape
        mask = jnp.broadcast_to(valid[:, None, :], (b, t, t))
        enc_mask = None
        if self.decoder:
            mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
            enc_mask = jnp.broadcast_to(enc_valid[:, None, :], (b, t, enc_valid.shape[1]))
        n = self.config.num_layers if self.decoder else self.config.num_encoder_layers
        h = scan_layers(self.layers, h, mask, self.position_bias(t), enc_out, enc_mask, length=n)
        return self.final_norm(h)


class T5(nn.Module):
    """The whole T5 (Flax): the shared embedding, encoder, decoder, head. `init` creates params in
    the eejax layout with logical axes; `__call__` is the no-cache forward: prompts tokens [B, S]
    (lengths [B]) and decoder inputs [B, T] (dec_lengths [B]) -> float32 logits [B, T, V]."""

    config: T5Config
    init_scale: float = 0.05
    param_dtype: Dtype = jnp.float32

    def setup(self):
        c, kw = self.config, dict(init_scale=self.init_scale, param_dtype=self.param_dtype)
        self.embedder = Embedder(c.vocab_size, c.hidden_size, 1.0, self.param_dtype)
        self.encoder = T5Stack(c, False, **kw)
        self.decoder = T5Stack(c, True, **kw)
        self.unembed = None if c.tie_embeddings else Unembed(c.vocab_size, **kw)
        share_scope(self, *(m for m in (self.embedder, self.unembed) if m is not None))

    def logits(self, h, weight=None):
        """Decoder final norm (+ v1.0's d_model^-0.5 scaling) + head: [..., D] -> float32 [..., V];
        `weight` as in `llama.Llama.logits`."""
        x = self.decoder.final_norm(h)
        if self.config.scale_decoder_outputs:
            x = x * self.config.hidden_size**-0.5
        return self.embedder.attend(x, weight) if self.unembed is None else self.unembed(x, weight)

    def __call__(self, tokens, lengths, dec_tokens, dec_lengths):
        valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        dec_valid = jnp.arange(dec_tokens.shape[1])[None, :] < dec_lengths[:, None]
        enc_out = self.encoder(self.embedder(tokens), valid)
        h = self.decoder(self.embedder(dec_tokens), dec_valid, enc_out, valid)
        return self.logits(h)


def _block(config: T5Config, lp: dict, method: str | None, *args, cross: bool = True):
    """`T5Block.<method>(*args)` (None: the whole layer) on one layer's weights `lp`."""
    return T5Block(config, cross).apply({"params": lp}, *args, method=method)


def layer_params(stack, layer, keys):
    return {k: jax.lax.dynamic_index_in_dim(stack[k], layer, keepdims=False) for k in keys}


def encode(params, tokens, lengths, config: T5Config):
    """The encoder over right-padded prompts: tokens [B, S] int32, lengths [B] -> [B, S, D]."""
    enc = params["encoder"]
    _, s = tokens.shape
    valid = jnp.arange(s, dtype=jnp.int32)[None, :] < lengths[:, None]
    mask = jnp.broadcast_to(valid[:, None, :], (tokens.shape[0], s, s))
    stack = T5Stack(config, decoder=False)
    bias = stack.apply({"params": {"rel_bias": enc["rel_bias"]}}, s, method="position_bias")
    keys = ENCODER_KEYS + ff_keys(config)

    def body(layer, h):
        return _block(config, layer_params(enc["layers"], layer, keys), None, h, mask, bias, cross=False)

    h = jax.lax.fori_loop(0, config.num_encoder_layers, body, embed(params, tokens))
    return stack.apply({"params": {"final_norm": enc["final_norm"]}}, h, method="final_norm")


def cross_kv(params, enc_out, lengths, config: T5Config) -> CrossKV:
    """Every decoder layer's cross-attention K/V of the encoder output (computed once)."""
    layers = params["decoder"]["layers"]
    kv = [
        _block(config, {w: layers[w][layer] for w in ("ck", "cv")}, "cross_kv", enc_out)
        for layer in range(config.num_layers)
    ]
    return CrossKV(tuple(k for k, _ in kv), tuple(v for _, v in kv), lengths)


def empty_context(config: T5Config, rows: int, length: int, dtype) -> CrossKV:
    """Room for `rows` rows' context of prompts up to `length` tokens (decode slots); zeros."""
    kv = tuple(jnp.zeros((rows, config.num_heads, length, config.head_dim), dtype) for _ in range(config.num_layers))
    return CrossKV(kv, kv, jnp.zeros((rows,), jnp.int32))


def encode_context(params, tokens, lengths, config: T5Config) -> CrossKV:
    """What a decode step needs of the prompt besides the cache: the encoder over right-padded
    prompts tokens [B, S] (lengths [B]), projected into every decoder layer's cross K/V."""
    return cross_kv(params, encode(params, tokens, lengths, config), lengths, config)


def kv_of_layer(params, h, layer, batch: TokenBatch, config: T5Config):
    """Decoder layer `layer`'s (traced) self-attention K/V [B, T, H, Dk] of h (KV fill)."""
    lp = layer_params(params["decoder"]["layers"], layer, ("attn_norm", "wk", "wv"))
    return _block(config, lp, "self_kv", h)


def kv_of_layers(params, h, start: int, stop: int, batch: TokenBatch, config: T5Config):
    """Decoder layers [start, stop)'s (static) self-attention K/V `[stop - start, B, T, H, Dk]`
    of h: one batched product over the stacked weights (KV fill on a GPU)."""
    keys = ("attn_norm", "wk", "wv")
    return on_layers(params["decoder"]["layers"], keys, start, stop, lambda lp: _block(config, lp, "self_kv", h))


def decoder_layer(params, h, cache: KVCache, layer, batch: TokenBatch, config: T5Config):
    """One decoder layer (self-attention on the paged cache, cross-attention, feed-forward);
    writes its K/V for the new tokens. Returns (h, cache)."""
    dec = params["decoder"]
    lp = layer_params(dec["layers"], layer, ENCODER_KEYS + CROSS_KEYS + ff_keys(config))
    b, t, _ = h.shape
    q, k, v = _block(config, lp, "self_qkv", h)
    cache = write_layer_kv(cache, layer, k, v, batch.pages, batch.slots)
    attn = paged_attention(
        q,
        cache.k,
        cache.v,
        layer,
        batch.block_table,
        batch.positions,
        batch.kv_len,
        impl=batch.attention,
        scale=1.0,
        bias_table=dec["rel_bias"],
        bias=position_bias(config, False),
    )
    h = _block(config, lp, "attn_out", h, attn.reshape(b, t, -1))
    h = _block(config, lp, "cross_out", h, cross_attention(_block(config, lp, "cross_q", h), batch.cross, layer))
    return _block(config, lp, "feed_forward", h), cache


def run_layers(
    params, h, cache: KVCache, batch: TokenBatch, config: T5Config, start=0, stop=None, length: int | None = None
):
    """Decoder layers [start, stop), or [start, start + length), with a traced layer index."""
    return run_layer_range(decoder_layer, params, h, cache, batch, config, start, stop, length)


def with_layer_buffers(params) -> dict:
    """T5 keeps its stacked layout (its decoder layers pick weights by dynamic slices)."""
    return params


def with_linear_rows(params) -> dict:
    """T5 keeps its weights as they are (HF T5's bf16 products round in x's dtype, `Linear`)."""
    return params


def decoder_layers(params) -> dict:
    """The stacked weights of the decoder layers, {name: [L, ...]}."""
    return params["decoder"]["layers"]


def forward_states(params, tokens, lengths, config: T5Config, skip=None, context=None):
    """The training forward of the decoder, no KV cache: right-padded decoder inputs tokens [B, T]
    (lengths [B]; each row starts with the decoder start token) attending causally to themselves
    and to the encoder's output of `context` = (prompts [B, S] int32, prompt lengths [B]).
    Returns (states [L, B, T, D], layers computed int32); states[l] is the decoder's hidden state
    after layer l, before the final norm (what the exit heads read). skip [L] bool: layer l passes
    its input through and nothing else runs for it (as `llama.forward_states`)."""
    if context is None:
        raise EejaxError("T5's training forward needs the prompts its decoder attends to (context)")
    prompts, prompt_lengths = context
    enc_out = encode(params, prompts, prompt_lengths, config)
    dec = params["decoder"]
    b, t = tokens.shape
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < lengths[:, None]
    mask = valid[:, None, :] & jnp.tril(jnp.ones((t, t), bool))[None]
    enc_valid = jnp.arange(prompts.shape[1], dtype=jnp.int32)[None, :] < prompt_lengths[:, None]
    enc_mask = jnp.broadcast_to(enc_valid[:, None, :], (b, t, prompts.shape[1]))
    bias = T5Stack(config, decoder=True).apply({"params": {"rel_bias": dec["rel_bias"]}}, t, method="position_bias")
    layers = {k: dec["layers"][k] for k in ENCODER_KEYS + CROSS_KEYS + ff_keys(config)}

    def layer(h, lp):
        return _block(config, lp, None, h, mask, bias, enc_out, enc_mask)

    return scan_states(layer, embed(params, tokens), layers, skip)


def lm_head(params, h, config: T5Config, weight=None, triton: bool = False):
    """Decoder final norm (+ v1.0's d_model^-0.5 scaling) + head: [..., D] -> float32 [..., V]
    (`T5.logits`); `weight` as in `llama.lm_head`. T5 has no Triton head: `triton` changes nothing."""
    head = {
        "decoder": {"final_norm": params["decoder"]["final_norm"]},
        **{k: params[k] for k in ("embed" if config.tie_embeddings else "lm_head",)},
    }
    return T5(config).apply({"params": head}, h, weight, method="logits")


def init_params(config: T5Config, key, dtype=jnp.float32, scale: float = 0.05):
    """Random params in the eejax T5 layout, created by `T5.init`: normal(0, scale) weights,
    normal(0, 1) embedding, unit norms."""
    return jax.jit(lambda key: unboxed_init(T5(config, scale, dtype), key, *_init_inputs()))(key)


def logical_axes(config: T5Config) -> dict:
    """The logical axis names of every param `init_params` creates (PartitionSpecs, same tree)."""
    return modules.logical_axes(T5(config), *_init_inputs())


def _init_inputs():
    one = jnp.ones((1,), jnp.int32)
    return jnp.zeros((1, 1), jnp.int32), one, jnp.zeros((1, 1), jnp.int32), one
