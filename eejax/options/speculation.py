"""Self-speculation as the user gives it: a `SpecConfig`, one frozen and checked record per method
(vLLM's `SpeculativeConfig.method`), read from and spelled in `options.grammar`'s strings
(`SpecConfig.parse`, `.spec`).

The methods, each lossless (verification uses every layer and the full head):
    layerskip  `LayerSkipSpec`    E:d      draft with the first E layers and the exit head (LayerSkip)
    draft      `DraftChainSpec`   draft:d  draft a chain with the checkpoint's draft head (EAGLE)
    lookup     `DraftLookupSpec`  draft:d:lookup[=k]  a chain, and drafts copied from the row (prompt lookup)
    stop       `DraftStopSpec`    draft:d:stop=η      a fixed chain cut at its first unsure draft (Kangaroo)
    tree       `DraftTreeSpec`    draft:d:tree, draft:tree=0,1,00,...  a tree verified in one pass
Every record reads the same (`exit_layer`, `draft_head`, `adaptive`, `tree`, `confidence_stop`,
`lookup`, ...: a method without a field reads its neutral value), so the programs ask what a
round does, not which method it is."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import eejax.options.grammar as grammar
from eejax.draft_trees import check_tree
from eejax.errors import EejaxError
from eejax.options.early_exit import HEADS
from eejax.options.grammar import MAX_SPECULATIONS


class SpecConfig:
    """Speculative decoding, one of `METHODS` (a frozen dataclass each; this common type is not
    one, so each method's fields keep their own order). The neutral values, for a method that
    has no such field:

    exit_layer:        E, the layers a draft pass runs: 0 with a draft head (it drafts from the
                       model's last features).
    draft_head:        whether the checkpoint's draft head drafts (`params["draft"]`).
    adaptive:          d is chosen per round (`spec_policy.SpeculationPolicy`).
    bonus:             LayerSkip's (d + 1)-th draft pass: None, decided per round.
    tree:              a draft tree's nodes, or None (a chain).
    confidence_stop:   a chain's η, or None.
    lookup:            k, the drafts a round may copy (prompt lookup), or 0.
    """

    method: ClassVar[str] = ""
    exit_layer: ClassVar[int] = 0
    draft_head: ClassVar[bool] = True
    adaptive: ClassVar[bool] = False
    bonus: ClassVar[bool | None] = None
    tree: ClassVar[tuple[tuple[int, ...], ...] | None] = None
    confidence_stop: ClassVar[float | None] = None
    lookup: ClassVar[int] = 0

    def __new__(cls, *args, **kwargs):
        if cls is SpecConfig:
            raise EejaxError(
                "SpecConfig is the methods' common type: build one of "
                + ", ".join(method.__name__ for method in METHODS.values())
                + ", or SpecConfig.parse('draft:4')"
            )
        return super().__new__(cls)

    def __post_init__(self):
        if self.head not in HEADS:
            raise EejaxError(f"speculation head must be one of {', '.join(HEADS)}, got {self.head!r}")
        for name in ("num_speculations", "max_speculations"):
            if name in self.field_names():
                _check_drafts(name, getattr(self, name))
        if self.adaptive not in (True, False):
            raise EejaxError(f"speculation adaptive must be True or False, got {self.adaptive!r}")
        if self.adaptive and self.max_speculations < self.num_speculations:
            raise EejaxError(
                f"max_speculations ({self.max_speculations}) is below num_speculations ({self.num_speculations})"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def parse(cls, spec: str, **options) -> SpecConfig:
        """The record of `E:d`, `draft:d` and their modifiers (`grammar.read_spec`); `options`:
        more of its method's fields (head, bonus, max_speculations). An option the method does
        not have is an EejaxError (LayerSkip's bonus on a draft head, say), not dropped."""
        fields = grammar.read_spec(spec)
        method = METHODS[fields.pop("method")]
        foreign = sorted(set(options) - set(method.field_names()))
        if foreign:
            raise EejaxError(f"speculation {spec!r} ({method.method}) takes no {', '.join(foreign)}")
        return method(**fields, **options)

    @property
    def spec(self) -> str:
        """The CLI spelling, which `parse` reads back."""
        return grammar.spell_spec(self.method, {name: getattr(self, name) for name in self.field_names()})

    @property
    def positions_ahead(self) -> int:
        """The most cache positions a round writes past a row's last token: its drafts (d, the
        adaptive policy's largest, a tree's nodes, or a prompt lookup's copies)."""
        return self.max_speculations if self.adaptive else self.num_speculations

    def at_depth(self, num_speculations: int) -> SpecConfig:
        """What a round of d = `num_speculations` drafts runs: this method's fields that its
        programs read, with d (not adaptive, the policy's largest d, or bonus policy)."""
        return self

    def check_sampling(self, sampler: str, penalized: bool) -> None:
        """An EejaxError where this speculation cannot decode rows of `sampler` (with penalties)."""

    def uses_reduced_head(self, has_reduced: bool) -> bool:
        return self.head == "reduced" or (self.head == "auto" and has_reduced)

    def check_model(self, num_layers: int, has_reduced: bool = False, has_draft: bool = False) -> None:
        if self.draft_head and not has_draft:
            raise EejaxError(
                "speculation draft:d needs a draft head in the checkpoint (params['draft']); train "
                "one with eejax train-draft, or load a model that ships one (smollm2-135m-eagle)"
            )
        if self.head == "reduced" and not has_reduced:
            raise EejaxError(
                "this speculation asks for the reduced-vocabulary exit head, which the checkpoint does "
                "not have; add one with eejax exit-vocab (or use head='full')"
            )


def _check_drafts(name: str, value) -> None:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise EejaxError(f"speculation {name} must be an integer >= 1, got {value!r}")
    if value > MAX_SPECULATIONS:
        raise EejaxError(f"speculation {name} must lie in [1, {MAX_SPECULATIONS}] (drafts per round), got {value}")


@dataclasses.dataclass(frozen=True)
class LayerSkipSpec(SpecConfig):
    """Self-speculation (LayerSkip): d drafts per round from the first `exit_layer` layers and the
    exit head, verified by the other layers (`E:d`, `E:d:adaptive`).

    exit_layer:        E, the draft layers (1 <= E < num_layers).
    num_speculations:  d, drafts per round (the first round's d when adaptive).
    adaptive:          choose d per round from the measured acceptance rate and the measured
                       cost of a draft pass vs a verify pass, or a plain full-depth step while
                       no d pays (see `spec_policy.SpeculationPolicy`).
    max_speculations:  the largest d the adaptive policy may choose.
    head:              the head that drafts: "reduced" (the checkpoint's reduced-vocabulary
                       exit head), "full", or "auto" (reduced when there is one).
    bonus:             run the (d + 1)-th draft pass so a round whose d drafts were all accepted
                       emits d + 1 tokens (True), never (False), or when it pays under the cost
                       model at the measured acceptance (None, default; see `spec_policy`).
    """

    method: ClassVar[str] = "layerskip"
    draft_head: ClassVar[bool] = False
    exit_layer: int = dataclasses.field()
    num_speculations: int = 4
    adaptive: bool = False
    max_speculations: int = 8
    head: str = "auto"
    bonus: bool | None = None

    def __post_init__(self):
        if isinstance(self.exit_layer, bool) or int(self.exit_layer) != self.exit_layer or self.exit_layer < 1:
            raise EejaxError(f"speculation exit_layer must be an integer >= 1, got {self.exit_layer!r}")
        if self.bonus not in (None, True, False):
            raise EejaxError(f"speculation bonus must be True, False or None (decided per round), got {self.bonus!r}")
        super().__post_init__()

    def at_depth(self, num_speculations: int) -> LayerSkipSpec:
        return LayerSkipSpec(self.exit_layer, num_speculations, head=self.head)

    def check_model(self, num_layers: int, has_reduced: bool = False, has_draft: bool = False) -> None:
        super().check_model(num_layers, has_reduced, has_draft)
        if self.exit_layer >= num_layers:
            raise EejaxError(
                f"speculation exit_layer {self.exit_layer} must be below the model's {num_layers} layers "
                "(the draft runs E layers, the verification the other L - E)"
            )


@dataclasses.dataclass(frozen=True)
class DraftChainSpec(SpecConfig):
    """A chain of d drafts per round from the checkpoint's draft head on the model's features
    (EAGLE; `draft:d`, `draft:d:adaptive`), verified with every layer. Its round always scores
    d + 1 positions. num_speculations, adaptive, max_speculations, head: as `LayerSkipSpec`'s
    (the head's vocabulary: reduced, full or auto)."""

    method: ClassVar[str] = "draft"
    num_speculations: int = 4
    adaptive: bool = False
    max_speculations: int = 8
    head: str = "auto"

    def at_depth(self, num_speculations: int) -> DraftChainSpec:
        return DraftChainSpec(num_speculations, head=self.head)


@dataclasses.dataclass(frozen=True)
class DraftLookupSpec(DraftChainSpec):
    """A draft head's chain with prompt lookup (`draft:d:lookup`, `draft:d:lookup=k`, with
    `:adaptive`): up to `lookup` = k drafts copied where the row's last tokens occurred before in
    its prompt or output (the tokens that followed them there: `decode.lookup`), the head's d
    elsewhere. k: None is d."""

    method: ClassVar[str] = "lookup"
    lookup: int | None = None

    def __post_init__(self):
        super().__post_init__()
        lookup = self.num_speculations if self.lookup is None else self.lookup
        if isinstance(lookup, bool) or not isinstance(lookup, int) or not 1 <= lookup <= MAX_SPECULATIONS:
            raise EejaxError(f"speculation lookup (copied drafts) must lie in [1, {MAX_SPECULATIONS}], got {lookup!r}")
        object.__setattr__(self, "lookup", lookup)

    @property
    def positions_ahead(self) -> int:
        return max(super().positions_ahead, self.lookup)

    def at_depth(self, num_speculations: int) -> DraftLookupSpec:
        return DraftLookupSpec(num_speculations, head=self.head, lookup=self.lookup)


@dataclasses.dataclass(frozen=True)
class DraftStopSpec(SpecConfig):
    """A draft head's fixed chain with a confidence stop (Kangaroo; `draft:d:stop=η`): a row's
    drafts count up to its first whose top probability is < η (0 < η <= 1)."""

    method: ClassVar[str] = "stop"
    num_speculations: int = dataclasses.field()
    confidence_stop: float = dataclasses.field()
    head: str = "auto"

    def __post_init__(self):
        stop = self.confidence_stop
        if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not 0 < stop <= 1:
            raise EejaxError(
                f"speculation confidence_stop (η) must lie in [0, 1] (0: off, a plain draft:d), got {stop!r}"
            )
        object.__setattr__(self, "confidence_stop", float(stop))
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class DraftTreeSpec(SpecConfig):
    """A draft head's drafts as a tree verified in one pass (`decode.tree`; `draft:d:tree` is
    `default_tree(d)`, `draft:tree=0,1,00,...` spells each node's ranks as digits): the nodes'
    rank paths (`check_tree`); d, `num_speculations`, is its depth. Greedy rows only, without
    penalties."""

    method: ClassVar[str] = "tree"
    tree: tuple[tuple[int, ...], ...] = dataclasses.field()
    head: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "tree", check_tree(self.tree))
        super().__post_init__()

    @property
    def num_speculations(self) -> int:
        return max(map(len, self.tree))

    @property
    def positions_ahead(self) -> int:
        return len(self.tree)

    def check_sampling(self, sampler: str, penalized: bool) -> None:
        if sampler != "greedy" or penalized:
            raise EejaxError(
                "a tree of drafts verifies greedy rows without penalties only; "
                "sample or penalise with a chain (draft:d)"
            )


METHODS: dict[str, type[SpecConfig]] = {
    cls.method: cls for cls in (LayerSkipSpec, DraftChainSpec, DraftLookupSpec, DraftStopSpec, DraftTreeSpec)
}
