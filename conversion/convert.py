"""`convert(src, dst)`: HF checkpoint -> eejax checkpoint, atomically (all of it or nothing)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from conversion.gguf_blocks import llama_params_from_gguf
from conversion.llama import llama_params_from_hf, quantize_int8_params
from conversion.sources import open_checkpoint
from conversion.t5 import has_lm_head, t5_params_from_hf
from eejax.checkpoint import check_destination, write_checkpoint
from eejax.config import LlamaConfig, T5Config, check_model_type
from eejax.errors import EejaxError, UnsupportedModelError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
QUANTIZATIONS = (None, "gguf", "int8")


def convert(
    src,
    dst,
    *,
    dtype: str = "float32",
    quantization: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Converts `src` (HF model directory or .gguf file) into an eejax checkpoint at `dst`.

    `quantization` (Llama): None keeps float weights (a GGUF's blocks dequantised), "gguf" keeps a
    .gguf file's own blocks (Q4_0, Q4_1, Q8_0; `conversion.gguf_blocks`), "int8" stores every
    matrix as int8 per output channel (`eejax.quantized.quantize_int8`); norms stay `dtype`.
    On any error nothing is left at `dst` (an existing `dst` is kept unless the conversion
    succeeded with `overwrite=True`).
    """
    if dtype not in DTYPES:
        raise EejaxError(f"unsupported dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise EejaxError(f"unknown quantization {quantization!r}; choose from gguf, int8 (or none)")
    if quantization == "gguf" and Path(src).suffix != ".gguf":
        raise EejaxError(f"quantization 'gguf' keeps a .gguf file's blocks; {src} is not a .gguf file (try int8)")
    dst = check_destination(dst, overwrite)  # before any work: a bad DST is found at once
    ckpt = open_checkpoint(src)
    check_model_type(ckpt.config.get("model_type"), str(src))
    t5 = ckpt.config["model_type"] == "t5"
    try:
        if t5:
            config = T5Config.from_hf(ckpt.config, ckpt.generation_config, has_lm_head=has_lm_head(ckpt))
        else:
            config = LlamaConfig.from_hf(ckpt.config, ckpt.generation_config)
    except (KeyError, TypeError, ValueError) as e:
        raise EejaxError(
            f"{src}: config.json is not a valid {ckpt.config['model_type']} config ({type(e).__name__}: {e})"
        ) from None
    if t5 and quantization:
        raise UnsupportedModelError("quantized weights are supported for Llama models only (not T5 yet)")
    if t5:
        params = t5_params_from_hf(ckpt, config, DTYPES[dtype], progress=progress)
    elif quantization == "gguf":
        params = llama_params_from_gguf(src, config, progress=progress)
        params = {k: v.astype(DTYPES[dtype]) if isinstance(v, np.ndarray) else v for k, v in params.items()}
        params["layers"] = {
            k: v.astype(DTYPES[dtype]) if isinstance(v, np.ndarray) else v for k, v in params["layers"].items()
        }
    else:
        params = llama_params_from_hf(ckpt, config, DTYPES[dtype], progress=progress)
        if quantization == "int8":
            params = quantize_int8_params(params)

    return write_checkpoint(dst, config, params, ckpt.tokenizer, {"source": ckpt.source}, overwrite=True)
