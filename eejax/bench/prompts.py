"""The prompts a bench run decodes, as token ids: a built-in set or a JSON-lines file.

    chat    everyday questions written for eejax's benchmarks, through the model's chat template
    code    coding requests written for eejax's benchmarks, through the chat template
    pydoc   Python's bundled pydoc topics (`pydoc_data.topics`), every 10th, continued as plain text

No draft head or exit eejax ships was trained on them. A file gives one JSON string or object per
line (the prompt in its prompt / text / article / document field); an object's `reference` (or
another field named) is a reference text, for ROUGE-L."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eejax.errors import EejaxError

PROMPT_FIELDS = ("prompt", "text", "article", "document")

CODE = (  # written for eejax's benchmarks (2026-11-29); no training set holds them
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class Stack with push, pop and peek methods.",
    "Write a Python function that counts how often each word occurs in a text file.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "Write a Python function that reads a CSV file and returns the average of one column.",
    "Write a JavaScript function that removes duplicate values from an array.",
)
CHAT = (  # written for eejax's benchmarks (2026-11-29); no training set holds them
    "What are some good ways to stay focused while working from home?",
    "Explain why the sky is blue in simple terms.",
    "Give me three ideas for a healthy dinner that takes less than 30 minutes.",
    "What is the difference between a virus and a bacterium?",
    "How can I improve my public speaking skills?",
    "Summarize the main causes of the French Revolution.",
    "What should I pack for a weekend hiking trip?",
    "Why is sleep important for learning?",
)
SETS = ("chat", "code", "pydoc")


@dataclasses.dataclass(frozen=True)
class BenchPrompts:
    """`ids`: each prompt's token ids; `references`: a reference text per prompt, or None."""

    name: str
    ids: list[list[int]]
    references: list[str] | None = None


def pydoc_texts() -> list[str]:
    """Every 10th of Python's bundled pydoc topics, in name order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [topics[k] for k in sorted(topics)[::10]]


def bench_prompts(
    tokenizer,
    data: str,
    n: int,
    prompt_tokens: int = 256,
    chat: bool = False,
    field: str | None = None,
    reference_field: str | None = None,
    suffix: str = "",
) -> BenchPrompts:
    """The first `n` prompts of `data`, a set name (`SETS`) or a .jsonl file. Plain text is cut to
    its first `prompt_tokens` tokens, `suffix` included after the cut (e.g. "\\n\\nSummary:");
    `chat` puts a file's prompts through the chat template (the chat and code sets always are).
    An EejaxError names a set or file with fewer than n."""
    from eejax.train.chat_corpus import chat_prompt

    references = None
    if data in ("chat", "code"):
        texts, chat = list(CHAT if data == "chat" else CODE), True
    elif data == "pydoc":
        texts = pydoc_texts()
    elif Path(data).is_file():
        texts, references = read_file(data, field, reference_field)
    else:
        raise EejaxError(f"--data {data}: neither a file nor one of the sets {', '.join(SETS)}")
    if len(texts) < n:
        raise EejaxError(f"{data} has {len(texts)} prompts; {n} were asked for (--prompts)")
    texts = texts[:n]
    if chat:
        ids = [chat_prompt(tokenizer, t) for t in texts]
    else:
        tail = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
        if len(tail) >= prompt_tokens:
            raise EejaxError(f"the prompt suffix takes {len(tail)} tokens, --prompt-tokens is {prompt_tokens}")
        ids = [tokenizer(t)["input_ids"][: prompt_tokens - len(tail)] + tail for t in texts]
    if any(not row for row in ids):
        raise EejaxError(f"{data}: an empty prompt")
    return BenchPrompts(data, ids, None if references is None else references[:n])


def read_file(path: str, field: str | None, reference_field: str | None) -> tuple[list[str], list[str] | None]:
    """Prompts (and references, where `reference_field` or a `reference` field holds them) of a
    .jsonl file: one JSON string or object a line, the prompt in `field` or the first of
    `PROMPT_FIELDS` an object has."""
    p = Path(path)
    if not p.is_file():
        raise EejaxError(f"prompts file not found: {path}")
    prompts, references = [], []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EejaxError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict):
            raise EejaxError(f"{path}:{n}: expected a JSON string or object")
        name = field or next((f for f in PROMPT_FIELDS if f in row), None)
        if name is None or name not in row:
            wanted = field or " / ".join(PROMPT_FIELDS)
            raise EejaxError(f"{path}:{n}: no {wanted} field (choose one with --prompt-field)")
        prompts.append(str(row[name]))
        ref = reference_field or "reference"
        if ref in row:
            references.append(str(row[ref]))
        elif reference_field is not None:
            raise EejaxError(f"{path}:{n}: no {reference_field} field (--reference-field)")
    if not prompts:
        raise EejaxError(f"no prompts in {path}")
    if references and len(references) != len(prompts):
        raise EejaxError(f"{path}: {len(references)} of {len(prompts)} rows have a reference; give all or none")
    return prompts, references or None
