"""Llama on the paged KV cache: Flax modules (`DecoderLayer`, `Llama`) applied to stacked params
by plain functions (the model interface, `eejax.models.registry`).

Params (x @ W convention, per-layer weights stacked on a leading L axis):
    embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied to embed)
    layers: attn_norm [L, D], wq [L, D, Hq*Dh], wk/wv [L, D, Hkv*Dh], wo [L, Hq*Dh, D],
            mlp_norm [L, D], w_gate/w_up [L, D, F], w_down [L, F, D];
            Qwen2 (`qkv_bias`): bq [L, Hq*Dh], bk/bv [L, Hkv*Dh]; Qwen3 (`qk_norm`): q_norm/k_norm [L, Dh]

A step processes T new tokens per row (T = prompt bucket for prefill, 1 for decode): every
layer writes the new tokens' K/V into the cache, then attends through the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import KVCache, slot_indices, write_layer_kv
from eejax.config import LlamaConfig
from eejax.errors import EejaxError
from eejax.kernels import cpu_elementwise, cpu_layer, paged_attention
from eejax.kernels.attention import TreeMask, resolve_impl
from eejax.kernels.backend import backend
from eejax.kernels.cpu_matmul import RowsMatrix
from eejax.kernels.head_parallel import head_mesh
from eejax.kernels.triton_linear import fused_linear, fused_linears, fused_qkv_into_cache
from eejax.models import modules
from eejax.models.modules import (
    Dtype,
    Embedder,
    Linear,
    RMSNorm,
    Unembed,
    apply_linears,
    embed,
    scan_layers,
    share_scope,
    unboxed_init,
)
from eejax.models.rope import apply_rope, inv_frequencies, rope_tables
from eejax.models.stack import is_split, on_layer, on_layers, run_layer_range, scan_states, split_stack
from eejax.quantized import is_quantized

ENCODER_DECODER = False  # the prompt is decoded into the paged cache (see `eejax.models.registry`)
DECODE_ONLY_SKIPS = ()  # layer weights a decode step never reads (none)
SPLITS_LAYERS = True  # per-layer buffers (`with_layer_buffers`) are what a CPU decodes fastest
BIAS_KEYS = ("bq", "bk", "bv")  # Qwen2's (`LlamaConfig.qkv_bias`)
QK_NORM_KEYS = ("q_norm", "k_norm")  # Qwen3's (`LlamaConfig.qk_norm`)
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")  # every Llama's
KV_KEYS = ("attn_norm", "wk", "wv", "bk", "bv", "k_norm")  # read where the stack holds them (`_held`)
QKV_KEYS = ("attn_norm", "wq", "wk", "wv", *BIAS_KEYS, *QK_NORM_KEYS)
OUT_KEYS = ("wo", "mlp_norm", "w_gate", "w_up", "w_down")
LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the matrices a quantized model keeps as blocks


def layer_keys(config: LlamaConfig) -> tuple[str, ...]:
    """The weights each of this config's layers holds."""
    return LAYER_KEYS + (BIAS_KEYS if config.qkv_bias else ()) + (QK_NORM_KEYS if config.qk_norm else ())


def _held(layers: dict, keys) -> tuple[str, ...]:
    """`keys` that the stack holds (a Qwen's extra weights are absent from other Llamas')."""
    return tuple(k for k in keys if k in layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenBatch:
    """Where each new token sits and what it attends to; built once per step, shared by layers.

    positions [B, T] int32, pages/slots [B, T] int32 (cache destination; invalid -> null page),
    block_table [B, M] int32, kv_len [B] int32 (valid keys after the step), cos/sin [B, T, Dh];
    attention: the attention implementation (static; see `eejax.kernels.attention`);
    tree: a `TreeMask` when the tokens are a tree of drafts (`decode.tree`), else None;
    window: the attention window (static; `LlamaConfig.sliding_window`, None: every earlier key).
    """

    positions: jax.Array
    pages: jax.Array
    slots: jax.Array
    block_table: jax.Array
    kv_len: jax.Array
    cos: jax.Array
    sin: jax.Array
    attention: str = dataclasses.field(default="auto", metadata=dict(static=True))
    tree: TreeMask | None = None
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))


