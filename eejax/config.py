"""Model configurations: frozen dataclasses built from HuggingFace `config.json` dicts."""

from __future__ import annotations

import dataclasses
from typing import Any

from eejax.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_architecture(model_type, where: str = "") -> None:
    """Raises UnsupportedModelError naming the supported architectures."""
    if model_type not in SUPPORTED_ARCHITECTURES:
        place = f" in {where}" if where else ""
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}{place}; eejax supports: " + ", ".join(SUPPORTED_ARCHITECTURES)
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
    """A decoder-only Llama-family model (Llama 2/3.x, SmolLM2, TinyLlama, LayerSkip Llamas)."""

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
    architecture: str = "llama"

    def __post_init__(self):
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
        """Builds the config from an HF `config.json` dict (transformers 4.x or 5.x spelling)."""
        check_architecture(hf.get("model_type"))
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise UnsupportedModelError(f"unsupported Llama variant: {flag}=true")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported Llama activation {act!r}; eejax supports: silu")
        # transformers 5 moved rope_theta / rope_scaling into one `rope_parameters` dict.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r}; eejax supports: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        scaling = None
        if rope_type != "default":
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", 8192)
                ),
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


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)
