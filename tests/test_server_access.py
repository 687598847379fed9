"""A server you can expose: API keys (the official `openai` client), request ids, the access log
(text and JSON) and TLS with a self-signed certificate made here."""

import datetime
import ipaddress
import json
import logging
import ssl
import time

import httpx
import pytest

from eejax.engine.engine import Engine
from eejax.serve import access
from tests.helpers import serve_in_thread

openai = pytest.importorskip("openai")

KEY, OTHER_KEY = "sk-eejax-test-SECRET-1", "sk-eejax-test-SECRET-2"
PROMPT = "The river rose above the"


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, max_slots=4, max_new_tokens=32, cache_budget="4MiB", page_size=8)


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(engine, api_keys=(KEY, OTHER_KEY)) as url:
        yield url


def client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_every_v1_route_needs_a_key_and_health_stays_open(url, caplog):
    caplog.set_level(logging.INFO)
    for key in (KEY, OTHER_KEY):  # either key serves
        r = client(url, key).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert r.choices[0].finish_reason == "length"
    assert [m.id for m in client(url, KEY).models.list().data] == ["tiny"]
    wrong = client(url, "sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for route in ("/v1/models", "/v1/models/tiny"):
        for headers in ({}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
            r = httpx.get(url + route, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200  # open unless protect_metrics
    assert KEY not in caplog.text and OTHER_KEY not in caplog.text and "sk-wrong" not in caplog.text


def test_request_ids_and_the_access_log(url, caplog):
    caplog.set_level(logging.INFO, logger="eejax.access")
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "client-id.42"}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "spec": "1:2"}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.headers["x-request-id"] == "client-id.42" == r.json()["id"]
    line = next(rec.getMessage() for rec in caplog.records if "id=client-id.42" in rec.getMessage())
    for field in ("route=/v1/completions", "status=200", "prompt_tokens=", "completion_tokens=5",
                  "finish_reason=length", "ttft_s=", "total_s=", "decoding=spec=1:2,greedy"):  # fmt: skip
        assert field in line, (field, line)
    # An id that is not sane (spaces, too long) is replaced; a stream gets one too.
    for given in ("two words", "x" * 200):
        stream = {**body, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=stream, headers={**headers, "X-Request-Id": given},
                          timeout=120) as r:  # fmt: skip
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        rid = r.headers["x-request-id"]
        assert rid != given and len(rid) == 32 and {e["id"] for e in events} == {rid}
    # Refused and failed requests are logged with their status; no key is.
    httpx.get(url + "/v1/models", headers={"X-Request-Id": "no-key"})
    assert any("id=no-key" in rec.getMessage() and "status=401" in rec.getMessage() for rec in caplog.records)


def test_a_client_gone_during_its_body_is_499_not_500(url, caplog):
    """40 clients that send half a body and close: each is status 499 in the access log, nothing is
    logged as an error (no ASGI traceback), and the server serves on."""
    import socket

    caplog.set_level(logging.INFO)
    host, port = url.removeprefix("http://").split(":")
    for i in range(40):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nX-Request-Id: half-{i}\r\n".encode()
                + b'Content-Length: 1000\r\n\r\n{"prompt": "The river'
            )
    deadline = time.time() + 30
    while time.time() < deadline and sum("id=half-" in r.getMessage() for r in caplog.records) < 40:
        time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "id=half-" in r.getMessage()]
    assert len(lines) == 40 and all("status=499" in line for line in lines), lines
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    r = client(url, KEY).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_access_log_as_json_and_metrics_behind_the_key(tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="eejax.access")
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=32, cache_budget="4MiB", page_size=8)
    with serve_in_thread(engine, api_keys=(KEY,), protect_metrics=True, log_format="json") as url:
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        r = client(url, KEY).completions.create(model="tiny", prompt=PROMPT, max_tokens=3, n=2)
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "eejax.access"]
    done = next(line for line in lines if line["route"] == "/v1/completions")
    assert done["id"] == r.id and done["status"] == 200 and done["completion_tokens"] == 6
    assert done["finish_reason"] == "length,length" and done["decoding"] == "full,greedy"


def test_tls_with_a_self_signed_certificate(tiny_model, tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    keyfile, certfile = tmp_path / "key.pem", tmp_path / "cert.pem"
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=32, cache_budget="4MiB", page_size=8)
    with serve_in_thread(engine, ssl=(str(keyfile), str(certfile)), api_keys=(KEY,)) as url:
        assert url.startswith("https://")
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(url + "/health")
        trust = ssl.create_default_context(cafile=str(certfile))
        assert httpx.get(url + "/health", verify=trust).json()["status"] == "ok"
        http = openai.DefaultHttpxClient(verify=trust)
        tls = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120, http_client=http)
        assert tls.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_keys_ids_and_warnings():
    assert access.api_keys(["a", "b"], {"EEJAX_API_KEY": "c"}) == ("a", "b")
    assert access.api_keys(None, {"EEJAX_API_KEY": " c , d ,"}) == ("c", "d")
    assert access.api_keys(None, {}) == () == access.api_keys([], {"EEJAX_API_KEY": ""})
    assert access.key_matches("b", ("a", "b")) and not access.key_matches("c", ("a", "b"))
    assert not access.key_matches("a", ())
    assert access.request_id({b"x-request-id": b"abc-1"}) == "abc-1"
    assert access.request_id({b"x-request-id": b"a\nb"}) != "a\nb"
    assert access.exposure_warning("0.0.0.0", ()) and "--api-key" in access.exposure_warning("10.1.2.3", ())
    assert access.exposure_warning("0.0.0.0", ("k",)) is None and access.exposure_warning("127.0.0.1", ()) is None
    assert access.access_line({"id": "x", "ttft_s": None, "status": 200}, "text") == "id=x status=200"


def test_deadlines_over_http(tiny_model):
    """The server's --request-timeout caps a request's own timeout; waiting in the queue counts; a
    non-streamed request with no token at its deadline gets a 504, a stream ends with finish reason
    "length" and eejax.timed_out; pages come back. (Every request here waits behind a blocker
    that holds the one slot longer than any deadline, so a loaded machine changes nothing.)"""
    engine = Engine(tiny_model, max_slots=1, max_new_tokens=32, cache_budget="4MiB", page_size=8, steps_per_dispatch=1)
    real_step = engine.step

    def slow_step():  # 80 ms a step: a 32-token request holds the one slot for ~2.6 s
        time.sleep(0.08)
        real_step()

    engine.step = slow_step
    with serve_in_thread(engine, request_timeout=1.0) as url:
        blocker = engine.submit(PROMPT, max_new_tokens=32)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={**body, "timeout": 100}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["param"] == "timeout"
        # The server's 1 s, not the request's 100 (a loaded machine has taken 5.4 s: the bound is loose).
        assert time.monotonic() - started < 30
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "timeout": 0.2}) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["eejax"]["timed_out"]
        blocker.result(timeout=60)  # (a request without a deadline is untouched: test_engine_faults)
    assert not blocker.timed_out and engine.metrics()["kv_pages_used"] == 0
