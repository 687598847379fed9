"""Each field of a request's `Sequence` has one writer: reading the engine's modules, every
assignment to a Sequence field (`seq.x = ...`, `seq.x += ...`) and every call that changes one in
place (`seq.tokens.extend(...)`) is in one module per field. Fields the request asked for are
written by none (they are set when `Requests.submit` builds it)."""

import ast
import dataclasses
import pathlib

import eejax.engine
from eejax.engine.sequence import Sequence

MUTATORS = {"append", "extend", "clear", "insert", "pop", "remove", "update", "put", "set"}
ASKED = {"id", "prompt", "max_new_tokens", "priority", "exit", "sampling", "spec", "key", "logprobs", "stop",
         "stop_token_ids", "prompt_logprobs", "submitted_at"}  # fmt: skip


def writers() -> dict[str, set[str]]:
    """Sequence field -> the modules of eejax/engine and eejax/serve that write it."""
    fields = {f.name for f in dataclasses.fields(Sequence)}
    root = pathlib.Path(eejax.engine.__file__).parent
    found: dict[str, set[str]] = {}
    for path in [*root.glob("*.py"), *root.parent.joinpath("serve").glob("*.py")]:
        if path.name == "sequence.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
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
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("seq", "s"):
                        if t.attr in fields:
                            found.setdefault(t.attr, set()).add(path.name)
    return found


def test_each_sequence_field_has_one_writer_and_what_the_request_asked_has_none():
    found = writers()
    assert found["tokens"] == {"delivery.py"} and found["slot"] == {"slots.py"}  # the scan sees writes
    assert {name: modules for name, modules in found.items() if len(modules) > 1} == {}
    assert ASKED.isdisjoint(found), {name: found[name] for name in ASKED & set(found)}