def token_batch(
    config: LlamaConfig,
    positions,
    valid,
    block_table,
    kv_len,
    page_size,
    attention: str = "auto",
    *,
    context=None,
    rope_positions=None,
    tree: TreeMask | None = None,
) -> TokenBatch:
    """`context` is the rows' per-request state besides the KV cache: a Llama has none. A tree of
    drafts (`decode.tree`) is rotated by `rope_positions` [B, T] (its nodes' depths), not by the
    cache positions it is written at, and attends through `tree`."""
    pages, slots = slot_indices(block_table, positions, valid, page_size)
    inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    cos, sin = rope_tables(positions if rope_positions is None else rope_positions, inv_freq)
    return TokenBatch(positions, pages, slots, block_table, kv_len, cos, sin, attention, tree, config.sliding_window)


def rope_fuses(config: LlamaConfig) -> bool:
    """Whether the Triton layer rotates q and k in their products' launch: a head of a power of
    two >= 32 values (tl.dot's halves), and no norm of q and k before the rotation (Qwen3)."""
    dh = config.head_dim
    return not config.qk_norm and dh >= 32 and dh & (dh - 1) == 0


class DecoderLayer(nn.Module):
    """One Llama decoder layer (Flax): pre-norm GQA attention and a gated SiLU MLP, each with its
    residual. Weights in the eejax layout (see the module docstring, less the L axis), each with
    its logical axes; LoRA factors ride along (`modules.Linear`). The paged decode step runs it in
    two halves around the cache write and the attention over the cache (`qkv`, `out_mlp`); KV fill
    runs `kv`; training runs the whole layer over dense causal attention (`__call__`)."""

    config: LlamaConfig
    init_scale: float = 0.02
    param_dtype: Dtype = jnp.float32
    triton: bool = False  # the paged step's products as `triton_linear`'s fused kernels (attention "triton")

    def setup(self):
        c = self.config
        linear = functools.partial(Linear, init_scale=self.init_scale, param_dtype=self.param_dtype)
        norm = functools.partial(RMSNorm, eps=c.rms_norm_eps, param_dtype=self.param_dtype)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        bias = (lambda name: name) if c.qkv_bias else (lambda name: None)  # noqa: E731
        self.input_norm = norm("attn_norm")
        self.q_proj = linear("wq", q_dim, ("embed", "heads"), bias=bias("bq"))
        self.k_proj = linear("wk", kv_dim, ("embed", "kv_heads"), bias=bias("bk"))
        self.v_proj = linear("wv", kv_dim, ("embed", "kv_heads"), bias=bias("bv"))
        self.o_proj = linear("wo", c.hidden_size, ("heads", "embed"))
        self.post_norm = norm("mlp_norm")
        self.gate_proj = linear("w_gate", c.intermediate_size, ("embed", "mlp"))
        self.up_proj = linear("w_up", c.intermediate_size, ("embed", "mlp"))
        self.down_proj = linear("w_down", c.hidden_size, ("mlp", "embed"))
        share_scope(
            self,
            self.input_norm,
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.o_proj,
            self.post_norm,
            self.gate_proj,
            self.up_proj,
            self.down_proj,
        )
        if c.qk_norm:  # over each head's Dh values, before the rotation
            self.query_norm, self.key_norm = norm("q_norm"), norm("k_norm")
            share_scope(self, self.query_norm, self.key_norm)

    def _fused(self, *names: str) -> list | None:
        """The weights `names` (norms and float matrices) when the step asks for the Triton layer
        and its fused products can take them (float arrays without LoRA factors or biases: no
        blocks, no rows layout), else None (the products run as XLA's)."""
        if not self.triton or self.config.qkv_bias or not all(self.has_variable("params", n) for n in names):
            return None
        if any(self.has_variable("params", n + "_a") for n in names):
            return None
        ws = [self.get_variable("params", n) for n in names]
        return ws if all(isinstance(w, jax.Array) for w in ws) else None  # (tracers are jax.Arrays)

    def qkv(self, h, cos, sin):
        """Rotated q [B, T, Hq, Dh], k and v [B, T, Hkv, Dh] of hidden states h [B, T, D]."""
        b, t, _ = h.shape
        c = self.config
        fused = self._fused("attn_norm", "wq", "wk", "wv")
        if fused:  # RMSNorm + the three products in one launch, q and k rotated in it where they can be
            norm, *ws = fused
            rope = (cos, sin) if rope_fuses(c) else None
            q, k, v = fused_linears(
                h, ws, norm_weight=norm, eps=c.rms_norm_eps, rope=rope, interpret=backend() != "gpu"
            )
            if rope is not None:
                shape = (b, t, -1, c.head_dim)
                return q.reshape(shape), k.reshape(shape), v.reshape(shape)
        else:
            q, k, v = apply_linears(self, self.input_norm(h), self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        q = apply_rope(self.query_norm(q) if c.qk_norm else q, cos, sin)
        return q, *self._rotated_kv(k, v, cos, sin)

    def qkv_into_cache(self, h, cos, sin, cache: KVCache, layer, pages, slots):
        """The Triton layer's first launch whole: RMSNorm, the q/k/v products, their rotation and
        k and v written into the cache at (layer, pages, slots) (`triton_linear.fused_qkv_into_cache`).
        Returns (rotated q [B, T, Hq, Dh], cache), or None where the launch cannot take this
        layer (`_fused`, `rope_fuses`): the caller then runs `qkv` and writes the cache itself."""
        fused = self._fused("attn_norm", "wq", "wk", "wv")
        if not fused or not rope_fuses(self.config):
            return None
        norm, *ws = fused
        q, k, v = fused_qkv_into_cache(
            h, ws, norm_weight=norm, eps=self.config.rms_norm_eps, rope=(cos, sin), k_cache=cache.k,
            v_cache=cache.v, layer=layer, pages=pages, slots=slots, interpret=backend() != "gpu",
        )  # fmt: skip
        return q.reshape(*h.shape[:2], -1, self.config.head_dim), KVCache(k, v)

    def kv(self, h, cos, sin):
        """This layer's K and V [B, T, Hkv, Dh] of hidden states h (norm, projection, rotary)."""
        return self._kv(self.input_norm(h), cos, sin)

    def _kv(self, x, cos, sin):
        return self._rotated_kv(*apply_linears(self, x, self.k_proj, self.v_proj), cos, sin)

    def _rotated_kv(self, k, v, cos, sin):
        """k, v [B, T, Hkv * Dh] -> rotated k and v [B, T, Hkv, Dh]."""
        shape = (*k.shape[:2], self.config.num_kv_heads, self.config.head_dim)
        k = k.reshape(shape)
        return apply_rope(self.key_norm(k) if self.config.qk_norm else k, cos, sin), v.reshape(shape)

    def out_mlp(self, h, attn):
        """The attention output projection of attn [B, T, Hq, Dh] and the gated MLP, each with
        its residual: h [B, T, D] -> h."""
        fused = self._fused("wo", "mlp_norm", "w_gate", "w_up", "w_down")
        if fused:  # o + residual, RMSNorm + gate/up + SiLU·mul, down + residual: three launches
            wo, norm, gate, up, down = fused
            interpret = backend() != "gpu"
            h = fused_linear(attn.reshape(*h.shape[:2], -1), wo, residual=h, interpret=interpret)
            act = fused_linear(h, gate, norm_weight=norm, eps=self.config.rms_norm_eps, w_up=up, interpret=interpret)
            return fused_linear(act, down, residual=h, interpret=interpret)
        h = h + self.o_proj(attn.reshape(*h.shape[:2], -1))
        gate, up = apply_linears(self, self.post_norm(h), self.gate_proj, self.up_proj)
        return h + self.down_proj(cpu_elementwise.silu_mul(gate, up))

    def __call__(self, h, cos, sin, valid):
        """The whole layer over right-padded sequences without a KV cache (training): h [B, T, D],
        cos/sin [B, T, Dh], valid [B, T] bool -> h [B, T, D]."""
        return self.out_mlp(h, causal_attention(*self.qkv(h, cos, sin), valid, self.config.sliding_window))


class Llama(nn.Module):
    """The whole Llama (Flax): embedding, stacked decoder layers, final norm, head (tied to the
    embedding or its own). `init` creates params in the eejax layout with logical axes; decoding
    applies the pieces to given params (`embed`, `logits`, and `DecoderLayer` per layer);
    `__call__` is the no-cache forward: tokens [B, T], lengths [B] -> float32 logits [B, T, V]."""

    config: LlamaConfig
    init_scale: float = 0.02
    param_dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        self.embedder = Embedder(c.vocab_size, c.hidden_size, self.init_scale, self.param_dtype)
        self.layers = DecoderLayer(c, self.init_scale, self.param_dtype)
        self.norm = RMSNorm("final_norm", c.rms_norm_eps, self.param_dtype)
        self.unembed = None if c.tie_embeddings else Unembed(c.vocab_size, self.init_scale, self.param_dtype)
        share_scope(self, *(m for m in (self.embedder, self.norm, self.unembed) if m is not None))

    def embed(self, tokens):
        return self.embedder(tokens)

    def logits(self, h, weight=None):
        """Final norm + head: [..., D] -> float32 [..., V]; `weight` replaces the head's matrix in
        its own layout ([K, D] tied, [D, K] untied): a reduced head gives [..., K]."""
        return self.head(self.norm(h), weight)

    def head(self, x, weight=None):
        """The LM head alone (no final norm): [..., D] -> float32 [..., V] (or [..., K])."""
        return self.embedder.attend(x, weight) if self.unembed is None else self.unembed(x, weight)

    def features(self, tokens, lengths):
        """The no-cache forward up to the head's input: tokens [B, T], lengths [B] -> the final
        norm's output [B, T, D] (a draft head's features, `draft_head`)."""
        _, valid, cos, sin = _dense_positions(self.config, tokens, lengths)
        h = scan_layers(self.layers, self.embed(tokens), cos, sin, valid, length=self.config.num_layers)
        return self.norm(h)

    def __call__(self, tokens, lengths):
        return self.head(self.features(tokens, lengths))


def _dense_positions(config: LlamaConfig, tokens, lengths):
    """Positions [B, T], valid [B, T] and rotary cos/sin [B, T, Dh] of right-padded sequences."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    cos, sin = rope_tables(positions, inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling))
    return positions, valid, cos, sin


def _layer_apply(config: LlamaConfig, lp: dict, method: str | None, *args, triton: bool = False):
    """`DecoderLayer.<method>(*args)` (None: the whole layer) on one layer's weights `lp` (a
    slice of the stack); `triton`: its products as the fused Triton kernels where they apply."""
    return DecoderLayer(config, triton=triton).apply({"params": lp}, *args, method=method)


def kv_of_layer(params, h, layer, batch: TokenBatch, config: LlamaConfig):
    """Layer `layer`'s (traced) K and V `[B, T, Hkv, Dh]` of hidden states h (KV fill); reads
    only that layer's input norm, wk and wv (and their biases, the k norm, where it has them)."""
    layers = params["layers"]
    return on_layer(
        layers, _held(layers, KV_KEYS), layer, lambda lp: _layer_apply(config, lp, "kv", h, batch.cos, batch.sin)
    )


