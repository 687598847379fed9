"""Model configurations: frozen dataclasses built from HF `config.json` dicts (decoding options
are in `eejax.options`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from eejax.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "t5")  # eejax's model modules (`models.registry`)
# HF `model_type`s that convert, and the eejax architecture each becomes: Qwen2/2.5 (q/k/v biases),
# Qwen3 (RMSNorm on q and k) and Mistral (a sliding attention window) are Llamas with a setting.
MODEL_TYPES = {"llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama", "t5": "t5"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_architecture(architecture, where: str = "") -> None:
    """Raises UnsupportedModelError unless `architecture` is one of eejax's (a checkpoint's)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        place = f" in {where}" if where else ""
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}{place}; eejax supports: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )


def check_model_type(model_type, where: str = "") -> None:
    """Raises UnsupportedModelError naming the HF model types that convert."""
    if model_type not in MODEL_TYPES:
        place = f" in {where}" if where else ""
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}{place}; eejax converts: " + ", ".join(MODEL_TYPES)
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: `linear` (positions / factor) or Llama 3.x's `llama3`."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A decoder-only Llama-family model: Llama 2/3.x, SmolLM2, TinyLlama, LayerSkip Llamas, and
    the HF `model_type`s that differ from Llama by a setting (`model_type` keeps which):
    Qwen2/2.5 (`qkv_bias`), Qwen3 (`qk_norm`, RMSNorm over each head of q and k before the
    rotation) and Mistral (`sliding_window`: a query sees its last W positions, itself included)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    architecture: str = "llama"

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(
                f"sliding_window must be a positive number of positions, got {self.sliding_window}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA); 1 is plain multi-head attention."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None):
        """Builds the config from an HF `config.json` dict (transformers 4.x or 5.x spelling) of a
        Llama, Qwen2, Qwen3 or Mistral."""
        model_type = hf.get("model_type")
        check_model_type(model_type)
        if MODEL_TYPES[model_type] != "llama":
            raise UnsupportedModelError(f"{model_type!r} is not a Llama-family config")
        # Qwen2's q/k/v always carry biases (its o does not); Qwen3's carry them with
        # attention_bias, which there would bias o too; Llama's attention_bias biases o too.
        unsupported = ["mlp_bias"] + ([] if model_type == "qwen2" else ["attention_bias"])
        for flag in unsupported:
            if hf.get(flag):
                raise UnsupportedModelError(f"unsupported {model_type} variant: {flag}=true")
        window = _sliding_window(hf, model_type)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported Llama activation {act!r}; eejax supports: silu")
        # transformers 5 moved rope_theta / rope_scaling into one `rope_parameters` dict.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r}; eejax supports: " + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        scaling = None
        if rope_type != "default":
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = _as_tuple(hf.get("eos_token_id"))
        if generation_config:
            eos = tuple(dict.fromkeys(eos + _as_tuple(generation_config.get("eos_token_id"))))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=hf.get("pad_token_id"),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            model_type=model_type,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class T5Config:
    """An encoder-decoder T5: v1.0 (ReLU, tied head with d_model^-0.5 output scaling), v1.1 and
    Flan-T5 (gated-GELU, untied head), CALM-style early-exit T5s. `num_layers` counts the
    decoder layers (the ones that decode steps run and may exit from)."""

    vocab_size: int
    hidden_size: int  # d_model
    intermediate_size: int  # d_ff
    num_layers: int  # decoder layers
    num_encoder_layers: int
    num_heads: int
    head_dim: int  # d_kv
    num_buckets: int = 32
    max_distance: int = 128
    layer_norm_eps: float = 1e-6
    gated: bool = False  # gated-{act}: act(x W_0) * (x W_1)
    activation: str = "relu"  # "relu" or "gelu_new"
    scale_decoder_outputs: bool = True  # multiply by d_model^-0.5 before the head (T5 v1.0)
    tie_embeddings: bool = True  # the head is the shared embedding (no lm_head tensor)
    decoder_start_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = 0
    max_position_embeddings: int = 1 << 16  # relative positions: no learned limit
    architecture: str = "t5"

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None, *, has_lm_head: bool = False
    ) -> T5Config:
        """From an HF T5 `config.json` dict; `has_lm_head`: the checkpoint holds its own
        `lm_head.weight` (T5 v1.1 / Flan-T5 saved by transformers 4)."""
        check_model_type(hf.get("model_type"))
        if hf.get("model_type") != "t5":
            raise UnsupportedModelError(f"{hf.get('model_type')!r} is not a T5 config")
        proj = hf.get("feed_forward_proj", "relu")
        parts = proj.split("-")
        gated = parts[0] == "gated" and len(parts) == 2
        act = parts[-1]
        if len(parts) > 2 or (len(parts) == 2 and not gated) or act not in ("relu", "gelu", "gelu_new"):
            raise UnsupportedModelError(
                f"unsupported T5 feed_forward_proj {proj!r}; eejax supports: relu, gated-gelu, gelu_new, gated-relu"
            )
        act = "gelu_new" if act == "gelu" and gated else act  # HF maps gated-gelu to gelu_new
        if act == "gelu":
            raise UnsupportedModelError("unsupported T5 activation 'gelu' (exact); eejax supports relu, gelu_new")
        # HF: T5 v1.0 scales the decoder output, v1.1 (saved with tie_word_embeddings=false) does not.
        scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
        eos = _as_tuple(hf.get("eos_token_id", 1))
        if generation_config:
            eos = tuple(dict.fromkeys(eos + _as_tuple(generation_config.get("eos_token_id"))))
        start = hf.get("decoder_start_token_id")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["d_model"]),
            intermediate_size=int(hf["d_ff"]),
            num_layers=int(hf.get("num_decoder_layers") or hf["num_layers"]),
            num_encoder_layers=int(hf["num_layers"]),
            num_heads=int(hf["num_heads"]),
            head_dim=int(hf["d_kv"]),
            num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
            max_distance=int(hf.get("relative_attention_max_distance", 128)),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
            gated=gated,
            activation=act,
            scale_decoder_outputs=bool(scale),
            tie_embeddings=not has_lm_head,
            decoder_start_token_id=int(start if start is not None else hf.get("pad_token_id") or 0),
            eos_token_ids=eos,
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> T5Config:
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ()))})


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    """The attention window every layer uses (None: full attention), from a Llama-family
    config.json. Mistral's `sliding_window` applies to every layer; Qwen2's and Qwen3's only with
    `use_sliding_window`, and then to layers from `max_window_layers` on (`layer_types` spells
    it per layer). A window on some layers only is refused by name."""
    if model_type == "llama":
        return None
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 0) or 0) if model_type != "mistral" else 0
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    if len(set(types)) > 1:
        raise UnsupportedModelError(
            f"unsupported {model_type} variant: a sliding attention window on some layers only "
            "(layer_types / max_window_layers); eejax supports a window on every layer or none"
        )
    if types and types[0] == "sliding_attention":
        if window is None:
            raise UnsupportedModelError(f"{model_type} config: sliding_attention layers without a sliding_window")
        return int(window)
    return None


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)
