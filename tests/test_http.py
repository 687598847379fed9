"""The OpenAI-compatible HTTP API on a real server on 127.0.0.1."""

import json
import socket
import time

import httpx
import pytest

import eejax
from eejax.engine.engine import Engine
from eejax.serve.http import create_app
from tests.helpers import cnndm_rows, serve_in_thread, start_eejax_serve


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=32, cache_budget="4MiB", page_size=8)
    with serve_in_thread(engine) as url:
        yield url, engine


def test_completions_equal_generate(server, tiny_model):
    url, _ = server
    prompts = ["The river rose", "Officials said that the", "Hello"]
    want = eejax.generate(tiny_model, prompts, max_new_tokens=9)  # rows do not depend on their batch
    with httpx.Client(base_url=url, timeout=120) as client:
        for i, p in enumerate(prompts):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 9})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["eejax"]["tokens"] == want.tokens[i]
            assert body["choices"][0]["text"] == want.texts[i]
        # Streaming: the concatenated deltas are the text.
        with client.stream(
            "POST", "/v1/completions", json={"prompt": prompts[0], "max_tokens": 9, "stream": True}
        ) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want.texts[0]
        # eejax extras: a request's own early-exit option.
        r = client.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 6, "exit": "static:1"})
        want = eejax.generate(tiny_model, [prompts[1]], max_new_tokens=6, exit="static:1")
        assert r.json()["eejax"]["tokens"] == want.tokens[0] and r.json()["eejax"]["exit_layers"] == want.exit_layers[0]
        # Sampling fields reach the engine: top_k = 1 at temperature 1 is greedy, temperature 5 is not.
        greedy = eejax.generate(tiny_model, [prompts[2]], max_new_tokens=12).tokens[0]
        r = client.post(
            "/v1/completions", json={"prompt": prompts[2], "max_tokens": 12, "temperature": 1.0, "top_k": 1}
        ).json()
        assert r["eejax"]["tokens"] == greedy
        hot = [
            client.post(
                "/v1/completions", json={"prompt": prompts[2], "max_tokens": 12, "temperature": 5.0, "top_p": 1.0}
            ).json()["eejax"]["tokens"]
            for _ in range(2)
        ]
        assert greedy not in hot and hot[0] != hot[1]
        r = client.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 7, "spec": "1:2"}).json()
        assert r["eejax"]["tokens"] == eejax.generate(tiny_model, [prompts[1]], max_new_tokens=7).tokens[0]
        assert 0 <= r["eejax"]["acceptance_rate"] <= 1
        assert client.get("/health").json()["status"] == "ok"
        metrics = client.get("/metrics").text
        assert "eejax_kv_pages_used 0.0" in metrics and "eejax_time_to_first_token_seconds_count 9.0" in metrics
        values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        assert float(values["eejax_spec_acceptance_rate"]) == pytest.approx(r["eejax"]["acceptance_rate"])
        assert float(values["eejax_tokens_per_second"]) > 0


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b"{not json", 400, "malformed JSON"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"prompt": "word " * 2000, "max_tokens": 4}, 400, "context"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "suffix": "then"}, 400, "suffix"),
        ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": [True, False]}, 400, "prompt"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "priority": 1e30}, 400, "priority"),
        ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "hi", "top_p": "high"}, 400, "top_p"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "exit": "entropy:0.5"}, 400, "unknown exit measure"),
        ({"prompt": "hi", "spec": "9:2"}, 400, "below"),
    ],
)
def test_bad_input(server, body, status, needle):
    url, _ = server
    with httpx.Client(base_url=url, timeout=60) as client:
        r = (
            client.post("/v1/completions", content=body)
            if isinstance(body, bytes)
            else client.post("/v1/completions", json=body)
        )
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_64_concurrent_clients_some_streaming_some_leaving(server, tiny_model):
    """Mixed prompt lengths, half of them after one long shared prefix (the prefix cache); a third
    stream, some of those hang up after two chunks; everyone who stayed gets exactly the greedy
    tokens the request gets alone, and afterwards every KV page is free."""
    import asyncio

    url, engine = server
    words = "the river rose above the bank and officials said".split()
    prefix = cnndm_rows(2)[1]["article"][:150] + " "
    prompts = [
        prefix + " ".join(words[: 1 + i % 9])
        if i % 2
        else " ".join(words[j % len(words)] for j in range(1 + (i * 7) % 40))
        for i in range(64)
    ]
    hits = engine.counters["prefix_cache_hit_tokens"]

    async def client(i: int, http: httpx.AsyncClient):
        body = {"prompt": prompts[i], "max_tokens": 4 + i % 9}
        if i % 3:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.status_code, r.json()["eejax"]["tokens"]
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if i % 2 and len(chunks) == 2:
                        return "left", None
            return r.status_code, chunks[-1]["eejax"]["tokens"]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return await asyncio.gather(*(client(i, http) for i in range(64)))

    results = asyncio.run(main())
    alone = eejax.generate(tiny_model, prompts, max_new_tokens=12).tokens  # token i needs only those before it
    for i, (status, tokens) in enumerate(results):
        if status == "left":
            continue
        assert status == 200, (i, status)
        assert tokens == alone[i][: 4 + i % 9], i
    deadline = time.time() + 30
    while engine.metrics()["kv_pages_used"] and time.time() < deadline:
        time.sleep(0.1)
    m = engine.metrics()
    assert m["kv_pages_used"] == 0 and m["running"] == 0 and m["waiting"] == 0, m
    assert m["prefix_cache_hit_tokens"] - hits >= 16 * 32  # most of the 32 prefixed prompts shared its pages