def kv_of_layers(params, h, start: int, stop: int, batch: TokenBatch, config: LlamaConfig):
    """The K and V `[stop - start, B, T, Hkv, Dh]` of hidden states h in each layer of [start,
    stop) (static): one batched product over the stacked weights (KV fill on a GPU)."""
    layers = params["layers"]
    return on_layers(
        layers, _held(layers, KV_KEYS), start, stop, lambda lp: _layer_apply(config, lp, "kv", h, batch.cos, batch.sin)
    )


def causal_attention(q, k, v, valid, window: int | None = None):
    """Dense causal GQA attention: q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh], keys masked by valid
    [B, T] and, with a `window`, to the query's last `window` positions -> [B, T, Hq, Dh] (a
    query with no valid key gets zeros). Heads lead and each KV head's
    G query heads are stacked along the query axis, so both products are plain batched matmuls
    (on CPU 2.5x faster forward than contracting the [B, T, Hkv, G, Dh] layout directly)."""
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qh = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkqd,bksd->bkqs", qh, kh, preferred_element_type=jnp.float32) * dh**-0.5
    query_pos = jnp.tile(jnp.arange(t), g)
    key_pos = jnp.arange(t)[None, :]
    causal = query_pos[:, None] >= key_pos
    if window is not None:
        causal &= key_pos > query_pos[:, None] - window
    mask = causal[None, None] & valid[:, None, None, :]  # [B, 1, G*T, T]
    has_key = mask.any(-1, keepdims=True)
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.where(has_key, -jnp.inf, 0.0)), axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(v.dtype), vh, preferred_element_type=jnp.float32)
    return out.reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dh).astype(q.dtype)


