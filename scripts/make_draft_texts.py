"""Makes two training files of `eejax train-draft` (provenance: data/SOURCES.md):

    data/self_instruct_instructions.jsonl   the 175 seed tasks and 252 user-oriented instructions of
                                            self-instruct (Apache-2.0), one {"instruction", "input"} a line
    data/python_stdlib_text.txt.gz          docstrings and source of Python 3.11 standard-library modules
                                            (PSF license), documents separated by two blank lines

    python scripts/make_draft_texts.py SELF_INSTRUCT_CHECKOUT

SELF_INSTRUCT_CHECKOUT holds data/seed_tasks.jsonl and human_eval/user_oriented_instructions.jsonl
(yizhongw/self-instruct). The standard library is this Python's; `pydoc_data` (the pydoc topics, an
evaluation text) is never read.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = (  # documented, pure-Python modules of many kinds
    "argparse",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "glob",
    "heapq",
    "html.parser",
    "http.client",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "typing",
    "unittest.case",
    "urllib.parse",
    "uuid",
    "wave",
    "zipfile",
)


def docs(module) -> str:
    """The module's docstring, then each public function's and class's signature and docstring."""
    parts = [f"{module.__name__}\n\n{inspect.getdoc(module) or ''}"]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not inspect.getdoc(obj):
            continue
        try:
            sig = str(inspect.signature(obj))
        except (TypeError, ValueError):
            sig = "(...)"
        kind = "class" if inspect.isclass(obj) else "def"
        parts.append(f"{kind} {name}{sig}\n    " + inspect.getdoc(obj).replace("\n", "\n    "))
    return "\n\n".join(parts)


def main(checkout: str) -> None:
    rows = []
    for rel in ("data/seed_tasks.jsonl", "human_eval/user_oriented_instructions.jsonl"):
        for line in (Path(checkout) / rel).read_text().splitlines():
            task = json.loads(line)
            first = (task.get("instances") or [{}])[0].get("input", "")
            rows.append({"instruction": task["instruction"], "input": first})
    out = ROOT / "data/self_instruct_instructions.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = []
    for name in MODULES:
        module = importlib.import_module(name)
        texts.append(docs(module))
        texts.append(
            f"# {Path(module.__file__).name}\n" + "\n".join(Path(module.__file__).read_text().splitlines()[:400])
        )
    text = "\n\n\n".join(t.replace("\n\n\n", "\n\n") for t in texts)
    (ROOT / "data/python_stdlib_text.txt.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
    print(f"{len(rows)} instructions, {len(texts)} standard-library documents (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main(*sys.argv[1:])
