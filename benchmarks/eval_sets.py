"""The evaluation prompts of the drafting benchmarks, by set: text no draft head trains on.

    cnndm    CNN/DM rows 0..n-1 (data/cnndm_test_dev100.jsonl): the article's first tokens + "Summary:"
    mtbench  MT-bench's first turns (data/mt_bench_questions.jsonl, lm-sys/FastChat), through the chat
             template, one category after another (n = 8: one question of each category)
    pydoc    Python's bundled pydoc topics (`pydoc_data.topics`), every 10th topic's first tokens,
             continued as plain text
    code     coding requests written for this benchmark, through the chat template
    chat     everyday questions written for this benchmark, through the chat template

`prompts(tokenizer, name, n, prompt_tokens)` gives the token ids; `prompt_tokens` cuts the plain-text
sets (cnndm, pydoc) only.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from eejax.bench.prompts import CHAT, CODE, pydoc_texts  # written for the benchmarks; `eejax bench` ships them

ROOT = Path(__file__).resolve().parent.parent
SETS = ("cnndm", "mtbench", "pydoc", "code", "chat")


def _chat(tokenizer, questions) -> list[list[int]]:
    from eejax.train.chat_corpus import chat_prompt

    return [chat_prompt(tokenizer, q) for q in questions]


def mtbench_questions(n: int) -> list[str]:
    """The first turns of n MT-bench questions, taking the categories in turn."""
    rows = [json.loads(line) for line in (ROOT / "data" / "mt_bench_questions.jsonl").read_text().splitlines()]
    by_category: dict[str, list[str]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    interleaved = [q for group in itertools.zip_longest(*by_category.values()) for q in group if q is not None]
    return interleaved[:n]


def prompts(tokenizer, name: str, n: int, prompt_tokens: int = 256) -> list[list[int]]:
    """Token ids of the first n prompts of set `name` (see the module docstring); a ValueError
    where the set has fewer."""
    out = _prompts(tokenizer, name, n, prompt_tokens)
    if len(out) < n:
        raise ValueError(f"the evaluation set {name!r} has {len(out)} prompts, {n} were asked for")
    return out


def _prompts(tokenizer, name: str, n: int, prompt_tokens: int) -> list[list[int]]:
    if name == "cnndm":
        from benchmarks.early_exit import summary_prompts

        return summary_prompts(tokenizer, n, prompt_tokens)[0]
    if name == "mtbench":
        return _chat(tokenizer, mtbench_questions(n))
    if name == "pydoc":
        return [tokenizer(t)["input_ids"][:prompt_tokens] for t in pydoc_texts()[:n]]
    if name == "code":
        return _chat(tokenizer, CODE[:n])
    if name == "chat":
        return _chat(tokenizer, CHAT[:n])
    raise ValueError(f"no evaluation set {name!r}; the sets: {', '.join(SETS)}")