def forward_states(params, tokens, lengths, config: LlamaConfig, skip=None, context=None):
    """The training forward: whole right-padded sequences tokens [B, T] (lengths [B]) through
    dense causal attention, no KV cache. Returns (states [L, B, T, D], layers computed int32);
    states[l] is the hidden state after layer l. skip [L] bool: layer l passes its input through
    unchanged, and a `lax.cond` runs nothing else for it (LayerSkip's layer dropout, one decision
    per layer for the whole batch). The layers may carry LoRA factors (see `modules.Linear`).
    `context` is an encoder-decoder's prompt; a decoder-only model has none."""
    if context is not None:
        raise EejaxError("a decoder-only model's training forward takes no encoder context")
    _, valid, cos, sin = _dense_positions(config, tokens, lengths)

    def layer(h, lp):
        return _layer_apply(config, lp, None, h, cos, sin, valid)

    return scan_states(layer, embed(params, tokens), params["layers"], skip)


def decoder_layer(params, h, cache: KVCache, layer, batch: TokenBatch, config: LlamaConfig):
    """Layer `layer` (possibly traced) of the whole params: writes its K/V for the new tokens,
    returns (h, cache). The halves before and after attention each read the layer's weights
    (`on_layer`); the cache write and the attention over the cache run between them."""
    layers = params["layers"]
    if _in_one_call(layers, h, cache, layer, batch, config):
        if is_split(layers):
            return on_layer(layers, CPU_LAYER_KEYS, layer, lambda lp: one_call(lp, h, cache, layer, batch, config))
        # The whole stacks, which the call reads at `layer` in place (a slice would be a copy of
        # the layer's weights every step: twice the bytes a step moves).
        return one_call({k: layers[k] for k in CPU_LAYER_KEYS}, h, cache, layer, batch, config)
    qkv_keys = _held(layers, QKV_KEYS)
    triton = batch.attention == "triton"  # the Triton layer: its attention and its fused products
    into_cache = None
    # The Triton layer writes k and v into the cache in its first launch, where the cache comes
    # back from `on_layer` as it went in: not out of a per-layer `lax.switch` (its results are
    # copied) nor split by heads over a mesh.
    if triton and (not is_split(layers) or isinstance(layer, int)) and head_mesh(cache.k.shape[1]) is None:
        args = (h, batch.cos, batch.sin, cache, layer, batch.pages, batch.slots)
        into_cache = on_layer(
            layers, qkv_keys, layer, lambda lp: _layer_apply(config, lp, "qkv_into_cache", *args, triton=True)
        )
    if into_cache is not None:
        q, cache = into_cache
    else:
        q, k, v = on_layer(
            layers, qkv_keys, layer, lambda lp: _layer_apply(config, lp, "qkv", h, batch.cos, batch.sin, triton=triton)
        )
        cache = write_layer_kv(cache, layer, k, v, batch.pages, batch.slots)
    attn = cache_attention(q, cache, layer, batch)
    return on_layer(
        layers, OUT_KEYS, layer, lambda lp: _layer_apply(config, lp, "out_mlp", h, attn, triton=triton)
    ), cache


