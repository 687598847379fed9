"""Chat text for a draft head: questions put to the model through its chat template, answered by
the model itself (greedy, and sampled), so that the head learns the assistant turns it will have
to guess when the model serves chat.

The questions come from instruction files (JSON lines with an `instruction` field and an optional
`input` / `context`), and from the model itself: sampled from its chat template's user-turn prefix
with nothing after it, a chat model writes a user's question of the kind it was tuned on (Magpie,
Xu et al. 2024: "alignment data synthesis from scratch by prompting aligned LLMs with nothing").
Everything the model writes is kept on disk (`draft_corpus._save`'s JSON), so a rerun reuses it.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from eejax.errors import EejaxError

_MARK = "\x00question\x00"  # stands for the user's text while the template is rendered


def _template(tokenizer, text: str) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise EejaxError("the model's tokenizer has no chat template: chat prompts need one")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def chat_prompt(tokenizer, question: str) -> list[int]:
    """Token ids of `question` as the user's turn of the chat template, the assistant's turn opened."""
    return tokenizer(_template(tokenizer, question), add_special_tokens=False)["input_ids"]


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's text begins (its system turn, if the
    template adds one by default, and the user turn's header)."""
    rendered = _template(tokenizer, _MARK)
    return tokenizer(rendered[: rendered.index(_MARK)], add_special_tokens=False)["input_ids"]


def read_instructions(path: str | Path) -> list[str]:
    """The questions of a JSON-lines file (.jsonl, or .jsonl.gz): each row's `instruction` (or
    `question` / `prompt`), followed by its `input` or `context` after a blank line when it has one."""
    p = Path(path)
    if not p.is_file():
        raise EejaxError(f"instructions file not found: {path}")
    out = []
    with gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EejaxError(f"{path} line {i + 1} is not JSON: {e.msg}") from None
            text = row.get("instruction") or row.get("question") or row.get("prompt") if isinstance(row, dict) else row
            if not isinstance(text, str) or not text.strip():
                raise EejaxError(f"{path} line {i + 1} has no instruction, question or prompt")
            extra = (row.get("input") or row.get("context") or "") if isinstance(row, dict) else ""
            out.append(text.strip() + (f"\n\n{extra.strip()}" if extra.strip() else ""))
    if not out:
        raise EejaxError(f"no instructions in {path}")
    return out


def _whole_questions(model, samples, min_words: int, seen) -> list[str]:
    """The distinct questions (not in `seen`) among token lists sampled from `user_turn_prefix`:
    those the model ended with EOS and that have at least `min_words` words."""
    ends, seen, questions = set(model.eos_token_ids), set(seen), []
    for tokens in samples:
        tokens = list(tokens)
        if not tokens or tokens[-1] not in ends:
            continue  # cut off: no whole question
        text = model.tokenizer.decode(tokens[:-1], skip_special_tokens=True).strip()
        if len(text.split()) >= min_words and text not in seen:
            seen.add(text)
            questions.append(text)
    return questions


def self_questions(
    model,
    count: int,
    path: str | Path,
    *,
    max_tokens: int = 64,
    temperature: float = 0.9,
    seed: int = 7,
    batch_size: int = 64,
    min_words: int = 3,
    until: float | None = None,
) -> list[str]:
    """Up to `count` distinct user questions the model writes itself: `count` samples (temperature,
    row i drawn with (seed, i)) from `user_turn_prefix`, kept where the model ended the turn within
    `max_tokens` and wrote at least `min_words` words. Sampled in whole batches of `batch_size`
    (one `generate` over them all would admit rows as others end, prefilling groups of many sizes,
    each a program to compile), and only while `time.monotonic()` is before `until`. Saved in
    `path` as JSON; a rerun with the same settings reads back a set that was not cut short."""
    from eejax.engine.generate import generate
    from eejax.train.data import cache_budget_for

    if count < 1 or max_tokens < 1 or temperature <= 0:
        raise EejaxError(f"self questions need count, max_tokens >= 1 and temperature > 0, got {count}, {max_tokens}")
    path = Path(path)
    settings = {"count": count, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings and saved.get("complete", True):
            return saved["questions"]
    prefix = user_turn_prefix(model.tokenizer)
    budget = cache_budget_for(model, [prefix] * batch_size, max_tokens, batch_size)
    questions: list[str] = []
    complete = True
    for start in range(0, count, batch_size):
        if until is not None and time.monotonic() > until:
            complete = False
            break
        res = generate(
            model,
            [prefix] * min(batch_size, count - start),
            max_new_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            row_offset=start,
            batch_size=batch_size,
            cache_budget=budget,
            spec=None,  # full depth's samples (a draft head would change them, not their distribution)
        )
        questions += _whole_questions(model, res.tokens, min_words, seen=questions)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"settings": settings, "questions": questions, "complete": complete}))
    tmp.replace(path)
    return questions
