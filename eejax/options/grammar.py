"""The decoding options' string grammar, as the CLI, the HTTP server and `generate` take them:
early exit `none`, `static:E`, `softmax:λ`, `state:λ`, `classifier:λ`; speculation `E:d`,
`draft:d` with `:adaptive`, `:tree`, `:stop=η`, `:lookup[=k]`, or `draft:tree=0,1,00,...`;
`auto`, and `none` / `off` / "" for neither. Read into the configs' fields (`read_exit`,
`read_spec`; `options.configs` builds the configs from them) and written back (`spell_exit`,
`spell_spec`). Plain strings and numbers: no config is built here."""

from __future__ import annotations

from eejax.draft_trees import MAX_TREE_NODES, check_tree, default_tree
from eejax.errors import EejaxError

EXIT_MEASURES = ("none", "static", "softmax", "state", "classifier")
OFF = ("none", "off", "")  # an option spelled so is none: full depth
MAX_SPECULATIONS = 64  # drafts per round: each is a pass of E layers, their K/V written ahead


def is_off(text) -> bool:
    """Whether `text` is a string that asks for neither early exit nor speculation."""
    return isinstance(text, str) and text.strip().lower() in OFF


def is_auto(text) -> bool:
    """Whether a `spec` argument is the word "auto" (any case)."""
    return isinstance(text, str) and text.strip().lower() == "auto"


def read_exit(text: str) -> dict:
    """`ExitConfig`'s fields (measure, and threshold or exit_layer) of `none`, `static:E`,
    `softmax:λ`, `state:λ` or `classifier:λ` (λ may be inf / -inf)."""
    name, _, value = text.partition(":")
    if name not in EXIT_MEASURES:
        raise EejaxError(f"unknown exit measure {name!r} in {text!r}; choose one of: " + ", ".join(EXIT_MEASURES))
    if name == "none":
        if value:
            raise EejaxError(f"exit 'none' takes no value, got {text!r}")
        return {"measure": "none"}
    if not value:
        what = "E (layers to run)" if name == "static" else "λ"
        raise EejaxError(f"exit {name!r} needs a value: {name}:{what}")
    try:
        number = int(value) if name == "static" else float(value)
    except ValueError:
        raise EejaxError(f"cannot read {value!r} in {text!r} as a number") from None
    if name == "static":
        return {"measure": "static", "exit_layer": number}
    return {"measure": name, "threshold": number}


def spell_exit(measure: str, threshold: float | None, exit_layer: int | None) -> str:
    """The spelling `read_exit` reads back: `none`, `static:12`, `softmax:0.9`."""
    if measure == "static":
        return f"static:{exit_layer}"
    return measure if threshold is None else f"{measure}:{threshold:g}"


