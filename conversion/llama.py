"""HF Llama tensor names -> eejax's stacked Llama params (weights transposed to [in, out])."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from conversion.sources import stack_layers, tensor_reader
from eejax.config import LlamaConfig
from eejax.quantized import quantize_int8

# eejax layer key -> HF name inside `model.layers.{i}.`; linear weights are transposed.
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


# What the Llama family adds (`LlamaConfig`): Qwen2's q/k/v biases, Qwen3's q and k norms.
HF_BIAS_NAMES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
HF_QK_NORM_NAMES = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


def layer_names(config: LlamaConfig) -> dict[str, str]:
    """eejax layer key -> HF name inside `model.layers.{i}.` for this config's layers."""
    return {
        **HF_LAYER_NAMES,
        **(HF_BIAS_NAMES if config.qkv_bias else {}),
        **(HF_QK_NORM_NAMES if config.qk_norm else {}),
    }


def llama_params_from_hf(ckpt, config: LlamaConfig, dtype, progress: bool = True) -> dict:
    """Reads every tensor once and stacks the per-layer ones on a leading [num_layers] axis."""
    read = tensor_reader(ckpt)
    names = layer_names(config)
    bar = tqdm(total=len(names) * config.num_layers + 3, desc="converting", unit="tensor", disable=not progress)
    layers = {
        key: stack_layers(read, lambda i, n=hf_name: f"model.layers.{i}.{n}", config.num_layers, dtype, bar)
        for key, hf_name in names.items()
    }
    params = {"embed": read("model.embed_tokens.weight").astype(dtype), "layers": layers}
    bar.update()
    params["final_norm"] = read("model.norm.weight").astype(dtype)
    bar.update()
    if not config.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(read("lm_head.weight").T).astype(dtype)
    bar.update()
    bar.close()
    return params


def quantize_int8_params(params: dict) -> dict:
    """params with every matrix as int8 per output channel: the layers' projections (HF's
    `*_proj`) and an untied head (outputs are their columns), and the embedding (rows are tokens)."""
    linear = [key for key, hf_name in HF_LAYER_NAMES.items() if "_proj." in hf_name]
    layers = {**params["layers"], **{k: quantize_int8(params["layers"][k], transposed=True) for k in linear}}
    out = {**params, "layers": layers, "embed": quantize_int8(params["embed"], transposed=False)}
    if "lm_head" in params:
        out["lm_head"] = quantize_int8(params["lm_head"], transposed=True)
    return out
