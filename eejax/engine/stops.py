"""Stop strings on detokenised text: where a request's text ends, and how much of a growing text a
stream may show without showing something that a later match cuts away."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


def first_stop(text: str, stops) -> int | None:
    """The index where the earliest full match of any stop string begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def partial_stop(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (a match
    that the next tokens may complete)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def visible_text(text: str, stops, finished: bool) -> str:
    """What of `text` may be shown: cut before the first stop match; while the request runs, also
    without a trailing partial match or an incomplete character (which later tokens may change)."""
    cut = first_stop(text, stops) if stops else None
    if cut is not None:
        return text[:cut]
    if finished:
        return text
    if text.endswith(REPLACEMENT):
        text = text.rstrip(REPLACEMENT)
    return text[: len(text) - partial_stop(text, stops)] if stops else text
