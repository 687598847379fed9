"""The jitted steps of generation: prefill and one decode token (full depth or early exit).

Both are pure functions of (params, cache, ...) returning the updated cache; the caller donates
the cache so it is updated in place. `DecodeState` holds everything the token loop carries on
device, so the host only checks `done` now and then.

One implementation serves every architecture: `model_module(config)` gives the model's pure
functions (`token_batch`, `embed`, `decoder_layer`, `run_layers`, `lm_head`, `kv_all_layers`):
a decoder-only Llama, or the decoder of an encoder-decoder T5 whose per-row cross-attention
K/V ride in `DecodeState.context`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from eejax.cache import KVCache
from eejax.config import ExitConfig, T5Config
from eejax.decode.confidence import exit_threshold
from eejax.decode.early_exit import ExitFns, early_exit_layers
from eejax.decode.sampling import SamplingParams, sample
from eejax.models import exits, llama, t5


def model_module(config):
    """The pure-functional model module of a config: `llama` or `t5`."""
    return t5 if isinstance(config, T5Config) else llama


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-row generation state, all on device.

    last_token [B] int32: the newest token, not yet in the cache
    seq_len [B] int32:    tokens already in the cache
    num_generated [B]:    tokens produced so far (EOS included)
    done [B] bool:        row finished (EOS, max_new_tokens, or padding row)
    tokens [B, N] int32:  generated ids
    exit_layers [B, N]:   layers run for each token (the batch's exit layer)
    confident_layers [B, N]: the row's first confident layer (the exit layer if none)
    key:                  PRNG key, split every step for sampling
    context:              per-row model state besides the KV cache (T5: `t5.CrossKV`; Llama: None)
    """

    last_token: jax.Array
    seq_len: jax.Array
    num_generated: jax.Array
    done: jax.Array
    tokens: jax.Array
    exit_layers: jax.Array
    confident_layers: jax.Array
    key: jax.Array
    context: Any = None


def is_eos(tokens, eos_ids: tuple[int, ...]):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def prefill(params, cache: KVCache, tokens, lengths, block_table, key, *, config,
            sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...], attention: str = "auto"):
    """Runs all layers over right-padded prompts and samples the first new token.

    tokens [B, T] int32, lengths [B] int32 (0 = padding row), block_table [B, M] int32.
    Returns (DecodeState, cache). A T5 encodes the prompts and decodes its first token.
    """
    if isinstance(config, T5Config):
        return _prefill_encoder_decoder(params, cache, tokens, lengths, block_table, key, config=config,
                                        sampling=sampling, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                        attention=attention)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    batch = llama.token_batch(config, positions, valid, block_table, lengths, cache.page_size, attention)
    h, cache = llama.run_layers(params, llama.embed(params, tokens), cache, batch, config)
    last = h[jnp.arange(b), jnp.maximum(lengths - 1, 0)]
    logits = llama.lm_head(params, last, config)
    key, step_key = jax.random.split(key)
    first = sample(logits, step_key, sampling)
    padding = lengths == 0
    first = jnp.where(padding, 0, first)
    done = padding | is_eos(first, eos_ids) | (max_new_tokens <= 1)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    exit_layers = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(config.num_layers)
    state = DecodeState(
        last_token=first,
        seq_len=lengths,
        num_generated=jnp.where(padding, 0, 1).astype(jnp.int32),
        done=done,
        tokens=out,
        exit_layers=exit_layers,
        confident_layers=exit_layers,
        key=key,
    )
    return state, cache


def _prefill_encoder_decoder(params, cache: KVCache, tokens, lengths, block_table, key, *, config: T5Config,
                             sampling, max_new_tokens, eos_ids, attention):
    """T5: the encoder over the prompts, every decoder layer's cross K/V, then one full-depth
    decode step from the decoder start token (position 0)."""
    enc = t5.encode(params, tokens, lengths, config)
    b = tokens.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    record = jnp.zeros((b, max_new_tokens), jnp.int32)
    state = DecodeState(
        last_token=jnp.full((b,), config.decoder_start_token_id, jnp.int32),
        seq_len=zeros,
        num_generated=zeros,
        done=lengths == 0,
        tokens=record,
        exit_layers=record,
        confident_layers=record,
        key=key,
        context=t5.cross_kv(params, enc, lengths, config),
    )
    return decode(params, cache, state, block_table, config=config, sampling=sampling,
                  max_new_tokens=max_new_tokens, eos_ids=eos_ids, attention=attention)


