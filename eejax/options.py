"""Decoding options, frozen (they key compiled programs): `ExitConfig` (when a decode step may
stop early) and `SpecConfig` (self-speculation), each with its CLI spelling (`parse`, `spec`),
and `StepOptions`, all that a compiled generation program depends on besides shapes."""

from __future__ import annotations

import dataclasses
import functools
import math

from eejax.draft_trees import MAX_TREE_NODES, check_tree, default_tree
from eejax.errors import EejaxError

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
        if self.tree is not None:
            if self.tree == default_tree(self.num_speculations):
                return f"draft:{self.num_speculations}:tree"
            return "draft:tree=" + ",".join("".join(map(str, p)) for p in self.tree)
        drafter = "draft" if self.draft_head else self.exit_layer
        if self.confidence_stop is not None:
            return f"{drafter}:{self.num_speculations}:stop={self.confidence_stop:g}"
        copies = ":lookup" * bool(self.lookup) + f"={self.lookup}" * (self.lookup not in (0, self.num_speculations))
        return f"{drafter}:{self.num_speculations}" + ":adaptive" * self.adaptive + copies

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
        """`E:d` (d drafts per round from the first E layers) or `draft:d` (from the draft head),
        then modifiers, each at most once: `:adaptive`, and with the draft head `:tree` (a tree of
        drafts; or `draft:tree=0,1,00,...`), `:stop=η` (a confidence stop), `:lookup` or
        `:lookup=k` (prompt lookup: up to d or k copied drafts)."""
        drafter, *rest = spec.split(":")
        head = drafter == "draft"
        if head and rest and rest[0].startswith("tree="):
            nodes = rest[0][len("tree=") :].split(",")
            if len(rest) > 1 or not all(n.isdigit() for n in nodes):
                raise EejaxError(f"cannot read the draft tree {spec!r}: each node is its ranks as digits (e.g. 0,1,00)")
            tree = check_tree(tuple(int(c) for c in n) for n in nodes)
            return cls(0, max(map(len, tree)), draft_head=True, tree=tree, **kw)
        modifiers = rest[1:]
        stops = [m for m in modifiers if m.startswith("stop=")]
        copies = [m for m in modifiers if m.startswith("lookup")]
        known = {"adaptive", "tree"} | set(stops[:1]) | set(copies[:1])
        if not rest or len(set(modifiers)) < len(modifiers) or not set(modifiers) <= known or (stops and not head):
            raise EejaxError(
                f"cannot read speculation {spec!r}; expected E:d, draft:d or either with :adaptive, "
                "draft:d:tree, draft:d:stop=η or draft:d:lookup (e.g. 12:4, draft:4, draft:4:tree, draft:4:stop=0.3)"
            )
        if "tree" in modifiers and not head:
            raise EejaxError(f"cannot read speculation {spec!r}: a tree of drafts needs the draft head (draft:d:tree)")
        try:
            e, d = 0 if head else int(drafter), int(rest[0])
            stop = float(stops[0][len("stop=") :]) if stops else None
            lookup = 0 if not copies else d if copies[0] == "lookup" else int(copies[0].removeprefix("lookup="))
        except ValueError:
            raise EejaxError(
                f"cannot read speculation {spec!r}: E, d and k must be integers, η a number "
                "(e.g. 12:4, draft:4, draft:4:stop=0.5, draft:2:lookup=8)"
            ) from None
        if "tree" in modifiers and not 1 <= d <= MAX_TREE_NODES - 3:
            raise EejaxError(
                f"cannot read speculation {spec!r}: a draft tree's depth d lies in [1, {MAX_TREE_NODES - 3}]"
            )
        tree = default_tree(d) if "tree" in modifiers else None
        adaptive = "adaptive" in modifiers
        return cls(e, d, adaptive=adaptive, draft_head=head, tree=tree, confidence_stop=stop, lookup=lookup, **kw)


OFF = ("none", "off", "")  # a speculation spelled so is none: full depth


def auto_spec() -> SpecConfig:
    """What `spec="auto"` runs on a model with a draft head: the head's chain with prompt lookup
    (up to 4 copied drafts), d chosen per program by the adaptive policy from 1 to 4, plain
    full-depth steps where no round pays, and speculation turned off for the group's rows where
    none would (`decode.spec_policy`). Spelled `draft:2:adaptive:lookup=4` with max_speculations 4."""
    return SpecConfig(0, 2, adaptive=True, max_speculations=4, draft_head=True, lookup=4)


def is_auto(spec) -> bool:
    """Whether a `spec` argument is the word "auto" (any case)."""
    return isinstance(spec, str) and spec.strip().lower() == "auto"


def check_exit_or_spec(exit, spec, names: tuple[str, str] = ("early exit (exit)", "self-speculation (spec)")) -> None:
    """The one rule between early exit and speculation: a request decodes with one of them at
    most. `exit` and `spec` as given (a config, a string or None): None and the strings "none",
    "off" and "" ask for neither; any config does (an `ExitConfig("none")` runs the early-exit
    loop); "auto" asks for speculation even where it would run full depth. `names`: how the
    caller spells the two (flags, keywords)."""

    def asked(option) -> bool:
        return option is not None and not (isinstance(option, str) and option.strip().lower() in OFF)

    if asked(exit) and asked(spec):
        raise EejaxError(f"choose {names[0]} or {names[1]}, not both")


