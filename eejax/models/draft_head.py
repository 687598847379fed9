"""A trained draft head on a frozen Llama (EAGLE, Li et al. 2024): one fully connected layer over
[embedding of token t+1 ⊕ the model's feature at t], one decoder layer with its own K/V, and the
model's own LM head. It drafts by autoregressing features: its output at t predicts the model's
feature at t+1, whose head gives token t+2; that output and the drafted token are its next input.

The feature is what the LM head reads: the final norm's output after the last layer (so the draft
reads the head directly, with no norm of its own). Params, under `params["draft"]`:

    fc [2D, D]                       the input layer (x @ W on [embed ⊕ feature])
    layer {attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down}   one Llama decoder layer

The draft layer keeps its K/V in the model's paged cache as one more layer (index L), so its
pages are the row's own: allocated, shared by prefix caching and rolled back with the row. The
K/V at position p is always computed from the model's own feature at p and the token at p+1
(`decode.feature_draft` rewrites a round's positions after verification), never from the
draft's guesses. Draft tokens come from the full head or the model's reduced exit head
(`params["exits"]["vocab_head"]`, FR-Spec); verification always uses the full model, so the
output does not depend on the draft.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import KVCache, write_layer_kv
from eejax.config import LlamaConfig
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.kernels.cpu_matmul import matmul, matmul_t
from eejax.models import exits
from eejax.models.common import rms_norm
from eejax.models.llama import (
    LINEAR_KEYS,
    DecoderLayer,
    TokenBatch,
    _dense_positions,
    cache_attention,
    layer_keys,
    one_call,
    one_call_applies,
)
from eejax.models.modules import Dtype, Linear, share_scope, unboxed_init
from eejax.quantized import is_quantized

DRAFT_KEYS = ("fc", "layer")


class DraftHead(nn.Module):
    """The draft module (Flax): `inputs` fuses a token's embedding with a feature, the layer is a
    `llama.DecoderLayer` of the model's shape (its params under `layer`); `__call__` is the dense
    training forward over whole sequences."""

    config: LlamaConfig
    init_scale: float = 0.02
    param_dtype: Dtype = jnp.float32

    def setup(self):
        self.fuse = Linear("fc", self.config.hidden_size, ("fused", "embed"), self.init_scale, self.param_dtype)
        self.layer = DecoderLayer(self.config, self.init_scale, self.param_dtype)
        share_scope(self, self.fuse)

    def inputs(self, features, token_embeds):
        """features, token_embeds [..., D] -> the decoder layer's input [..., D]."""
        return self.fuse(jnp.concatenate([token_embeds, features.astype(token_embeds.dtype)], axis=-1))

    def __call__(self, features, token_embeds, cos, sin, valid):
        """features [B, T, D] (the model's at t), token_embeds [B, T, D] (of token t+1), rotary
        cos/sin [B, T, Dh] at t, valid [B, T] -> predicted features [B, T, D] (of t+1)."""
        return self.layer(self.inputs(features, token_embeds), cos, sin, valid)


def check_model(config) -> None:
    if getattr(config, "architecture", None) != "llama":
        raise UnsupportedModelError(
            f"draft heads are built for decoder-only Llama models, not "
            f"{getattr(config, 'architecture', type(config).__name__)}"
        )


def has_draft(params) -> bool:
    return bool(params.get("draft"))


def init_draft(config: LlamaConfig, key, dtype=jnp.float32, params=None) -> dict:
    """A new draft head: normal(0, 0.02) weights, the fc's feature half the identity, so the draft
    starts by passing the feature on with small changes; with the model's `params`, the decoder
    layer is a copy of the model's last layer instead (a test's poor but peaked draft: the last
    layer's outputs are large in the feature space, so it trains worse than the small start)."""
    check_model(config)
    d = config.hidden_size
    zeros = jnp.zeros((1, 1, d), dtype)
    cos = sin = jnp.zeros((1, 1, config.head_dim), dtype)
    draft = unboxed_init(DraftHead(config, param_dtype=dtype), key, zeros, zeros, cos, sin, jnp.ones((1, 1), bool))
    draft["fc"] = draft["fc"].at[d:].add(jnp.eye(d, dtype=dtype))
    if params is not None:
        draft["layer"] = {k: jnp.asarray(params["layers"][k][-1], dtype) for k in layer_keys(config)}
    return draft


