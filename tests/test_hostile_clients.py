"""`eejax serve` (a real process on 127.0.0.1) against careless and hostile clients: every bad
request gets a 4xx naming its problem, never a 5xx; after each, a canary greedy request returns
its known tokens and /health is ok; twenty temperatures compile nothing new."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

import eejax
from tests.helpers import start_eejax_serve

CANARY = {"prompt": "The river rose", "max_tokens": 8}
LONG_PROMPT = "word " * 2000


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tiny_model):
    ckpt = tiny_checkpoints["gqa-untied"][2]
    proc, url = start_eejax_serve(
        ckpt,
        "--max-slots",
        2,
        "--max-tokens-limit",
        16,
        "--cache-budget",
        "4MiB",
        "--max-body-size",
        "1MiB",
        "--shutdown-timeout",
        5,
    )
    want = eejax.generate(tiny_model, [CANARY["prompt"]], max_new_tokens=CANARY["max_tokens"]).tokens[0]
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client, want
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def chat(*messages, **fields) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **fields}


# (path, body: dict as JSON, or raw bytes, expected status, a piece of the error message)
HOSTILE = {
    # sampling and speculation beyond the model: they used to stop the engine thread
    "top_k above the vocabulary": (
        "/v1/completions",
        {"prompt": "hi", "top_k": 50000, "temperature": 0.7},
        400,
        "top_k must be <= the vocabulary size 320",
    ),
    "a hundred thousand drafts": ("/v1/completions", {"prompt": "hi", "spec": "1:100000"}, 400, "[1, 64]"),
    "speculation as deep as the model": ("/v1/completions", {"prompt": "hi", "spec": "3:2"}, 400, "below"),
    "static exit past the model": ("/v1/completions", {"prompt": "hi", "exit": "static:100000"}, 400, "deeper"),
    "NaN threshold": ("/v1/completions", {"prompt": "hi", "exit": "softmax:nan"}, 400, "exit"),
    # bad unicode, deep and huge bodies
    "lone surrogate in a prompt": (
        "/v1/completions",
        b'{"prompt": "ab\\ud800cd", "max_tokens": 2}',
        400,
        "prompt: not valid Unicode",
    ),
    "lone surrogate in a chat message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "not valid Unicode",
    ),
    "lone surrogate in a key": ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}', 400, "not valid Unicode"),
    "invalid UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "malformed JSON"),
    "100k-deep JSON": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deep"),
    "100k-deep JSON in a field": (
        "/v1/completions",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        "nested too deep",
    ),
    "10 MB prompt": ("/v1/completions", {"prompt": "x" * 10_000_000}, 413, "over 1048576 bytes"),
    "prompt longer than the context": ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "context"),
    # wrong types and values, as pydantic's strict schema sees them
    "prompt of booleans": ("/v1/completions", {"prompt": [True, False]}, 400, "prompt"),
    "prompt token out of range": ("/v1/completions", {"prompt": [5, 999999]}, 400, "token ids"),
    "negative prompt token": ("/v1/completions", {"prompt": [5, -3]}, 400, "token ids"),
    "65 prompts": ("/v1/completions", {"prompt": ["a"] * 65}, 400, "exceeds 64 completions"),
    "an empty prompt in a batch": ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt 1 of the batch is empty"),
    "stream as a string": ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    "role wizard": ("/v1/chat/completions", chat(("wizard", "hi")), 400, "messages.0.role"),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "messages not a list": ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    "content an image": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        400,
        "messages.0.content",
    ),
    "temperature Infinity": ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    "temperature NaN": ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "temperature as a string": ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    "priority 1e30": ("/v1/completions", {"prompt": "hi", "priority": 1e30}, 400, "priority"),
    "max_tokens 1e100": ("/v1/completions", {"prompt": "hi", "max_tokens": 1e100}, 400, "max_tokens"),
    "max_tokens beyond the server's": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    "negative max_completion_tokens": (
        "/v1/chat/completions",
        chat(("user", "hi"), max_completion_tokens=-1),
        400,
        "max_completion_tokens",
    ),
    "seed past 64 bits": ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    "n a billion": ("/v1/completions", {"prompt": "hi", "n": 10**9}, 400, "n"),
    "top_p 0": ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    "top_p 1.5": ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "top_k -5": ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    "logprobs -1": ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    "stop_token_ids negative": ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    "five stop strings": ("/v1/completions", {"prompt": "hi", "stop": list("abcde")}, 400, "stop"),
    "logit_bias": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    # bodies that are not requests
    "empty body": ("/v1/completions", b"", 400, "malformed JSON"),
    "a list": ("/v1/completions", b"[]", 400, "JSON object"),
    "a string": ("/v1/completions", b'"hi"', 400, "JSON object"),
    "null": ("/v1/completions", b"null", 400, "JSON object"),
    "truncated JSON": ("/v1/completions", b'{"prompt": "hi"', 400, "malformed JSON"),
    "model not served": ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_request_gets_a_4xx_and_the_server_serves_on(server, case):
    client, want = server
    path, body, status, needle = HOSTILE[case]
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text[:500]
    assert needle in r.json()["error"]["message"], r.text[:500]
    canary = client.post("/v1/completions", json=CANARY)
    assert canary.status_code == 200 and canary.json()["eejax"]["tokens"] == want
    assert client.get("/health").json()["status"] == "ok"


def test_unknown_fields_are_ignored(server):
    client, want = server
    r = client.post("/v1/completions", json={**CANARY, "frobnicate": [1, {"x": None}], "user": "me"})
    assert r.status_code == 200 and r.json()["eejax"]["tokens"] == want


def test_a_body_over_the_cap_is_refused_before_it_is_all_read(server):
    """Declared too large: 413 at once; chunked with no length: 413 once the cap is passed."""
    client, want = server
    host, port = client.base_url.host, client.base_url.port
    with socket.create_connection((host, port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n{"
        )
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert client.post("/v1/completions", json=CANARY).json()["eejax"]["tokens"] == want


def test_twenty_temperatures_compile_no_new_program(server):
    client, _ = server

    def programs() -> float:
        metrics = client.get("/metrics").text
        return float(
            next(line.split()[1] for line in metrics.splitlines() if line.startswith("eejax_compiled_programs "))
        )

    body = {"prompt": "The river", "max_tokens": 4, "seed": 1}
    for warm in ({"temperature": 0.5}, {"temperature": 0.5, "top_k": 7, "top_p": 0.9}):  # the two samplers
        client.post("/v1/completions", json={**body, **warm})
    before = programs()
    texts = set()
    for i in range(20):
        r = client.post(
            "/v1/completions", json={**body, "temperature": 0.1 + 0.2 * i, "top_k": i * 10, "top_p": 1 - i / 40}
        )
        assert r.status_code == 200
        texts.add(json.dumps(r.json()["eejax"]["tokens"]))
    assert programs() == before and len(texts) > 1
