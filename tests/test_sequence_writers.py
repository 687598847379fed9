"""Each piece of a request's `Sequence` has its writers, and each field one: reading the engine's
and the server's modules, every assignment to a piece's field (`seq.output.x = ...`,
`seq.placement.x += ...`) and every call that changes one in place (`seq.output.tokens.extend`)
is in the modules that own that piece, one module per field. The request itself is frozen, and
the Sequence's own reads (`seq.tokens`) have no setter."""

import ast
import dataclasses
import pathlib

import pytest

import eejax.engine
from eejax.engine.sequence import PIECES, Request, Sequence

MUTATORS = {"append", "extend", "clear", "insert", "pop", "remove", "update", "put", "set"}
OWNERS = {"request": set(), "placement": {"slots.py", "admission.py"}, "output": {"delivery.py"}}


def writers() -> dict[tuple[str, str], set[str]]:
    """(piece, field) -> the modules of eejax/engine and eejax/serve that write it; a write to a
    Sequence's field not through its piece is ("sequence", field)."""
    fields = {f.name: piece for piece, cls in PIECES.items() for f in dataclasses.fields(cls)}
    root = pathlib.Path(eejax.engine.__file__).parent
    found: dict[tuple[str, str], set[str]] = {}
    for path in [*root.glob("*.py"), *root.parent.joinpath("serve").glob("*.py")]:
        if path.name == "sequence.py":
            continue
        tree = ast.parse(path.read_text())
        aliases = {  # out = seq.output: a piece under a local name
            node.targets[0].id: node.value.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Attribute) and node.value.attr in PIECES
        }  # fmt: skip
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Subscript):
                        t = t.value
                    if not isinstance(t, ast.Attribute) or t.attr not in fields:
                        continue
                    owner = t.value
                    if isinstance(owner, ast.Attribute) and owner.attr in PIECES:  # seq.output.tokens
                        found.setdefault((owner.attr, t.attr), set()).add(path.name)
                    elif isinstance(owner, ast.Name) and owner.id in aliases:  # out.tokens
                        found.setdefault((aliases[owner.id], t.attr), set()).add(path.name)
                    elif isinstance(owner, ast.Name) and owner.id in ("seq", "s"):  # seq.tokens
                        found.setdefault(("sequence", t.attr), set()).add(path.name)
    return found


def test_each_piece_is_written_by_its_part_and_each_field_by_one_module():
    found = writers()
    assert found[("output", "tokens")] == {"delivery.py"} and found[("placement", "slot")] == {"slots.py"}
    assert {key: modules for key, modules in found.items() if len(modules) > 1} == {}
    assert {key: modules for key, modules in found.items() if not modules <= OWNERS[key[0]]} == {}


def test_the_request_is_frozen_and_the_sequence_reads_its_pieces_without_setters():
    seq = Sequence(Request(3, [5, 6], max_new_tokens=4))
    seq.output.tokens.append(9)
    seq.placement.slot = 2
    assert (seq.id, seq.prompt, seq.tokens, seq.slot, seq.finish_reason) == (3, [5, 6], [9], 2, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        seq.request.max_new_tokens = 8
    for name in ("tokens", "slot", "prompt"):
        with pytest.raises(AttributeError, match="has no setter"):
            setattr(seq, name, None)