def check_draft(draft, config) -> None:
    """EejaxError naming the first entry of `params["draft"]` that does not fit `config`."""
    if not draft:
        return
    check_model(config)
    _check_no_fusion(draft)
    d = config.hidden_size
    keys = layer_keys(config)
    if set(draft) != set(DRAFT_KEYS) or set(draft["layer"]) != set(keys):
        raise EejaxError(f"params['draft'] must hold {list(DRAFT_KEYS)} with the layer's {list(keys)}")
    if tuple(draft["fc"].shape) != (2 * d, d):
        raise EejaxError(f"params['draft']['fc'] has shape {tuple(draft['fc'].shape)}, the model needs {(2 * d, d)}")
    want = jax.eval_shape(lambda: init_draft(config, jax.random.PRNGKey(0)))["layer"]
    for k, x in draft["layer"].items():
        if tuple(x.shape) != tuple(want[k].shape):
            raise EejaxError(
                f"params['draft']['layer'][{k!r}] has shape {tuple(x.shape)}, the model needs {tuple(want[k].shape)}"
            )


def _check_no_fusion(draft) -> None:
    if "fuse" in draft:
        raise UnsupportedModelError(
            "this draft head fuses lower layers' states (draft_head.fused_feature), which is built for training and "
            "measuring only: decoding does not compute those states yet"
        )


def logical_axes(config: LlamaConfig) -> dict:
    from eejax.models.modules import logical_axes as module_axes

    d = config.hidden_size
    zeros = jnp.zeros((1, 1, d))
    cos = jnp.zeros((1, 1, config.head_dim))
    return module_axes(DraftHead(config), zeros, zeros, cos, cos, jnp.ones((1, 1), bool))