def test_a_stream_whose_client_hangs_up_is_cancelled_at_once(server, monkeypatch):
    """Steps slowed to 30 ms: the 32 tokens would take 0.9 s; the client leaves after two chunks
    and its request ends (cancelled, slot and pages free) long before that."""
    url, engine = server
    real_step = engine.step

    def slow_step():
        real_step()
        time.sleep(0.03)

    def cancelled() -> float:
        text = engine.prometheus.render(engine.metrics()).decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('eejax_requests_total{finish_reason="cancelled"}')
        )

    before = cancelled()
    monkeypatch.setattr(engine, "step", slow_step)
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "The river", "max_tokens": 32, "stream": True}
        ) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 2:
                    break
        left = time.time()

    # The loop frees the slot and pages, then counts the request finished: wait for all three.
    def ended() -> bool:
        return not engine.running and not engine.metrics()["kv_pages_used"] and cancelled() == before + 1

    while not ended() and time.time() < left + 5:
        time.sleep(0.005)
    assert ended() and time.time() - left < 0.45
    assert engine.metrics()["kv_pages_used"] == 0


def test_chat_completions_use_the_chat_template(server, tiny_model):
    url, engine = server
    messages = [{"role": "user", "content": "The river rose"}]
    tokenizer = engine.model.tokenizer
    with httpx.Client(base_url=url, timeout=120) as client:
        if getattr(tokenizer, "chat_template", None) is None:
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
            tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
        try:
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
            assert r.status_code == 200, r.text
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            want = eejax.generate(tiny_model, [list(ids)], max_new_tokens=5)
            body = r.json()
            assert body["object"] == "chat.completion" and body["eejax"]["tokens"] == want.tokens[0]
            assert body["choices"][0]["message"]["role"] == "assistant"
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
            assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        finally:
            tokenizer.chat_template = None


