"""The model interface: every architecture is a module of plain functions over stacked params that
apply its Flax modules to them (one layer's slice at a time), found by the config's
`architecture` name. Nothing outside `eejax.models` asks which one it is;
it asks the module (`model_module(config)`) and, where an encoder-decoder differs, its flags.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

from eejax.errors import UnsupportedModelError
from eejax.models import llama, t5


class ModelModule(Protocol):
    """What an architecture's module provides (shapes: B rows, T tokens each, D hidden, V vocabulary).

    ENCODER_DECODER: the prompt goes to an encoder (`encode_context`) and the paged cache holds
        decoder tokens only; otherwise the prompt is decoded into the cache.
    DECODE_ONLY_SKIPS: names of decoder-layer weights a decode step never reads (cost model).
    SPLITS_LAYERS: whether `with_layer_buffers` puts each layer's weights in their own buffers.
    init_params(config, key, dtype, scale) -> params in the eejax layout (the Flax model's `init`).
    logical_axes(config) -> the logical axis names of init_params' arrays (PartitionSpecs, same tree).
    token_batch(config, positions, valid, block_table, kv_len, page_size, attention, ...) -> the
        per-step positions, cache slots and rotary tables (a pytree), built once per step.
    embed(params, tokens [B, T]) -> h [B, T, D].
    decoder_layer(params, h, cache, layer, batch, config) -> (h, cache): one layer at a traced index.
    run_layers(params, h, cache, batch, config, start, stop, length) -> (h, cache): a range of them.
    kv_of_layer(params, h, layer, batch, config) -> (k, v) [B, T, Hkv, Dh]: K/V projection (KV fill).
    kv_of_layers(params, h, start, stop, batch, config) -> (k, v) [stop - start, B, T, Hkv, Dh]:
        the same for a static range of layers at once (a GPU's KV fill: one batched product).
    lm_head(params, h [..., D], config, weight=None, triton=False) -> float32 logits [..., V]; `triton`:
        the final norm and the head as one fused Triton kernel where the architecture has it.
    decoder_layers(params) -> {name: [L, ...]}: the stacked decoder-layer weights.
    with_layer_buffers(params) -> params whose decoder-layer weights each sit in their own
        buffer where the architecture supports it (`eejax.models.stack`; what a CPU reads fastest).
    with_linear_rows(params) -> params whose decoder-layer Linear weights are held as their rows
        (`kernels.cpu_matmul.RowsMatrix`) where the architecture supports it (what XLA:GPU fuses).
    forward_states(params, tokens, lengths, config, skip, context) -> (states [L, B, T, D], layers
        run): the forward without a cache that training uses; an encoder-decoder's decoder
        attends to context = (prompts [B, S], prompt lengths [B]), which decoder-only models refuse.
    quantize_weights(params, quantize) -> params with the matrices a decode step multiplies by
        replaced by quantize(w, transposed) (`kernels.quantized`); architectures without it
        cannot be quantized (T5 today).
    encode_context(params, tokens, lengths, config) -> per-row context (encoder-decoders only).
    empty_context(config, rows, length, dtype) -> zero context for rows of prompts up to `length`
        tokens (encoder-decoders only: the serving engine's decode slots).
    """

    ENCODER_DECODER: bool
    DECODE_ONLY_SKIPS: tuple[str, ...]
    SPLITS_LAYERS: bool

    def init_params(self, config, key, dtype: Any = ..., scale: float = ...) -> dict: ...
    def logical_axes(self, config) -> dict: ...
    def token_batch(self, config, positions, valid, block_table, kv_len, page_size, attention: str = ...): ...
    def embed(self, params, tokens): ...
    def decoder_layer(self, params, h, cache, layer, batch, config): ...
    def run_layers(self, params, h, cache, batch, config, start=..., stop=..., length=...): ...
    def kv_of_layer(self, params, h, layer, batch, config): ...
    def kv_of_layers(self, params, h, start, stop, batch, config): ...
    def lm_head(self, params, h, config, weight=..., triton: bool = ...): ...
    def decoder_layers(self, params) -> dict: ...
    def with_layer_buffers(self, params) -> dict: ...
    def with_linear_rows(self, params) -> dict: ...
    def forward_states(self, params, tokens, lengths, config, skip=..., context=...): ...


ARCHITECTURES: dict[str, ModuleType] = {"llama": llama, "t5": t5}


def model_module(config) -> ModelModule:
    """The module of pure functions for `config.architecture`."""
    try:
        return ARCHITECTURES[config.architecture]  # type: ignore[return-value]
    except (AttributeError, KeyError):
        name = getattr(config, "architecture", type(config).__name__)
        raise UnsupportedModelError(
            f"no model module for architecture {name!r}; eejax has: " + ", ".join(ARCHITECTURES)
        ) from None
