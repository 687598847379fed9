"""HF Llama tensor names -> eejax's stacked Llama params (weights transposed to [in, out])."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from eejax.config import LlamaConfig
from eejax.errors import EejaxError

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


def llama_params_from_hf(ckpt, config: LlamaConfig, dtype, progress: bool = True) -> dict:
    """Reads every tensor once and stacks the per-layer ones on a leading [num_layers] axis."""
    names = set(ckpt.names)

    def read(name: str) -> np.ndarray:
        if name not in names:
            raise EejaxError(f"checkpoint {ckpt.source} lacks the tensor {name!r}")
        return ckpt.read(name)

    layers = {}
    bar = tqdm(total=len(HF_LAYER_NAMES) * config.num_layers + 3, desc="converting", unit="tensor",
               disable=not progress)
    for key, hf_name in HF_LAYER_NAMES.items():
        stacked = None
        for i in range(config.num_layers):
            w = read(f"model.layers.{i}.{hf_name}")
            w = w.T if w.ndim == 2 else w
            if stacked is None:
                stacked = np.empty((config.num_layers, *w.shape), dtype)
            stacked[i] = w
            bar.update()
        layers[key] = stacked
    params = {"embed": read("model.embed_tokens.weight").astype(dtype), "layers": layers}
    bar.update()
    params["final_norm"] = read("model.norm.weight").astype(dtype)
    bar.update()
    if not config.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(read("lm_head.weight").T).astype(dtype)
    bar.update()
    bar.close()
    return params
