"""A GGUF file's own blocks -> eejax's Llama-family params with quantized matrices
(`QuantizedMatrix`), never a float copy of a quantized tensor; a Qwen2's biases and a Qwen3's
q and k norms as float32.

The weight names are llama.cpp's (`blk.{i}.attn_q.weight`, ...). A GGUF tensor of ne = [cols,
rows] holds `rows` rows of `cols` values in blocks along the row: an output row of a Linear, a token
of the embedding. llama.cpp's converter permutes the rows of attn_q and attn_k (its rotary pairs
adjacent values) for a Llama, not a Qwen; transformers' GGUF loader undoes it, and so does this,
by moving whole rows (a row's blocks move with it, unchanged). Float tensors (norms) are read as
float32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from conversion.gguf_source import open_gguf_file, permutes_qk, unpermuted_rows
from eejax.config import LlamaConfig
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.quantized import QuantizedMatrix, from_ggml_blocks

# eejax layer key -> llama.cpp's name inside `blk.{i}.`
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
GGUF_BIAS_NAMES = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}  # Qwen2's
GGUF_QK_NORM_NAMES = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}  # Qwen3's
BLOCK_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGML type name -> eejax's format


def llama_params_from_gguf(path: str | Path, config: LlamaConfig, progress: bool = True) -> dict:
    """Llama params from the GGUF at `path`: its Q4_0 / Q4_1 / Q8_0 matrices as their blocks
    (a Linear's transposed: rows are outputs), its F32 / F16 tensors as float32. Another quantized
    type (a K-quant) is refused by name."""
    _, tensors = open_gguf_file(path)

    def read(name: str, transposed: bool = True, heads: int | None = None):
        if name not in tensors:
            raise EejaxError(f"{path} lacks the tensor {name!r}")
        t = tensors[name]
        kind = t.tensor_type.name
        cols, rows = (int(n) for n in (*t.shape, 1)[:2])
        if kind in ("F32", "F16"):
            values = np.asarray(t.data, np.float32).reshape(rows, cols) if rows > 1 else np.asarray(t.data, np.float32)
            if heads is not None:
                values = values[unpermuted_rows(rows, heads)]
            return np.ascontiguousarray(values.T) if transposed and values.ndim == 2 else values
        if kind not in BLOCK_FORMATS:
            raise UnsupportedModelError(
                f"{path}: tensor {name} is {kind}; eejax keeps the blocks of {', '.join(BLOCK_FORMATS)} "
                "(convert without quantization='gguf' to dequantise it)"
            )
        w = from_ggml_blocks(t.data, BLOCK_FORMATS[kind], rows, cols, transposed)
        if heads is not None:
            order = unpermuted_rows(rows, heads)
            w = dataclasses.replace(
                w, **{k: None if a is None else np.ascontiguousarray(a[order]) for k, a in _arrays(w).items()}
            )
        return w

    names = {
        **GGUF_LAYER_NAMES,
        **(GGUF_BIAS_NAMES if config.qkv_bias else {}),
        **(GGUF_QK_NORM_NAMES if config.qk_norm else {}),
    }
    bar = tqdm(total=len(names) * config.num_layers + 3, desc="reading blocks", unit="tensor", disable=not progress)
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads} if permutes_qk(config.model_type) else {}
    layers = {}
    for key, name in names.items():
        per_layer = []
        for i in range(config.num_layers):
            per_layer.append(read(f"blk.{i}.{name}", heads=heads.get(key)))
            bar.update()
        layers[key] = _stack(per_layer)
    params = {"embed": read("token_embd.weight", transposed=False), "layers": layers}
    bar.update()
    params["final_norm"] = read("output_norm.weight")
    bar.update()
    if not config.tie_embeddings:
        params["lm_head"] = read("output.weight")
    bar.update()
    bar.close()
    return params


def _arrays(w: QuantizedMatrix) -> dict:
    return {"qs": w.qs, "scales": w.scales, "mins": w.mins}


def _stack(per_layer: list):
    """One weight of every layer stacked on a leading axis (quantized: each of its arrays)."""
    if not isinstance(per_layer[0], QuantizedMatrix):
        return np.stack(per_layer)
    formats = {w.format for w in per_layer}
    if len(formats) > 1:
        raise UnsupportedModelError(f"the layers of one weight use several block formats ({sorted(formats)})")
    stacked = {
        k: None if a is None else np.stack([_arrays(w)[k] for w in per_layer]) for k, a in _arrays(per_layer[0]).items()
    }
    return dataclasses.replace(per_layer[0], **stacked)