def num_weights(draft) -> int:
    """Weights one draft token reads besides the head: the fc and the decoder layer."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(draft, is_leaf=is_quantized))


def quantize_weights(draft, quantize) -> dict:
    """The draft head with its fc and its layer's Linears replaced by `quantize(w, transposed=True)`
    (`eejax.quantized`); norms, and matrices already quantized, stay as they are."""

    def q(w):
        return w if is_quantized(w) else quantize(w, True)

    return {"fc": q(draft["fc"]), "layer": {k: q(v) if k in LINEAR_KEYS else v for k, v in draft["layer"].items()}}


def init_fuse(config: LlamaConfig, layers: int, dtype=jnp.float32):
    """The fusion of `layers` lower layers' hidden states into the feature (`fused_feature`):
    zeros [layers·D, D], so a head given one starts as it was."""
    d = config.hidden_size
    return jnp.zeros((layers * d, d), dtype)


def fused_feature(draft, feature, states, config: LlamaConfig):
    """EAGLE-3's feature fusion, as a residual on the model's feature: feature [..., D] plus
    draft["fuse"] [n·D, D] over the hidden states after n lower layers, states [..., n, D], each
    RMS-normalised (no weight) and scaled by 1/sqrt(n·D): the matrix's first Adam steps, each
    entry ±lr, then move the feature by ~lr·sqrt(n·D), not lr·n·D. Only the first draft of a
    round reads it: later drafts read the draft's own predicted features. Training only so far:
    decoding and loading refuse a head with a fusion (`check_draft`, `draft_layer`)."""
    s = states.astype(jnp.float32)
    s = s * jax.lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) * s.shape[-2] + config.rms_norm_eps)
    return feature + s.reshape(*s.shape[:-2], -1) @ draft["fuse"].astype(jnp.float32)


def features(params, h, config: LlamaConfig):
    """The model's feature of last-layer hidden states h [..., D]: the final norm's output."""
    return rms_norm(h, params["final_norm"], config.rms_norm_eps)


def _apply(config, draft, method, *args):
    return DraftHead(config).apply({"params": {"fc": draft["fc"], "layer": draft["layer"]}}, *args, method=method)


def _layer(config, draft, method, *args, triton: bool = False):
    return DecoderLayer(config, triton=triton).apply({"params": draft["layer"]}, *args, method=method)


def draft_layer(params, feature, token_embeds, cache: KVCache, batch: TokenBatch, config: LlamaConfig):
    """The draft head over T new positions per row: feature [B, T, D] (the model's, or the draft's
    own prediction, at each position), token_embeds [B, T, D] of the token after it. Writes the
    draft layer's K/V at the batch's slots in cache layer L, attends over the row's earlier ones.
    With the Triton layer (attention "triton") its products are the fused kernels, as the model's;
    with blocks on a CPU the layer is one call (`llama.one_call`), as the model's are.
    Returns (predicted features [B, T, D], cache)."""
    draft, layer, triton = params["draft"], config.num_layers, batch.attention == "triton"
    _check_no_fusion(draft)
    x = _apply(config, draft, "inputs", feature, token_embeds)
    if one_call_applies(draft["layer"], x, cache, batch, config):  # blocks on a CPU: one call
        return one_call(draft["layer"], x, cache, layer, batch, config)
    q, k, v = _layer(config, draft, "qkv", x, batch.cos, batch.sin, triton=triton)
    cache = write_layer_kv(cache, layer, k, v, batch.pages, batch.slots)
    attn = cache_attention(q, cache, layer, batch)
    return _layer(config, draft, "out_mlp", x, attn, triton=triton), cache


def draft_logits(params, predicted, config: LlamaConfig, reduced: bool):
    """The head over predicted features [..., D] (no norm: they are in the head's input space):
    float32 logits [..., V], or [..., K] of the reduced exit head's tokens."""
    w = params["exits"]["vocab_head"] if reduced else exits.head_weight(params, config.tie_embeddings)
    return matmul_t(predicted, w) if config.tie_embeddings else matmul(predicted, w)


def dense_forward(config: LlamaConfig, draft, feature, token_embeds, lengths):
    """Training: the draft over right-padded sequences without a cache. feature [B, T, D] at
    positions 0..T-1, token_embeds [B, T, D] of the tokens at 1..T, lengths [B] -> predicted
    features [B, T, D]."""
    _, valid, cos, sin = _dense_positions(config, jnp.zeros(feature.shape[:2], jnp.int32), lengths)
    return _apply(config, draft, None, feature, token_embeds, cos, sin, valid)


def unrolled_forward(config: LlamaConfig, draft, feature, token_embeds, lengths, passes: int):
    """Training: `passes` drafts in a row from every position, attending as decoding does (EAGLE-3's
    training-time test). feature [B, T, D] at 0..T-1, token_embeds [B, T, D] of the tokens at
    1..T, lengths [B] -> predicted features [passes, B, T, D].

    Pass k at p is the (k+1)-th draft of a round whose first draft is pass 0 at p-k. Its input is
    pass k-1's output at p-1 (pass 0's: the model's feature at p) with the token at p+1; it
    attends to pass 0's keys at positions <= p-k (the cached draft K/V, which decoding always
    computes from the model's features) and to pass j's key at p-k+j for j = 1..k (the round's own
    earlier drafts), never to keys computed from its guesses at other positions. Pass 0 is
    `dense_forward`. Pass k at p < k is no draft of any round: the caller leaves it out."""
    b, t, _ = feature.shape
    if config.sliding_window is not None and t > config.sliding_window:
        raise UnsupportedModelError(
            f"unrolled draft training attends to every earlier position: sequences of {t} tokens are longer than "
            f"the model's attention window ({config.sliding_window}); train on shorter sequences"
        )
    _, valid, cos, sin = _dense_positions(config, jnp.zeros((b, t), jnp.int32), lengths)
    hkv, dh = config.num_kv_heads, config.head_dim
    g = config.num_heads // hkv
    pos = jnp.tile(jnp.arange(t), g)  # the query axis below: G*T, t-minor

    def heads(x):  # [B, T, Hkv, Dh] -> [B, Hkv, G*T, Dh], each key repeated for its G query heads
        return jnp.tile(x.transpose(0, 2, 1, 3), (1, 1, g, 1))

    def shifted(x, n):  # x at p - n, zeros where p < n
        return jnp.pad(x, ((0, 0), (n, 0), (0, 0), (0, 0)))[:, :t]

    keys, values, preds, x = [], [], [], feature
    for k in range(passes):
        h = _apply(config, draft, "inputs", x, token_embeds)
        q, key, value = _layer(config, draft, "qkv", h, cos, sin)
        keys.append(key)
        values.append(value)
        qh = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh) * dh**-0.5
        cached = jnp.einsum("bkqd,bksd->bkqs", qh, keys[0].transpose(0, 2, 1, 3), preferred_element_type=jnp.float32)
        own = [heads(shifted(keys[j], k - j)) for j in range(1, k + 1)]
        scores = jnp.concatenate([cached] + [jnp.sum(qh * kj, -1, keepdims=True) for kj in own], axis=-1)
        mask = jnp.concatenate(
            [(jnp.arange(t)[None, :] <= pos[:, None] - k)[None, None] & valid[:, None, None, :]]
            + [jnp.broadcast_to((pos >= k - j)[None, None, :, None], (b, 1, g * t, 1)) for j in range(1, k + 1)],
            axis=-1,
        )
        has_key = mask.any(-1, keepdims=True)
        probs = jax.nn.softmax(jnp.where(mask, scores, jnp.where(has_key, -jnp.inf, 0.0)), axis=-1)
        out = jnp.einsum("bkqs,bksd->bkqd", probs[..., :t], values[0].transpose(0, 2, 1, 3))
        for j in range(1, k + 1):
            out = out + probs[..., t + j - 1 : t + j] * heads(shifted(values[j], k - j))
        attn = out.reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, dh).astype(q.dtype)
        preds.append(_layer(config, draft, "out_mlp", h, attn))
        x = jnp.concatenate([feature[:, :1], preds[-1][:, :-1].astype(feature.dtype)], axis=1)
    return jnp.stack(preds)
