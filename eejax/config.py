"""Configurations: models (frozen dataclasses built from HF `config.json` dicts) and early exit."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from eejax.errors import EejaxError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "t5")
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
        if hf.get("model_type") != "llama":
            raise UnsupportedModelError(f"{hf.get('model_type')!r} is not a Llama config")
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
    def from_hf(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None, *,
                has_lm_head: bool = False) -> T5Config:
        """From an HF T5 `config.json` dict; `has_lm_head`: the checkpoint holds its own
        `lm_head.weight` (T5 v1.1 / Flan-T5 saved by transformers 4)."""
        check_architecture(hf.get("model_type"))
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


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)


EXIT_MEASURES = ("none", "static", "softmax", "state", "classifier")


@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """When a decode step may stop early (the batch exits when every row is confident).

    measure:    "none" (full depth through the early-exit loop), "static" (always exit after
                `exit_layer` layers), "softmax" (top-1 minus top-2 probability of the exit head),
                "state" (cosine of a row's hidden state before and after the layer), or
                "classifier" (a per-layer head's P(exit); needs `params["exits"]`).
    threshold:  λ; a row is confident when its measure is > λ(t). ±inf mean never / always
                and are used as given.
    decay:      τ of CALM's decaying threshold λ(t) = clip(0.9·λ + 0.1·exp(-τ·t/N), 0, 1),
                t the generated position, N max_new_tokens; None keeps λ constant.
    min_exit_layer, every: a row may exit after E layers when E >= min_exit_layer and
                E % every == 0. Layer counts are "layers run": full depth is E = num_layers.
    exit_layers: the check points themselves (layers run, increasing, each below the model's
                depth), instead of min_exit_layer / every. Default: the checkpoint's trained
                exits when it records them, else every layer from min_exit_layer by `every`.
                Each check costs an exit-head evaluation: check where an exit can pay.
    head:       the head of the softmax checks: "reduced" (the checkpoint's reduced-vocabulary
                exit head, `eejax exit-vocab`), "full", or "auto" (reduced when there is one).
    emit:       the head that gives the token at an early exit: "full" (default; one full-head
                evaluation per exit) or "reduced" (the token is then one of the reduced set).
    """

    measure: str = "none"
    threshold: float | None = None
    exit_layer: int | None = None
    decay: float | None = 4.0
    min_exit_layer: int = 1
    every: int = 1
    exit_layers: tuple[int, ...] | None = None
    head: str = "auto"
    emit: str = "full"

    def __post_init__(self):
        if self.exit_layers is not None:
            object.__setattr__(self, "exit_layers", _check_points(self.exit_layers))
            if self.measure in ("none", "static"):
                raise EejaxError(f"exit_layers are check points of a confidence measure, not of {self.measure!r}")
            if (self.min_exit_layer, self.every) != (1, 1):
                raise EejaxError("give exit_layers or min_exit_layer / every, not both")
        if self.head not in HEADS:
            raise EejaxError(f"exit head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if self.emit not in ("full", "reduced"):
            raise EejaxError(f"exit emit must be 'full' or 'reduced', got {self.emit!r}")
        if self.measure not in EXIT_MEASURES:
            raise EejaxError(f"unknown exit measure {self.measure!r}; choose one of: " + ", ".join(EXIT_MEASURES))
        if self.measure == "static":
            if self.exit_layer is None or int(self.exit_layer) != self.exit_layer or self.exit_layer < 1:
                raise EejaxError(f"static exit needs exit_layer >= 1 (layers to run), got {self.exit_layer}")
        elif self.exit_layer is not None:
            raise EejaxError(f"exit_layer is only for measure='static' (got measure={self.measure!r})")
        if self.measure in ("softmax", "state", "classifier"):
            if self.threshold is None or math.isnan(self.threshold):
                raise EejaxError(f"measure {self.measure!r} needs a threshold (a number, inf or -inf)")
            low = -1.0 if self.measure == "state" else 0.0
            if math.isfinite(self.threshold) and not low <= self.threshold <= 1.0:
                raise EejaxError(
                    f"{self.measure} threshold must lie in [{low:g}, 1] (or be ±inf), got {self.threshold}"
                )
        elif self.threshold is not None:
            raise EejaxError(f"measure {self.measure!r} takes no threshold")
        if self.decay is not None and not (math.isfinite(self.decay) and self.decay >= 0):
            raise EejaxError(f"exit decay τ must be a number >= 0 or None (off), got {self.decay}")
        if int(self.min_exit_layer) != self.min_exit_layer or self.min_exit_layer < 1:
            raise EejaxError(f"min_exit_layer must be an integer >= 1, got {self.min_exit_layer}")
        if int(self.every) != self.every or self.every < 1:
            raise EejaxError(f"exit every must be an integer >= 1, got {self.every}")

    @property
    def spec(self) -> str:
        """The CLI spelling of the measure: `none`, `static:12`, `softmax:0.9` (see `parse`)."""
        if self.measure == "static":
            return f"static:{self.exit_layer}"
        return self.measure if self.threshold is None else f"{self.measure}:{self.threshold:g}"

    @property
    def checks_confidence(self) -> bool:
        """Whether a confidence measure must be computed (+inf can never be exceeded)."""
        return self.measure in ("softmax", "state", "classifier") and self.threshold != math.inf

    def check_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layer counts after which a confidence check runs: `exit_layers`, else every
        layer from min_exit_layer by `every` below full depth; none when no confidence is
        computed (none, static, threshold +inf). `models.exits.resolve_options` sets
        exit_layers to a checkpoint's trained exits."""
        if self.measure == "static" or not self.checks_confidence:
            return ()
        if self.exit_layers is not None:
            return self.exit_layers
        return tuple(e for e in range(self.min_exit_layer, num_layers) if e % self.every == 0)

    def uses_reduced_head(self, has_reduced: bool) -> tuple[bool, bool]:
        """(softmax checks use the reduced head, the emitted token does)."""
        checks = self.measure == "softmax" and (self.head == "reduced" or (self.head == "auto" and has_reduced))
        return checks, self.emit == "reduced"

    def check_model(self, num_layers: int, has_classifier: bool, has_reduced: bool = False) -> None:
        """Errors for settings this model cannot honour."""
        if self.measure == "static" and self.exit_layer > num_layers:
            raise EejaxError(f"static exit_layer {self.exit_layer} is deeper than the model ({num_layers} layers)")
        if self.min_exit_layer > num_layers:
            raise EejaxError(f"min_exit_layer {self.min_exit_layer} is deeper than the model ({num_layers} layers)")
        if self.exit_layers is not None and self.exit_layers[-1] >= num_layers:
            raise EejaxError(f"exit_layers {list(self.exit_layers)} must lie below the model's {num_layers} layers "
                             "(full depth is no exit)")
        if (self.head == "reduced" or self.emit == "reduced") and not has_reduced:
            raise EejaxError("this exit asks for the reduced-vocabulary exit head, which the checkpoint does not "
                             "have; add one with eejax exit-vocab (or use head='full')")
        if self.measure == "classifier" and not has_classifier:
            raise EejaxError(
                "measure 'classifier' needs exit classifiers in the checkpoint (params['exits']); "
                "add untrained ones with eejax.init_exits(model) or train them"
            )

    @classmethod
    def parse(cls, spec: str, **kw) -> ExitConfig:
        """`none`, `static:E`, `softmax:λ`, `state:λ`, `classifier:λ` (λ may be inf / -inf)."""
        name, _, value = spec.partition(":")
        if name not in EXIT_MEASURES:
            raise EejaxError(f"unknown exit measure {name!r} in {spec!r}; choose one of: " + ", ".join(EXIT_MEASURES))
        if name == "none":
            if value:
                raise EejaxError(f"exit 'none' takes no value, got {spec!r}")
            return cls("none", **kw)
        if not value:
            what = "E (layers to run)" if name == "static" else "λ"
            raise EejaxError(f"exit {name!r} needs a value: {name}:{what}")
        try:
            number = int(value) if name == "static" else float(value)
        except ValueError:
            raise EejaxError(f"cannot read {value!r} in {spec!r} as a number") from None
        if name == "static":
            return cls("static", exit_layer=number, **kw)
        return cls(name, threshold=number, **kw)


HEADS = ("auto", "full", "reduced")


def _check_points(layers) -> tuple[int, ...]:
    """Check layers as a tuple of increasing integers >= 1, or an EejaxError naming them."""
    try:
        points = tuple(layers)
    except TypeError:
        raise EejaxError(f"exit_layers must be a list of layer counts, got {layers!r}") from None
    if not points or any(isinstance(e, bool) or int(e) != e or e < 1 for e in points):
        raise EejaxError(f"exit_layers must be layer counts >= 1, got {list(points)}")
    points = tuple(int(e) for e in points)
    if any(b <= a for a, b in zip(points, points[1:])):
        raise EejaxError(f"exit_layers must be increasing without repeats, got {list(points)}")
    return points


MAX_SPECULATIONS = 64  # drafts per round: each is a pass of E layers, their K/V written ahead


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Self-speculative decoding (LayerSkip): draft with the first `exit_layer` layers and the
    exit head, verify with the rest.

    exit_layer:        E, the draft layers (1 <= E < num_layers).
    num_speculations:  d, drafts per round (the first round's d when adaptive).
    adaptive:          choose d per round from the measured acceptance rate and the measured
                       cost of a draft pass vs a verify pass, or a plain full-depth step while
                       no d pays (see `spec_policy.SpeculationPolicy`).
    max_speculations:  the largest d the adaptive policy may choose.
    head:              the head that drafts: "reduced" (the checkpoint's reduced-vocabulary
                       exit head), "full", or "auto" (reduced when there is one). Lossless
                       either way: verification uses the full head.
    bonus:             run the (d + 1)-th draft pass so a round whose d drafts were all accepted
                       emits d + 1 tokens (True), never (False), or when it pays under the cost
                       model at the measured acceptance (None, default; see `spec_policy`).
    """

    exit_layer: int
    num_speculations: int = 4
    adaptive: bool = False
    max_speculations: int = 8
    head: str = "auto"
    bonus: bool | None = None

    def __post_init__(self):
        if self.bonus not in (None, True, False):
            raise EejaxError(f"speculation bonus must be True, False or None (decided per round), got {self.bonus!r}")
        if self.head not in HEADS:
            raise EejaxError(f"speculation head must be one of {', '.join(HEADS)}, got {self.head!r}")
        for name in ("exit_layer", "num_speculations", "max_speculations"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise EejaxError(f"speculation {name} must be an integer >= 1, got {value!r}")
        for name in ("num_speculations", "max_speculations"):
            if getattr(self, name) > MAX_SPECULATIONS:
                raise EejaxError(f"speculation {name} must lie in [1, {MAX_SPECULATIONS}] (drafts per round), "
                                 f"got {getattr(self, name)}")
        if self.adaptive and self.max_speculations < self.num_speculations:
            raise EejaxError(
                f"max_speculations ({self.max_speculations}) is below num_speculations ({self.num_speculations})"
            )

    @property
    def spec(self) -> str:
        """The CLI spelling: `E:d`, or `E:d:adaptive` (d is then the first round's)."""
        return f"{self.exit_layer}:{self.num_speculations}" + (":adaptive" if self.adaptive else "")

    def uses_reduced_head(self, has_reduced: bool) -> bool:
        return self.head == "reduced" or (self.head == "auto" and has_reduced)

    def check_model(self, num_layers: int, has_reduced: bool = False) -> None:
        if self.head == "reduced" and not has_reduced:
            raise EejaxError("this speculation asks for the reduced-vocabulary exit head, which the checkpoint does "
                             "not have; add one with eejax exit-vocab (or use head='full')")
        if self.exit_layer >= num_layers:
            raise EejaxError(
                f"speculation exit_layer {self.exit_layer} must be below the model's {num_layers} layers "
                "(the draft runs E layers, the verification the other L - E)"
            )

    @classmethod
    def parse(cls, spec: str, **kw) -> SpecConfig:
        """`E:d` (d drafts per round) or `E:d:adaptive`."""
        parts = spec.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "adaptive"):
            raise EejaxError(f"cannot read speculation {spec!r}; expected E:d or E:d:adaptive (e.g. 12:4)")
        try:
            e, d = int(parts[0]), int(parts[1])
        except ValueError:
            raise EejaxError(f"cannot read speculation {spec!r}: E and d must be integers (e.g. 12:4)") from None
        return cls(e, d, adaptive=len(parts) == 3, **kw)
