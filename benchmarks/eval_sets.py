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

ROOT = Path(__file__).resolve().parent.parent
SETS = ("cnndm", "mtbench", "pydoc", "code", "chat")

CODE = (  # written for this benchmark (2026-11-29); no training set holds them
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class Stack with push, pop and peek methods.",
    "Write a Python function that counts how often each word occurs in a text file.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "Write a Python function that reads a CSV file and returns the average of one column.",
    "Write a JavaScript function that removes duplicate values from an array.",
)
CHAT = (  # written for this benchmark (2026-11-29); no training set holds them
    "What are some good ways to stay focused while working from home?",
    "Explain why the sky is blue in simple terms.",
    "Give me three ideas for a healthy dinner that takes less than 30 minutes.",
    "What is the difference between a virus and a bacterium?",
    "How can I improve my public speaking skills?",
    "Summarize the main causes of the French Revolution.",
    "What should I pack for a weekend hiking trip?",
    "Why is sleep important for learning?",
)


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
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        texts = [topics[k] for k in sorted(topics)[::10]][:n]
        return [tokenizer(t)["input_ids"][:prompt_tokens] for t in texts]
    if name == "code":
        return _chat(tokenizer, CODE[:n])
    if name == "chat":
        return _chat(tokenizer, CHAT[:n])
    raise ValueError(f"no evaluation set {name!r}; the sets: {', '.join(SETS)}")
