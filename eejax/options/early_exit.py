"""When a decode step may stop early, as the user gives it: `ExitConfig`, frozen and checked,
read from and spelled in `options.grammar`'s strings (`parse`, `spec`)."""

from __future__ import annotations

import dataclasses
import math

import eejax.options.grammar as grammar
from eejax.errors import EejaxError
from eejax.options.grammar import EXIT_MEASURES


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
        return grammar.spell_exit(self.measure, self.threshold, self.exit_layer)

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
            raise EejaxError(
                f"exit_layers {list(self.exit_layers)} must lie below the model's {num_layers} layers "
                "(full depth is no exit)"
            )
        if (self.head == "reduced" or self.emit == "reduced") and not has_reduced:
            raise EejaxError(
                "this exit asks for the reduced-vocabulary exit head, which the checkpoint does not "
                "have; add one with eejax exit-vocab (or use head='full')"
            )
        if self.measure == "classifier" and not has_classifier:
            raise EejaxError(
                "measure 'classifier' needs exit classifiers in the checkpoint (params['exits']); "
                "add untrained ones with eejax.init_exits(model) or train them"
            )

    @classmethod
    def parse(cls, spec: str, **kw) -> ExitConfig:
        """`none`, `static:E`, `softmax:λ`, `state:λ`, `classifier:λ` (λ may be inf / -inf;
        `grammar.read_exit`); `kw`: the other fields."""
        return cls(**grammar.read_exit(spec), **kw)


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