def exit_logits(params, x, layers_run, config):
    """The exit head after `layers_run` layers (adapter, if any, then the shared final norm and
    LM head): x [B, D] -> float32 logits [B, V]. At full depth it is the model's own head."""
    exit_params = params.get("exits")
    if exits.has_adapters(exit_params):
        adapted = exits.adapt(exit_params, x, jnp.maximum(layers_run - 1, 0))
        x = jnp.where(layers_run < config.num_layers, adapted, x)
    return model_module(config).lm_head(params, x, config)


def exit_fns(params, batch, config) -> ExitFns:
    """The early-exit loop's view of a model: layers, exit head (+ adapters), classifier, KV."""
    exit_params = params.get("exits")
    m = model_module(config)

    def run_layer(layer, h, cache):
        return m.decoder_layer(params, h, cache, layer, batch, config)

    def exit_prob(h, layers_run):
        return exits.classifier_prob(exit_params, h[:, -1], layers_run - 1)

    return ExitFns(
        run_layer=run_layer,
        exit_logits=lambda h, layers_run: exit_logits(params, h[:, -1], layers_run, config),
        exit_prob=exit_prob if exits.has_classifier(exit_params) else None,
        kv_all_layers=lambda h: m.kv_all_layers(params, h, batch, config),
    )


def decode(params, cache: KVCache, state: DecodeState, block_table, *, config,
           sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...],
           exit_config: ExitConfig | None = None, attention: str = "auto"):
    """One decode token for every row that is not done. Returns (state, cache).

    Full depth when `exit_config` is None; otherwise the early-exit loop decides how many
    layers run and fills the KV of the rest. `attention` picks the attention implementation.
    """
    m = model_module(config)
    active = ~state.done
    positions = state.seq_len[:, None]
    kv_len = state.seq_len + active
    batch = m.token_batch(config, positions, active[:, None], block_table, kv_len, cache.page_size, attention,
                          context=state.context)
    h = m.embed(params, state.last_token[:, None])
    if exit_config is None:
        h, cache = m.run_layers(params, h, cache, batch, config)
        logits = m.lm_head(params, h[:, 0], config)
        exit_layer = confident = jnp.full(active.shape, config.num_layers, jnp.int32)
    else:
        threshold = exit_threshold(exit_config, state.num_generated, max_new_tokens)
        out = early_exit_layers(
            exit_fns(params, batch, config), h, cache, active, threshold, batch.pages, batch.slots,
            config=exit_config, num_layers=config.num_layers, vocab_size=config.vocab_size,
        )
        logits, cache, confident = out.logits, out.cache, out.confident_layer
        exit_layer = jnp.full(active.shape, out.exit_layer, jnp.int32)
    key, step_key = jax.random.split(state.key)
    token = jnp.where(active, sample(logits, step_key, sampling), state.last_token)
    idx = jnp.minimum(state.num_generated, max_new_tokens - 1)
    rows = jnp.arange(token.shape[0])

    def record(buffer, values):
        return buffer.at[rows, idx].set(jnp.where(active, values, buffer[rows, idx]))

    num_generated = state.num_generated + active
    done = state.done | (active & is_eos(token, eos_ids)) | (num_generated >= max_new_tokens)
    return dataclasses.replace(
        state,
        last_token=token,
        seq_len=kv_len,
        num_generated=num_generated,
        done=done,
        tokens=record(state.tokens, token),
        exit_layers=record(state.exit_layers, exit_layer),
        confident_layers=record(state.confident_layers, confident),
        key=key,
    ), cache