def read_spec(text: str) -> dict:
    """A speculation's method (`options.speculation.METHODS`) and its fields, of `E:d` (d drafts
    per round from the first E layers: "layerskip") or `draft:d` (from the draft head: "draft"),
    then modifiers, each at most once: `:adaptive`, and with the draft head `:tree` (a tree of
    drafts, "tree"; or `draft:tree=0,1,00,...`), `:stop=η` (a confidence stop, "stop"), `:lookup`
    or `:lookup=k` (prompt lookup, up to d or k copied drafts, past d only after a 4-token match
    where rounds score only what was drafted: "lookup"). A stop of 0 and a
    lookup of 0 are off."""
    drafter, *rest = text.split(":")
    head = drafter == "draft"
    if head and rest and rest[0].startswith("tree="):
        nodes = rest[0][len("tree=") :].split(",")
        if len(rest) > 1 or not all(n.isdigit() for n in nodes):
            raise EejaxError(f"cannot read the draft tree {text!r}: each node is its ranks as digits (e.g. 0,1,00)")
        return {"method": "tree", "tree": check_tree(tuple(int(c) for c in n) for n in nodes)}
    modifiers = rest[1:]
    stops = [m for m in modifiers if m.startswith("stop=")]
    copies = [m for m in modifiers if m.startswith("lookup")]
    known = {"adaptive", "tree"} | set(stops[:1]) | set(copies[:1])
    if not rest or len(set(modifiers)) < len(modifiers) or not set(modifiers) <= known or (stops and not head):
        raise EejaxError(
            f"cannot read speculation {text!r}; expected E:d, draft:d or either with :adaptive, "
            "draft:d:tree, draft:d:stop=η or draft:d:lookup (e.g. 12:4, draft:4, draft:4:tree, draft:4:stop=0.3)"
        )
    if "tree" in modifiers and not head:
        raise EejaxError(f"cannot read speculation {text!r}: a tree of drafts needs the draft head (draft:d:tree)")
    try:
        e, d = 0 if head else int(drafter), int(rest[0])
        stop = float(stops[0][len("stop=") :]) if stops else 0.0
        lookup = 0 if not copies else d if copies[0] == "lookup" else int(copies[0].removeprefix("lookup="))
    except ValueError:
        raise EejaxError(
            f"cannot read speculation {text!r}: E, d and k must be integers, η a number "
            "(e.g. 12:4, draft:4, draft:4:stop=0.5, draft:2:lookup=8)"
        ) from None
    if not 0 <= stop <= 1:
        raise EejaxError(f"speculation confidence_stop (η) must lie in [0, 1] (0: off), got {stop!r}")
    if not 0 <= lookup <= MAX_SPECULATIONS:
        raise EejaxError(
            f"speculation lookup (copied drafts) must lie in [0, {MAX_SPECULATIONS}] (0: off), got {lookup}"
        )
    adaptive = "adaptive" in modifiers
    if "tree" in modifiers:
        if not 1 <= d <= MAX_TREE_NODES - 3:
            raise EejaxError(
                f"cannot read speculation {text!r}: a draft tree's depth d lies in [1, {MAX_TREE_NODES - 3}]"
            )
        if adaptive:
            raise EejaxError("a draft tree needs a draft head at a fixed depth: draft:d:tree, not adaptive")
    if lookup and (not head or "tree" in modifiers or stop):
        raise EejaxError("a prompt lookup takes a draft head's chain: draft:d:lookup (not a tree, nor a stop)")
    if stop and adaptive:
        raise EejaxError("a confidence stop (η) takes a draft head's fixed chain: draft:d:stop=η")
    if not head:
        return {"method": "layerskip", "exit_layer": e, "num_speculations": d, "adaptive": adaptive}
    if "tree" in modifiers:
        return {"method": "tree", "tree": default_tree(d)}
    if stop:
        return {"method": "stop", "num_speculations": d, "confidence_stop": stop}
    if lookup:
        return {"method": "lookup", "num_speculations": d, "adaptive": adaptive, "lookup": lookup}
    return {"method": "draft", "num_speculations": d, "adaptive": adaptive}


def spell_spec(method: str, fields: dict) -> str:
    """The spelling `read_spec` reads back of a method's fields: `E:d`, `draft:d`, with
    `:adaptive` (d is then the first round's), a stop's or a lookup's, or a tree's (`draft:d:tree`,
    `draft:tree=...`). Fields the grammar does not spell (head, bonus, max) are left out."""
    if method == "tree":
        tree = fields["tree"]
        d = max(map(len, tree))
        if tree == default_tree(d):
            return f"draft:{d}:tree"
        return "draft:tree=" + ",".join("".join(map(str, p)) for p in tree)
    d = fields["num_speculations"]
    drafter = fields["exit_layer"] if method == "layerskip" else "draft"
    if method == "stop":
        return f"{drafter}:{d}:stop={fields['confidence_stop']:g}"
    lookup = fields.get("lookup", 0)
    copies = ":lookup" * bool(lookup) + f"={lookup}" * (lookup not in (0, d))
    return f"{drafter}:{d}" + ":adaptive" * fields["adaptive"] + copies