def test_eejax_serve_finishes_in_flight_requests_on_sigterm_and_exits_by_its_deadline(tiny_checkpoints):
    """SIGTERM mid-stream: the stream ends normally; a client stuck sending its body (which would
    hold uvicorn's graceful shutdown open forever) is dropped at --shutdown-timeout."""
    import signal

    ckpt = str(tiny_checkpoints["gqa-untied"][2])
    proc, url = start_eejax_serve(
        ckpt,
        "--max-slots",
        2,
        "--max-tokens-limit",
        64,
        "--cache-budget",
        "4MiB",
        "--pages",
        "grow",
        "--warmup",
        8,
        "--shutdown-timeout",
        4,
    )
    stuck = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    try:
        stuck.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )  # and nothing more
        with httpx.Client(base_url=url, timeout=120) as client:
            assert (
                client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": ckpt}).status_code == 200
            )
            chunks = []
            with client.stream(
                "POST", "/v1/completions", json={"prompt": "The river rose", "max_tokens": 40, "stream": True}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) == 2:
                            proc.send_signal(signal.SIGTERM)  # mid-stream
                            signalled = time.time()
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert len(chunks[-1]["eejax"]["tokens"]) >= 2
        assert proc.wait(timeout=60) == 0
        assert time.time() - signalled < 4 + 1 + 10  # the deadline, a second's grace, this machine's slack
        out = proc.stdout.read()
        assert "compiling" in out and "timeout graceful shutdown exceeded" in out  # --warmup's bar; the stuck client
    finally:
        stuck.close()
        if proc.poll() is None:
            proc.kill()


def test_over_capacity_is_429(tiny_model):
    from fastapi.testclient import TestClient

    engine = Engine(tiny_model, max_slots=1, max_new_tokens=8, cache_budget="4MiB", page_size=8)
    engine.start()
    try:
        with TestClient(create_app(engine, served_model_name="tiny", max_waiting=0)) as client:
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    finally:
        engine.stop()
    assert r.status_code == 429 and "capacity" in r.json()["error"]["message"]


def _break_the_loop(monkeypatch, target):
    """Every step of `target` (an Engine or the class) raises, and so does recovering from it:
    the background loop dies at its first request."""

    def broken(*_):
        raise SystemError("broken engine")

    monkeypatch.setattr(target, "step", broken)
    monkeypatch.setattr(target, "recover", broken)


def test_a_request_the_engine_failed_on_is_a_500_and_a_dead_loop_makes_health_503(tiny_model, monkeypatch):
    engine = Engine(tiny_model, max_slots=2, max_new_tokens=8, cache_budget="4MiB", page_size=8)
    with serve_in_thread(engine) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        _break_the_loop(monkeypatch, engine)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "the engine failed" in r.json()["error"]["message"]
        deadline = time.time() + 10
        while engine.alive and time.time() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and "broken engine" in health.json()["error"]
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_eejax_serve_exits_non_zero_when_its_engine_loop_dies(tiny_checkpoints, monkeypatch):
    """So that a supervisor restarts it. (In a thread of this process: no signals to catch.)"""
    import threading

    from eejax.cli import main
    from tests.helpers import free_port

    _break_the_loop(monkeypatch, Engine)
    port, codes = free_port(), []
    ckpt = str(tiny_checkpoints["gqa-untied"][2])
    thread = threading.Thread(
        target=lambda: codes.append(main(["serve", "--model", ckpt, "--port", str(port), "--cache-budget", "4MiB"]))
    )
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            break
        except httpx.TransportError:
            time.sleep(0.1)
    assert r.status_code == 500
    thread.join(timeout=60)
    assert codes == [1]


def test_requests_sharing_a_prefix_reuse_its_pages_and_equal_generate(server, tiny_model):
    url, engine = server
    article = cnndm_rows(1)[0]["article"][:300]
    prompts = [article + ending for ending in (" The", " Officials said", " In short,")]
    want = eejax.generate(tiny_model, prompts, max_new_tokens=8)
    before = engine.counters["prefix_cache_hit_tokens"]
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt, tokens in zip(prompts, want.tokens):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
            assert r.json()["eejax"]["tokens"] == tokens
        values = dict(
            line.rsplit(" ", 1)
            for line in client.get("/metrics").text.splitlines()
            if line and not line.startswith("#")
        )
    shared = len(tiny_model.tokenizer(article)["input_ids"]) // engine.page_size * engine.page_size
    assert engine.counters["prefix_cache_hit_tokens"] - before >= 2 * (shared - engine.page_size)
    assert float(values["eejax_prefix_cache_hit_tokens_total"]) >= engine.counters["prefix_cache_hit_tokens"] - before
    assert float(values["eejax_kv_pages_cached"]) > 0 and float(values["eejax_prefill_chunk_tokens_count"]) > 0