def resolve_spec(spec: SpecConfig | str | None, has_draft_head: bool, speculate: bool = True) -> SpecConfig | None:
    """A `spec` argument as the SpecConfig it runs, or None for full depth: "auto" is `auto_spec()`
    on a model with a draft head where `speculate` (`spec_policy.auto_speculates`: the device and
    the rows decoding at once), else full depth; "none", "off" and "" are full depth; another
    string is `SpecConfig.parse`d."""
    if not isinstance(spec, str):
        return spec
    if is_auto(spec):
        return auto_spec() if has_draft_head and speculate else None
    if spec.strip().lower() in OFF:
        return None
    return SpecConfig.parse(spec)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Everything a compiled generation program depends on besides its input shapes and the
    model: one frozen value, the key of the program cache (`ProgramCache.get`). Values that vary
    per row (sampling temperature / top-k / top-p, seeds, limits) are traced, not options.

    max_new_tokens: the width of the per-row token record (a row's own limit is traced).
    eos_ids:        the tokens that end a row.
    sampler:        "greedy", "temperature" or "filtered" (`sampling.sample`).
    exit:           early exit in decode steps (a resolved `ExitConfig`), None: full depth.
    spec:           self-speculation; in a round's programs `spec.num_speculations` is that
                    round's d (see `round`).
    spec_off:       (engine groups) rows of `spec` whose speculation the adaptive policy turned
                    off: plain steps without the draft's catch-up (`plain(catch_up=False)`).
    bonus:          a draft program runs the (d + 1)-th pass (`speculative.draft`).
    attention:      the attention implementation (`kernels.attention.IMPLS`).
    logprobs:       keep a log-prob record of the generated tokens.
    penalties:      apply the rows' repetition / frequency / presence penalties, over the
                    token counts the program then takes and returns in `DecodeState.counts`.
    prompt_logprobs: a prefill also scores the prompt's own tokens (`prompt_scores`).
    num_steps:      decode steps per program (`steps.decode_steps`); in a round's programs, the
                    rounds per program (`speculative.spec_round_slots`).

    Each program reads some of these; the views below keep those and reset the rest, so that
    options a program ignores never compile it twice.
    """

    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    sampler: str = "greedy"
    exit: ExitConfig | None = None
    spec: SpecConfig | None = None
    spec_off: bool = False
    bonus: bool = False
    attention: str = "auto"
    logprobs: bool = False
    penalties: bool = False
    prompt_logprobs: bool = False
    num_steps: int = 1

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(t) for t in self.eos_ids))
        check_exit_or_spec(self.exit, self.spec)
        if isinstance(self.num_steps, bool) or int(self.num_steps) != self.num_steps or self.num_steps < 1:
            raise EejaxError(f"num_steps (decode steps per program) must be an integer >= 1, got {self.num_steps}")
        if self.spec is not None:
            self.spec.check_sampling(self.sampler, self.penalties)

    def prefilling(self) -> StepOptions:
        """What a prefill reads: no early exit (prompts run at full depth), speculation or steps."""
        return dataclasses.replace(self, exit=None, spec=None, spec_off=False, bonus=False, num_steps=1)

    def decoding(self, num_steps: int = 1) -> StepOptions:
        """What `num_steps` decode steps read (no speculation)."""
        return dataclasses.replace(self, spec=None, spec_off=False, bonus=False, num_steps=num_steps)

    def round(self, num_speculations: int, bonus: bool = False, rounds: int = 1) -> StepOptions:
        """`rounds` speculation rounds (`num_steps`) of d = `num_speculations` drafts: only the
        draft layers, d, the draft head and `bonus` of `spec` matter to their programs (not
        adaptive, max, or bonus policy). Made once per (options, d, bonus, rounds): the engine
        asks for it every dispatch."""
        return _round(self, num_speculations, bonus, rounds)

    def plain(self, num_steps: int = 1, catch_up: bool = True) -> StepOptions:
        """What `num_steps` full-depth decode steps in place of a round read (`decoding`); with a
        draft head and `catch_up`, also that they end with the draft's catch-up
        (`speculative.plain_step`)."""
        if catch_up and self.spec is not None and self.spec.draft_head:
            steps = self.round(1)  # (a plain step looks nothing up)
            return dataclasses.replace(steps, spec=dataclasses.replace(steps.spec, lookup=0), num_steps=num_steps)
        return self.decoding(num_steps)

    def drafting(self) -> StepOptions:
        """What a round's draft program reads: no limits, EOS or log-probs (`round` first)."""
        return StepOptions(0, sampler=self.sampler, spec=self.spec, bonus=self.bonus, attention=self.attention)

    def verifying(self) -> StepOptions:
        """What a round's verify program reads (the number of scored positions is a shape)."""
        return dataclasses.replace(self, bonus=False)


@functools.lru_cache(maxsize=256)
def _round(options: StepOptions, num_speculations: int, bonus: bool, rounds: int) -> StepOptions:
    spec = SpecConfig(
        options.spec.exit_layer,
        num_speculations,
        head=options.spec.head,
        draft_head=options.spec.draft_head,
        tree=options.spec.tree,
        confidence_stop=options.spec.confidence_stop,
        lookup=options.spec.lookup,
    )
    bonus = bonus and not spec.draft_head  # a draft head's round always scores d + 1 positions
    return dataclasses.replace(options, exit=None, spec=spec, bonus=bonus, num_steps=rounds)