CPU_LAYER_KEYS = (*cpu_layer.NORMS, *cpu_layer.MATRICES)


def _in_one_call(layers: dict, h, cache: KVCache, layer, batch: TokenBatch, config: LlamaConfig) -> bool:
    """Whether layer `layer` runs as one CPU call (`kernels.cpu_layer`): `one_call_applies`, with
    the layer read in place (per-layer buffers at a static index: a `lax.switch` over them would
    copy the cache out; or the stacks at any index), of up to `MAX_ROWS` rows from per-layer
    buffers and `MAX_STACKED_ROWS` from the stacks."""
    split = is_split(layers)
    if split and not isinstance(layer, int):
        return False
    example = {k: layers[k][0] if split else layers[k] for k in layers}
    max_rows = cpu_layer.MAX_ROWS if split else cpu_layer.MAX_STACKED_ROWS
    return one_call_applies(example, h, cache, batch, config, max_rows)


def one_call_applies(lp: dict, h, cache: KVCache, batch: TokenBatch, config: LlamaConfig, max_rows=None) -> bool:
    """Whether a layer of weights `lp` (one layer's, or a stack's: only static facts are read) runs
    over h [B, T, D] as one CPU call (`kernels.cpu_layer.applies`): blocks on a CPU, a Llama layer
    without q/k/v biases, q/k norms or LoRA factors, on one device, at most `max_rows` rows
    (default `cpu_layer.MAX_ROWS`; one row's up to `MAX_POSITIONS` positions)."""
    if config.qkv_bias or config.qk_norm or head_mesh(cache.k.shape[1]) is not None:
        return False
    if any(k + "_a" in lp for k in cpu_layer.MATRICES):
        return False
    weights = {k: lp[k] for k in CPU_LAYER_KEYS if k in lp}
    impl = resolve_impl(batch.attention)
    return cpu_layer.applies(weights, h, cache.k, batch.cos, attention=impl, tree=batch.tree, max_rows=max_rows)


