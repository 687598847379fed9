"""`convert(src, dst)`: HF checkpoint -> eejax checkpoint, atomically (all of it or nothing)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from conversion.llama import llama_params_from_hf
from conversion.sources import open_checkpoint
from conversion.t5 import has_lm_head, t5_params_from_hf
from eejax.checkpoint import check_destination, write_checkpoint
from eejax.config import LlamaConfig, T5Config, check_architecture
from eejax.errors import EejaxError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def convert(src, dst, *, dtype: str = "float32", overwrite: bool = False, progress: bool = True) -> Path:
    """Converts `src` (HF model directory or .gguf file) into an eejax checkpoint at `dst`.

    On any error nothing is left at `dst` (an existing `dst` is kept unless the conversion
    succeeded with `overwrite=True`).
    """
    if dtype not in DTYPES:
        raise EejaxError(f"unsupported dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    dst = check_destination(dst, overwrite)  # before any work: a bad DST is found at once
    ckpt = open_checkpoint(src)
    check_architecture(ckpt.config.get("model_type"), str(src))
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
    if t5:
        params = t5_params_from_hf(ckpt, config, DTYPES[dtype], progress=progress)
    else:
        params = llama_params_from_hf(ckpt, config, DTYPES[dtype], progress=progress)

    return write_checkpoint(dst, config, params, ckpt.tokenizer, {"source": ckpt.source}, overwrite=True)
