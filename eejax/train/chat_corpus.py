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
import hashlib
import json
import time
from collections.abc import Sequence
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


def _whole_questions(model, samples, min_words: int, seen, starts=None) -> list[str]:
    """The distinct questions (not in `seen`) among token lists sampled from `user_turn_prefix`
    (each after its `starts` ids, which begin its text): those the model ended with EOS and that have
    at least `min_words` words."""
    ends, seen, questions = set(model.eos_token_ids), set(seen), []
    for i, tokens in enumerate(samples):
        tokens = list(tokens)
        if not tokens or tokens[-1] not in ends:
            continue  # cut off: no whole question
        begun = [] if starts is None else list(starts[i])
        text = model.tokenizer.decode(begun + tokens[:-1], skip_special_tokens=True).strip()
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
    starts: Sequence[str] = (),
    exclude: Sequence[str] = (),
    progress: bool = False,
) -> list[str]:
    """Up to `count` distinct user questions the model writes itself: `count` samples (temperature,
    row i drawn with (seed, i)) from `user_turn_prefix`, kept where the model ended the turn within
    `max_tokens` and wrote at least `min_words` words, and none of `exclude`. With `starts`, row i's
    question begins with `starts[i % len(starts)]` ("" for none) and the model writes the rest:
    openings that steer it to kinds of requests it seldom writes unprompted. Sampled in whole
    batches of `batch_size` (one `generate` over them all would admit rows as others end,
    prefilling groups of many sizes, each a program to compile), and only while `time.monotonic()`
    is before `until`. Saved in `path` as JSON after every batch; a rerun with the same settings
    goes on after the last saved batch, and gives the questions of an uncut run."""
    from tqdm.auto import tqdm

    from eejax.engine.generate import generate
    from eejax.train.data import cache_budget_for

    if count < 1 or max_tokens < 1 or temperature <= 0:
        raise EejaxError(f"self questions need count, max_tokens >= 1 and temperature > 0, got {count}, {max_tokens}")
    path = Path(path)
    settings = {"count": count, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    if starts:
        settings["starts"] = list(starts)
    if exclude:
        settings["exclude"] = hashlib.sha256(json.dumps(sorted(set(exclude))).encode()).hexdigest()[:16]
    questions: list[str] = []
    sampled = 0
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings:
            if saved.get("complete", True):
                return saved["questions"]
            questions, sampled = saved["questions"], saved.get("sampled", 0)
    prefix = user_turn_prefix(model.tokenizer)
    opening = [model.tokenizer(s, add_special_tokens=False)["input_ids"] if s else [] for s in starts] or [[]]
    longest = prefix + max(opening, key=len)
    budget = cache_budget_for(model, [longest] * batch_size, max_tokens, batch_size)
    bar = tqdm(total=count, initial=sampled, desc="questions", unit="sample", disable=not progress)
    for start in range(sampled, count, batch_size):
        if until is not None and time.monotonic() > until:
            break
        rows = range(start, min(start + batch_size, count))
        begun = [opening[i % len(opening)] for i in rows]
        res = generate(
            model,
            [prefix + b for b in begun],
            max_new_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            row_offset=start,
            batch_size=batch_size,
            cache_budget=budget,
            spec=None,  # full depth's samples (a draft head would change them, not their distribution)
        )
        questions += _whole_questions(model, res.tokens, min_words, seen=[*exclude, *questions], starts=begun)
        sampled = rows.stop
        _save_questions(path, settings, questions, sampled, complete=sampled >= count)
        bar.update(len(rows))
    bar.close()
    if sampled == 0:  # out of time before the first batch: a file that says so
        _save_questions(path, settings, questions, sampled, complete=False)
    return questions


def _save_questions(path: Path, settings: dict, questions: list[str], sampled: int, complete: bool) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"settings": settings, "questions": questions, "sampled": sampled, "complete": complete}))
    tmp.replace(path)
