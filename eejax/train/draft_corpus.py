"""The text a draft head trains on: news articles (CNN/DM rows that no evaluation uses), more
human text, and the frozen model's own continuations of prompts made from them (the distribution
the draft will have to guess at decoding time), kept on disk so a rerun does not generate them
again:

- summary prompts: each article's first n tokens + "Summary:" (the evaluation's format), and
  later windows of it + "Summary:" (`window_summary_prompts`), continued greedily, and sampled
  (temperature 0.7) for other likely texts;
- windows of the other documents, continued greedily (`text_prompts`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eejax.errors import EejaxError

EVAL_ROWS = 20  # rows 0..19 of data/cnndm_test_dev100.jsonl are evaluation rows: never trained on
SUMMARY_SUFFIX = "\n\nSummary:"


def articles(path: str | Path, *, skip_rows: int = EVAL_ROWS) -> list[str]:
    """The `article` (or `text`) field of each JSON line of `path` (.jsonl or .jsonl.gz) after its
    first `skip_rows` rows."""
    import gzip

    rows = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < skip_rows or not line.strip():
                continue
            row = json.loads(line)
            text = row.get("article") or row.get("text") or row.get("document")
            if not text:
                raise EejaxError(f"{path} line {i + 1} has no article, text or document field")
            rows.append(text)
    if not rows:
        raise EejaxError(f"{path} has no rows after the first {skip_rows}")
    return rows


def summary_prompts(tokenizer, texts: list[str], prompt_tokens=(128, 256, 384)) -> list[list[int]]:
    """For each text and each length n: its first n tokens (or all, if shorter) + "Summary:", the
    evaluation's prompt format at several lengths."""
    suffix = tokenizer(SUMMARY_SUFFIX)["input_ids"]
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        for n in sorted(set(prompt_tokens)):
            out.append(ids[:n] + suffix)
            if len(ids) <= n:
                break
    return out


SUMMARY_WINDOWS = ((128, 256), (256, 256), (64, 320))  # (offset, tokens) of later article windows
TEXT_WINDOWS = (0, 512, 1024)  # offsets of the 256-token windows of other documents


def window_summary_prompts(tokenizer, texts: list[str], windows=SUMMARY_WINDOWS) -> list[list[int]]:
    """For each text and each (offset, n): tokens offset..offset+n + "Summary:", where the text
    has more than offset + 64 tokens."""
    suffix = tokenizer(SUMMARY_SUFFIX)["input_ids"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return [x[o : o + n] + suffix for x in ids for o, n in windows if len(x) > o + 64]


def text_prompts(tokenizer, texts: list[str], offsets=TEXT_WINDOWS, length: int = 256) -> list[list[int]]:
    """Windows of `length` tokens of each text at `offsets`, where it has more than offset + 64."""
    ids = [tokenizer(t)["input_ids"] for t in texts]
    return [x[o : o + length] for x in ids for o in offsets if len(x) > o + 64]


def sampled_continuations(
    model,
    prompts: list[list[int]],
    path: str | Path,
    *,
    new_tokens: int = 96,
    temperature: float = 0.7,
    seed: int = 1,
    batch_size: int = 32,
    progress: bool = True,
) -> list[list[int]]:
    """Each prompt followed by a sampled continuation (prompt i draws with (seed, i), as in one
    `generate` call over them all: a prompt given twice gets two samples), `batch_size` at once
    (`data.cache_budget_for`), saved as JSON in `path` after each batch: a rerun with the same
    prompts and settings, or a run cut short, goes on after the last saved one."""
    from tqdm.auto import tqdm

    from eejax.engine.generate import generate
    from eejax.train.data import cache_budget_for

    path = Path(path)
    done: list[list[int]] = []
    if path.exists():
        saved = json.loads(path.read_text())
        settings = (saved.get("seed", seed), saved.get("temperature", temperature))  # a complete file may lack them
        same = saved.get("prompts") == prompts and saved.get("new_tokens") == new_tokens
        if same and settings == (seed, temperature):
            done = saved["sequences"]
    starts = range(len(done), len(prompts), batch_size)
    for start in tqdm(starts, desc="sampling continuations", disable=not progress):
        chunk = prompts[start : start + batch_size]
        budget = cache_budget_for(model, chunk, new_tokens, batch_size)
        res = generate(
            model,
            chunk,
            max_new_tokens=new_tokens,
            temperature=temperature,
            seed=seed,
            row_offset=start,
            batch_size=batch_size,
            cache_budget=budget,
            spec=None,  # full depth's samples (a draft head would change them, not their distribution)
        )
        done += [list(p) + list(t) for p, t in zip(chunk, res.tokens)]
        _save(path, prompts, new_tokens, done, seed=seed, temperature=temperature)
    if not path.exists():
        _save(path, prompts, new_tokens, done, seed=seed, temperature=temperature)
    return done


def continuations(
    model,
    prompts: list[list[int]],
    path: str | Path,
    *,
    new_tokens: int = 96,
    batch_size: int = 32,
    progress: bool = True,
) -> list[list[int]]:
    """Each prompt followed by the model's greedy continuation, saved as JSON in `path` after each
    batch: a rerun (or a run cut short) continues only the prompts the file does not hold yet
    with the same `new_tokens`."""
    from tqdm.auto import tqdm

    from eejax.train.data import continued_sequences

    path = Path(path)
    done: dict[tuple[int, ...], list[int]] = {}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("new_tokens") == new_tokens:
            done = {tuple(p): s for p, s in zip(saved["prompts"], saved["sequences"])}
    todo = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in done))
    for start in tqdm(range(0, len(todo), batch_size), desc="generating continuations", disable=not progress):
        chunk = todo[start : start + batch_size]
        made = continued_sequences(model, [list(p) for p in chunk], new_tokens, batch_size=batch_size, progress=False)
        done.update(zip(chunk, made))
        _save(path, [list(p) for p in done], new_tokens, list(done.values()))
    if not path.exists():
        _save(path, [], new_tokens, [])
    return [done[tuple(p)] for p in prompts]


def _save(path: Path, prompts, new_tokens: int, sequences, **settings) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"prompts": prompts, "new_tokens": new_tokens, "sequences": sequences, **settings}))
    os.replace(tmp, path)
