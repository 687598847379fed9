"""Self-speculation as the user gives it: `SpecConfig`, frozen and checked, read from and
spelled in `options.grammar`'s strings (`parse`, `spec`); what `spec="auto"` runs
(`resolve_spec`) and the one rule between early exit and speculation (`check_exit_or_spec`)."""

from __future__ import annotations

import dataclasses

import eejax.options.grammar as grammar
from eejax.draft_trees import check_tree
from eejax.errors import EejaxError
from eejax.options.early_exit import HEADS
from eejax.options.grammar import MAX_SPECULATIONS


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, lossless: self-speculation (LayerSkip: draft with the first
    `exit_layer` layers and the exit head, verify with the rest), or a trained draft head on the
    model's features (`draft_head`, EAGLE: verify with every layer).

    exit_layer:        E, the draft layers (1 <= E < num_layers); 0 with a draft head.
    draft_head:        draft with the checkpoint's draft head (`params["draft"]`, eejax
                       train-draft); spelled `draft:d` or `draft:d:adaptive`.
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
    tree:              a draft head's drafts as a tree verified in one pass (`decode.tree`):
                       the nodes' rank paths (`check_tree`); d is its depth. Spelled
                       `draft:d:tree` (`default_tree`) or `draft:tree=0,1,00,...` (each node's
                       ranks as digits). Greedy rows only, without penalties.
    confidence_stop:   η (Kangaroo), a draft head's fixed chain: a row's drafts count up to its
                       first whose top probability is < η (`draft:d:stop=η`; None or 0: off).
    lookup:            with a draft head's chain, up to this many drafts copied where the row's
                       last tokens occurred before in its prompt or output: the tokens that
                       followed them there (prompt lookup, `decode.lookup`); the head's d
                       elsewhere. Spelled `draft:d:lookup` (d) or `draft:d:lookup=k`; True: d;
                       0 or False: off.
    """

    exit_layer: int
    num_speculations: int = 4
    adaptive: bool = False
    max_speculations: int = 8
    head: str = "auto"
    bonus: bool | None = None
    draft_head: bool = False
    tree: tuple[tuple[int, ...], ...] | None = None
    confidence_stop: float | None = None
    lookup: int = 0

    def __post_init__(self):
        stop = self.confidence_stop
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, (int, float)) or not 0 <= stop <= 1):
            raise EejaxError(f"speculation confidence_stop (η) must lie in [0, 1] (0: off), got {stop!r}")
        object.__setattr__(self, "confidence_stop", float(stop) if stop else None)
        if self.confidence_stop is not None and (not self.draft_head or self.tree is not None or self.adaptive):
            raise EejaxError("a confidence stop (η) takes a draft head's fixed chain: draft:d:stop=η")
        lookup = self.num_speculations if self.lookup is True else self.lookup
        if not isinstance(lookup, int) or not 0 <= lookup <= MAX_SPECULATIONS:
            raise EejaxError(f"speculation lookup (copied drafts) must lie in [0, {MAX_SPECULATIONS}], got {lookup!r}")
        object.__setattr__(self, "lookup", int(lookup))
        if self.lookup and (not self.draft_head or self.tree is not None or self.confidence_stop is not None):
            raise EejaxError("a prompt lookup takes a draft head's chain: draft:d:lookup (not a tree, nor a stop)")
        if self.tree is not None:
            object.__setattr__(self, "tree", check_tree(self.tree))
            if not self.draft_head or self.adaptive:
                raise EejaxError("a draft tree needs a draft head at a fixed depth: draft:d:tree, not adaptive")
            depth = max(map(len, self.tree))
            if self.num_speculations != depth:
                raise EejaxError(f"num_speculations ({self.num_speculations}) must be the draft tree's depth ({depth})")
        if self.draft_head not in (True, False):
            raise EejaxError(f"speculation draft_head must be True or False, got {self.draft_head!r}")
        if self.draft_head and self.exit_layer != 0:
            raise EejaxError(
                f"a draft head drafts from the model's last features: its exit_layer is 0, got {self.exit_layer!r}"
            )
        if self.bonus not in (None, True, False):
            raise EejaxError(f"speculation bonus must be True, False or None (decided per round), got {self.bonus!r}")
        if self.head not in HEADS:
            raise EejaxError(f"speculation head must be one of {', '.join(HEADS)}, got {self.head!r}")
        for name in ("exit_layer", "num_speculations", "max_speculations")[self.draft_head :]:
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise EejaxError(f"speculation {name} must be an integer >= 1, got {value!r}")
            if name != "exit_layer" and value > MAX_SPECULATIONS:
                raise EejaxError(
                    f"speculation {name} must lie in [1, {MAX_SPECULATIONS}] (drafts per round), got {value}"
                )
        if self.adaptive and self.max_speculations < self.num_speculations:
            raise EejaxError(
                f"max_speculations ({self.max_speculations}) is below num_speculations ({self.num_speculations})"
            )

    @property
    def spec(self) -> str:
        """The CLI spelling: `E:d`, `draft:d`, with `:adaptive` (d is then the first round's), or a
        tree's (`draft:d:tree`, `draft:tree=...`)."""
        return grammar.spell_spec(
            self.exit_layer,
            self.num_speculations,
            self.adaptive,
            self.draft_head,
            self.tree,
            self.confidence_stop,
            self.lookup,
        )

    @property
    def positions_ahead(self) -> int:
        """The most cache positions a round writes past a row's last token: its drafts (d, the
        adaptive policy's largest, a tree's nodes, or a prompt lookup's copies)."""
        if self.tree is not None:
            return len(self.tree)
        return max(self.max_speculations if self.adaptive else self.num_speculations, self.lookup)

    def check_sampling(self, sampler: str, penalized: bool) -> None:
        """An EejaxError where this speculation cannot decode rows of `sampler` (with penalties)."""
        if self.tree is not None and (sampler != "greedy" or penalized):
            raise EejaxError(
                "a tree of drafts verifies greedy rows without penalties only; "
                "sample or penalise with a chain (draft:d)"
            )

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
        if self.exit_layer >= num_layers:
            raise EejaxError(
                f"speculation exit_layer {self.exit_layer} must be below the model's {num_layers} layers "
                "(the draft runs E layers, the verification the other L - E)"
            )

    @classmethod
    def parse(cls, spec: str, **kw) -> SpecConfig:
        """`E:d`, `draft:d` and their modifiers (`grammar.read_spec`); `kw`: the other fields."""
        return cls(**{**grammar.read_spec(spec), **kw})


def auto_spec() -> SpecConfig:
    """What `spec="auto"` runs on a model with a draft head: the head's chain with prompt lookup
    (up to 4 copied drafts), d chosen per program by the adaptive policy from 1 to 4, plain
    full-depth steps where no round pays, and speculation turned off for the group's rows where
    none would (`decode.spec_policy`). Spelled `draft:2:adaptive:lookup=4` with max_speculations 4."""
    return SpecConfig(0, 2, adaptive=True, max_speculations=4, draft_head=True, lookup=4)


def check_exit_or_spec(exit, spec, names: tuple[str, str] = ("early exit (exit)", "self-speculation (spec)")) -> None:
    """The one rule between early exit and speculation: a request decodes with one of them at
    most. `exit` and `spec` as given (a config, a string or None): None and the strings "none",
    "off" and "" ask for neither; any config does (an `ExitConfig("none")` runs the early-exit
    loop); "auto" asks for speculation even where it would run full depth. `names`: how the
    caller spells the two (flags, keywords)."""

    def asked(option) -> bool:
        return option is not None and not grammar.is_off(option)

    if asked(exit) and asked(spec):
        raise EejaxError(f"choose {names[0]} or {names[1]}, not both")


def resolve_spec(spec: SpecConfig | str | None, has_draft_head: bool, speculate: bool = True) -> SpecConfig | None:
    """A `spec` argument as the SpecConfig it runs, or None for full depth: "auto" is `auto_spec()`
    on a model with a draft head where `speculate` (`spec_policy.auto_speculates`: the device and
    the rows decoding at once), else full depth; "none", "off" and "" are full depth; another
    string is `SpecConfig.parse`d."""
    if not isinstance(spec, str):
        return spec
    if grammar.is_auto(spec):
        return auto_spec() if has_draft_head and speculate else None
    if grammar.is_off(spec):
        return None
    return SpecConfig.parse(spec)
