"""A Llama, Qwen2 or Qwen3 `.gguf` file read as an HF checkpoint, without torch: its config
(transformers' names for llama.cpp's keys), its tokenizer (transformers' GGUF tokenizer converter
over the file's vocabulary) and its tensors dequantised to float32 by gguf-py, the dequantisation
transformers' GGUF loader runs, with llama.cpp's rotary permutation of a Llama's Q and K undone as
it undoes it (llama.cpp does not permute a Qwen's). So a float32 conversion equals transformers'
reading of the file bit for bit (`tests/test_smollm2.py`, `tests/test_llama_family.py`) while
needing only `gguf` (the `gguf` extra), not torch (the `convert` extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conversion.gguf_file import read_gguf
from eejax.errors import EejaxError, UnsupportedModelError

# HF tensor name (in a layer: "model.layers.{i}." + name) -> llama.cpp's (in a block: "blk.{i}." + name)
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Qwen2's biases, Qwen3's q and k norms (present in such files only)
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# llama.cpp's architecture names that eejax reads -> HF model_type (the same words) and class
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the tokenizer's special tokens -> the GGUF keys of their ids ("tokenizer.ggml." + key)
SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a Q or K projection with
    `heads` heads: new row j is old row order[j] (transformers' `reverse_permute_weights`)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def gguf_config(metadata: dict, tensor_names) -> tuple[dict, dict]:
    """(HF config dict, generation config dict) of a Llama, Qwen2 or Qwen3 GGUF file's metadata, as
    transformers builds them (`GGUF_CONFIG_MAPPING`; tied embeddings where the file has no
    output.weight; Qwen3's head size from its key length). Rotary scaling is refused by name:
    transformers' GGUF loader would drop it."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"a {arch!r} GGUF file; eejax reads {', '.join(GGUF_ARCHITECTURES)} GGUF files")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(f"this GGUF file scales its rotary embedding ({scaling}); eejax cannot read that")
    config = {"model_type": arch, "architectures": [GGUF_ARCHITECTURES[arch]]}
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key, name in GGUF_CONFIG_MAPPING[arch].items():
        if name is not None and f"{arch}.{key}" in metadata:
            config[name] = metadata[f"{arch}.{key}"]
    if arch == "qwen3" and f"{arch}.attention.key_length" in metadata:
        config["head_dim"] = metadata[f"{arch}.attention.key_length"]
    ids = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    ids = {name: metadata[f"tokenizer.ggml.{key}"] for name, key in ids.items() if f"tokenizer.ggml.{key}" in metadata}
    config.update(ids)
    config.setdefault("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))
    return config, ids


def gguf_tokenizer(metadata: dict):
    """The tokenizer a GGUF file describes, built as transformers builds it from the file
    (`get_gguf_tokenizer` and `convert_gguf_tokenizer`), from metadata already read."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers before the gguf package held them (5.17 has them in ggml)
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers: llama.cpp adds BOS to such a vocabulary
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer)
    # The file's own special tokens win over the converter's (transformers 5.17's swaps BOS and EOS)
    return TokenizersBackend(tokenizer_object=backend, **{**extra, **tokenizer_config})


def gguf_tensor_reader(tensors: dict, config: dict):
    """(HF tensor names, read(name) -> float32 array in HF layout [out, in]) over a GGUF file's
    tensors (`gguf_file.read_gguf`); a Llama's Q and K rows unpermuted (`permutes_qk`)."""
    from gguf import dequantize

    names = dict(GLOBAL_NAMES)
    if "output.weight" in tensors:
        names["lm_head.weight"] = "output.weight"
    for i in range(int(config["num_hidden_layers"])):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in LAYER_NAMES.items()})
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config.get("num_key_value_heads")}
    if not permutes_qk(config["model_type"]):
        heads = {}

    def read(name: str) -> np.ndarray:
        t = tensors.get(names.get(name, ""))
        if t is None:
            raise EejaxError(f"the GGUF file lacks the tensor {names.get(name, name)!r} ({name})")
        values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        values = values.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGML's dims run fastest first
        kind = names[name].split(".", 2)[-1]  # a layer's "attn_q.weight", ...
        if names[name].startswith("blk.") and kind in heads:
            values = values[unpermuted_rows(values.shape[0], int(heads[kind] or config["num_attention_heads"]))]
        return values

    return [name for name, gg in names.items() if gg in tensors], read


def permutes_qk(model_type: str) -> bool:
    """Whether llama.cpp's converter permuted the rows of Q and K (a Llama's: its rotary takes
    adjacent pairs; a Qwen's rotates halves as HF does, unpermuted)."""
    return model_type == "llama"


def open_gguf_file(src: Path) -> tuple[dict, dict]:
    """`gguf_file.read_gguf(src)`, its errors named as EejaxErrors."""
    try:
        import gguf  # noqa: F401  (its type tables and dequantisation)
    except ImportError:
        raise EejaxError("reading a .gguf file needs the gguf package: pip install 'eejax[gguf]'") from None
    try:
        return read_gguf(src)
    except (ValueError, OSError) as e:
        raise EejaxError(f"cannot read {src}: {e}") from None


def open_gguf(metadata: dict, tensors: dict):
    """(HF config, generation config, tensor names, read(name), tokenizer) of a Llama, Qwen2 or
    Qwen3 GGUF file's metadata and tensors (`open_gguf_file`)."""
    config, generation_config = gguf_config(metadata, set(tensors))
    names, read = gguf_tensor_reader(tensors, config)
    return config, generation_config, names, read, gguf_tokenizer(metadata)