def one_call(lp: dict, h, cache: KVCache, layer, batch: TokenBatch, config: LlamaConfig):
    """Layer `layer` of the cache run over h [B, T, D] as one CPU call with weights `lp` (where
    `one_call_applies`): returns (h, cache), the cache written in place."""
    h, k, v = cpu_layer.decoder_layer(
        lp, h, batch.cos, batch.sin, cache.k, cache.v, layer, batch.pages, batch.slots, batch.block_table,
        batch.positions, batch.kv_len, eps=config.rms_norm_eps, window=batch.window,
    )  # fmt: skip
    return h, KVCache(k, v)


def cache_attention(q, cache: KVCache, layer, batch: TokenBatch):
    """q [B, T, Hq, Dh] over layer `layer` of the paged cache (its new K/V already written), at the
    batch's positions and under its tree mask, if any."""
    return paged_attention(
        q,
        cache.k,
        cache.v,
        layer,
        batch.block_table,
        batch.positions,
        batch.kv_len,
        impl=batch.attention,
        tree=batch.tree,
        window=batch.window,
    )


def run_layers(
    params, h, cache: KVCache, batch: TokenBatch, config: LlamaConfig, start=0, stop=None, length: int | None = None
):
    """Layers [start, stop), or [start, start + length), with a traced layer index (`run_layer_range`)."""
    return run_layer_range(decoder_layer, params, h, cache, batch, config, start, stop, length)


