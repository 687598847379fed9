"""Log-probabilities as OpenAI's responses spell them: the legacy completions object (tokens,
token_logprobs, top_logprobs keyed by text, text_offset) and chat's list of content entries.
`token_text` turns one token id into its text."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def completion_logprobs(
    token_text: Callable[[int], str],
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[list[tuple[int, float]] | None],
    offset: int,
) -> dict:
    """OpenAI's legacy completions logprobs of `tokens`, text offsets from `offset`; a None
    log-prob (an echoed prompt's first token) stays null, and so do its alternatives."""
    texts = [token_text(t) for t in tokens]
    offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]

    def alternatives(top) -> dict | None:
        """Keyed by text: of tokens with the same text (bytes of one character, say), the likeliest."""
        if top is None:
            return None
        out: dict = {}
        for token, logprob in top:
            out.setdefault(token_text(token), logprob)
        return out

    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": [alternatives(top) for top in tops],
        "text_offset": offsets,
    }


def chat_logprobs(
    token_text: Callable[[int], str],
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[list[tuple[int, float]]],
) -> dict:
    """OpenAI's chat logprobs of `tokens`: per token its text, log-prob, bytes and alternatives."""

    def entry(token, logprob):
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
            for t, lp, top in zip(tokens, logprobs, tops)
        ]
    }
