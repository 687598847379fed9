"""HF T5 tensor names -> eejax's stacked T5 params (weights transposed to [in, out])."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from conversion.sources import stack_layers, tensor_reader
from eejax.config import T5Config

# eejax layer key -> HF name inside `{encoder,decoder}.block.{i}.`; linear weights are transposed.
ENCODER_NAMES = {
    "attn_norm": "layer.0.layer_norm.weight",
    "wq": "layer.0.SelfAttention.q.weight",
    "wk": "layer.0.SelfAttention.k.weight",
    "wv": "layer.0.SelfAttention.v.weight",
    "wo": "layer.0.SelfAttention.o.weight",
    "mlp_norm": "layer.1.layer_norm.weight",
}
CROSS_NAMES = {
    "cross_norm": "layer.1.layer_norm.weight",
    "cq": "layer.1.EncDecAttention.q.weight",
    "ck": "layer.1.EncDecAttention.k.weight",
    "cv": "layer.1.EncDecAttention.v.weight",
    "co": "layer.1.EncDecAttention.o.weight",
}
FF_NAMES = {"wi": "wi.weight", "wi_0": "wi_0.weight", "wi_1": "wi_1.weight", "wo_ff": "wo.weight"}
BIAS_NAME = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def has_lm_head(ckpt) -> bool:
    """Whether the checkpoint has its own head (T5 v1.1 / Flan-T5 saved by transformers 4);
    transformers 5 always ties it to the shared embedding and saves none."""
    return "lm_head.weight" in set(ckpt.names)


def stack_names(config: T5Config, part: str) -> dict[str, str]:
    """eejax key -> HF name (relative to the block) for the encoder or decoder stack."""
    ff_block = 1 if part == "encoder" else 2
    names = dict(ENCODER_NAMES)
    if part == "decoder":
        names["mlp_norm"] = "layer.2.layer_norm.weight"
        names.update(CROSS_NAMES)
    for key in (("wi_0", "wi_1") if config.gated else ("wi",)) + ("wo_ff",):
        names[key] = f"layer.{ff_block}.DenseReluDense.{FF_NAMES[key]}"
    return names


def t5_params_from_hf(ckpt, config: T5Config, dtype, progress: bool = True) -> dict:
    """Reads every tensor once and stacks each stack's per-layer tensors on a leading axis."""
    read = tensor_reader(ckpt)
    stacks = {"encoder": config.num_encoder_layers, "decoder": config.num_layers}
    total = sum(len(stack_names(config, part)) * n + 2 for part, n in stacks.items()) + 2
    bar = tqdm(total=total, desc="converting", unit="tensor", disable=not progress)
    params = {"embed": read("shared.weight").astype(dtype)}
    bar.update()
    for part, num_layers in stacks.items():
        layers = {
            key: stack_layers(read, lambda i, n=hf_name, part=part: f"{part}.block.{i}.{n}", num_layers, dtype, bar)
            for key, hf_name in stack_names(config, part).items()
        }
        params[part] = {
            "layers": layers,
            "rel_bias": read(f"{part}.{BIAS_NAME}").astype(dtype),
            "final_norm": read(f"{part}.final_layer_norm.weight").astype(dtype),
        }
        bar.update(2)
    if not config.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(read("lm_head.weight").T).astype(dtype)
    bar.update()
    bar.close()
    return params