def with_layer_buffers(params) -> dict:
    """params with each layer's weights in their own buffers (`stack.split_stack`): how a CPU
    decode step reads them once."""
    return {**params, "layers": split_stack(params["layers"])}


def with_linear_rows(params) -> dict:
    """params with each float Linear weight of the layers held as its rows (`RowsMatrix`: a
    transposed copy, [L, N, D_in]), the "rows" layout (`eejax.Model.layout`): XLA:GPU multiplies a
    few rows by them in one fused pass. Quantized weights keep their blocks (rows already)."""
    layers = {
        k: RowsMatrix(jnp.swapaxes(v, -1, -2)) if k in LINEAR_KEYS and not is_quantized(v) else v
        for k, v in params["layers"].items()
    }
    return {**params, "layers": layers}


def decoder_layers(params) -> dict:
    """The stacked weights of the layers a decode step runs, {name: [L, ...]}."""
    return params["layers"]


def lm_head(params, h, config: LlamaConfig, weight=None, triton: bool = False):
    """Final norm + LM head: hidden [..., D] -> float32 logits [..., V] (`Llama.logits`).
    `triton` (the Triton layer's steps): the full head of float weights as one fused kernel
    (`triton_linear`: the norm in, a tied head read as the embedding's rows), whose row's logits
    do not depend on the rows beside it; a reduced head (`weight`) or blocks keep XLA's."""
    name = "embed" if config.tie_embeddings else "lm_head"
    w = params[name]
    if triton and weight is None and isinstance(w, jax.Array):
        return fused_linear(
            h,
            w,
            norm_weight=params["final_norm"],
            eps=config.rms_norm_eps,
            transposed=config.tie_embeddings,
            out_dtype=jnp.float32,
            interpret=backend() != "gpu",
        )
    return Llama(config).apply({"params": {"final_norm": params["final_norm"], name: w}}, h, weight, method="logits")


def quantize_weights(params, quantize) -> dict:
    """params with every matrix a decode step multiplies by replaced by `quantize(w, transposed)`
    (`kernels.quantized`): the layers' Linears and an untied head (transposed: their outputs are
    the columns) and the embedding (its rows are tokens); norms and exits stay float."""
    layers = {k: quantize(v, True) if k in LINEAR_KEYS else v for k, v in params["layers"].items()}
    out = {**params, "layers": layers, "embed": quantize(params["embed"], False)}
    if "lm_head" in params:
        out["lm_head"] = quantize(params["lm_head"], True)
    return out


def init_params(config: LlamaConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random params in the eejax layout, created by `Llama.init`: normal(0, scale) weights,
    unit norms."""
    return jax.jit(lambda key: unboxed_init(Llama(config, scale, dtype), key, *_init_inputs()))(key)


def logical_axes(config: LlamaConfig) -> dict:
    """The logical axis names of every param `init_params` creates (PartitionSpecs, same tree)."""
    return modules.logical_axes(Llama(config), *_init_inputs())


def _init_inputs():
    return jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)


def param_bytes_per_token(params, config: LlamaConfig) -> int:
    """Weight bytes one decode token reads at full depth (layers + final norm + LM head)."""
    layers = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
    head = params["embed"] if config.tie_embeddings else params["lm_head"]
    head_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(head))  # quantized: its blocks
    return layers + head_bytes + params["final_norm"].nbytes
