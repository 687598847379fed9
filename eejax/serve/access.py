"""Who may call the server and what it did for them: API keys, request ids, the access log.

One pure ASGI middleware (`AccessMiddleware`), outside the app, so it sees every request,
streams included, and a refused one never reaches a route:
- API keys: with keys configured, every `/v1/*` route (and `/metrics` when `protect_metrics`)
  needs `Authorization: Bearer KEY`. The presented key is compared with every configured key in
  constant time (`hmac.compare_digest`); a missing or wrong key gets 401 with an OpenAI-shaped
  error body. No key is ever logged. `/health` stays open.
- Request ids: the client's `X-Request-Id` if it is sane (`REQUEST_ID`: 1-128 of [A-Za-z0-9._:-]),
  else a new one; it is the response's `X-Request-Id` and the completion's `id` (routes read it
  from `request.state.request_id`).
- The access log: one line per request on the "eejax.access" logger once its response has been
  sent (a stream: after its last event), with what the route recorded in `request.state`
  (`summarize`: prompt and completion tokens, finish reason, time to first token, decoding option).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from eejax.options import is_off

ACCESS_LOG = logging.getLogger("eejax.access")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
API_KEY_ENV = "EEJAX_API_KEY"


def api_keys(given: list[str] | None, environ: dict) -> tuple[str, ...]:
    """The keys a server requires: those given (`--api-key`, repeatable), else the comma-separated
    ones of $EEJAX_API_KEY; () when there are none (the server is open)."""
    keys = list(given or []) or environ.get(API_KEY_ENV, "").split(",")
    return tuple(k.strip() for k in keys if k.strip())


def exposure_warning(host: str, keys: tuple[str, ...]) -> str | None:
    """The warning a server bound to `host` without keys prints: anyone on the network may use it
    (None for a loopback address, or with keys)."""
    if keys or host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return None
    return (
        f"listening on {host} without an API key: anyone who can reach the port can use this server "
        f"(--api-key KEY or ${API_KEY_ENV})"
    )


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Whether `presented` is one of `keys`, in time independent of where they differ (every key
    is compared, each with `hmac.compare_digest`)."""
    match = False
    for key in keys:
        match |= hmac.compare_digest(presented.encode(), key.encode())
    return match


def request_id(headers: dict[bytes, bytes]) -> str:
    """The client's X-Request-Id if it is sane, else a new one."""
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    return given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def needs_key(path: str, protect_metrics: bool) -> bool:
    return path.startswith("/v1/") or (protect_metrics and path == "/metrics")


def unauthorized(reason: str) -> bytes:
    """OpenAI's 401 body."""
    return json.dumps(
        {"error": {"message": reason, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    ).encode()


def access_line(fields: dict, fmt: str) -> str:
    """One access-log line: JSON, or `key=value` pairs (text)."""
    if fmt == "json":
        return json.dumps(fields)
    return " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def decoding_of(req, engine) -> str:
    """A request's decoding option in a word or two, for the access log."""
    if req.spec is not None and not is_off(req.spec):
        mode = f"spec={req.spec}"
    elif req.exit is not None and not is_off(req.exit):
        mode = f"exit={req.exit}"
    else:
        mode = "full"
    temperature = engine.sampling.temperature if req.temperature is None else req.temperature
    return mode + (f",T={temperature:g}" if temperature else ",greedy")


def completion_fields(state: dict) -> dict:
    """What the access log says of a request's completions (`state`: the request's
    `request.state`, read once its response has been sent)."""
    seqs = state.get("completions")
    if not seqs:
        return {}
    firsts = [s.token_times[0] - s.submitted_at for s in seqs if s.token_times]
    return {
        "prompt_tokens": sum(len(s.prompt) for s in seqs[:: state.get("choices", 1)]),
        "completion_tokens": sum(len(s.tokens) for s in seqs),
        "finish_reason": ",".join(s.finish_reason or "unfinished" for s in seqs),
        "ttft_s": round(min(firsts), 4) if firsts else None,
        "decoding": state.get("decoding"),
    }


class AccessMiddleware:
    """API keys, request ids and the access log around an ASGI app (see the module docstring)."""

    def __init__(self, app, *, keys=(), protect_metrics: bool = False, log_format: str = "text", summarize=None):
        """`summarize(state) -> dict`: the fields a route's `request.state` adds to its log line."""
        if log_format not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {log_format!r}")
        self.app, self.keys, self.protect_metrics, self.log_format = app, tuple(keys), protect_metrics, log_format
        self.summarize = summarize or (lambda state: {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        headers = dict(scope.get("headers") or [])
        rid = request_id(headers)
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        status = None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            if self.keys and needs_key(scope["path"], self.protect_metrics):
                auth = headers.get(b"authorization", b"").decode("latin-1")
                scheme, _, presented = auth.partition(" ")
                if scheme.lower() != "bearer" or not presented.strip():
                    return await self._refuse(send_with_id, "missing API key: send Authorization: Bearer KEY")
                if not key_matches(presented.strip(), self.keys):
                    return await self._refuse(send_with_id, "incorrect API key provided")
            await self.app(scope, receive, send_with_id)
        except BaseException:
            status = status or 500
            raise
        finally:
            fields = {
                "id": rid,
                "method": scope.get("method"),
                "route": scope["path"],
                "status": status if status is not None else 499,  # nothing sent: the client went away
                **self.summarize(state),
                "total_s": round(time.monotonic() - started, 4),
            }
            ACCESS_LOG.info(access_line(fields, self.log_format))

    async def _refuse(self, send, reason: str) -> None:
        body = unauthorized(reason)
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
