"""OpenAI-compatible HTTP API over an `Engine` (FastAPI; the `serve` extra).

POST /v1/completions, POST /v1/chat/completions (chat template from the tokenizer), `stream: true`
as server-sent events; GET /health; GET /metrics (Prometheus text). eejax extras: `exit` and
`priority` (and vLLM's `top_k`) in a request; temperature / top_p / top_k default to the
server's (`eejax serve --temperature`, greedy by default), each distinct setting compiling its
own programs; `eejax.tokens` and `eejax.exit_layers` (layers run per token) in a response.
"""


import asyncio
import json
import logging
import time
import uuid
from typing import Any

from eejax.errors import EejaxError

log = logging.getLogger("eejax.serve")

# OpenAI fields eejax reads; fields it knows but cannot honour (with a value other than the
# default) are a 400 naming them; anything else is ignored and logged.
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "stream", "temperature", "top_p", "n", "stop", "seed", "user",
                     "logprobs", "echo", "presence_penalty", "frequency_penalty", "best_of", "logit_bias",
                     "suffix", "stream_options", "priority", "exit", "spec", "top_k"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo", "suffix", "best_of", "logprobs"}) | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice"}
UNSUPPORTED_DEFAULTS = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None,
                        "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None,
                        "stop": None, "tools": None, "tool_choice": None, "response_format": None,
                        "seed": None}  # the engine has one sampling stream (Engine(seed=...)), not one per request


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def check_fields(body: Any, known: set[str]) -> dict:
    """The request body as a dict, or RequestError naming the problem."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        log.info("ignoring unknown fields: %s", ", ".join(unknown))
    for name, default in UNSUPPORTED_DEFAULTS.items():
        if name in body and body[name] not in (default, None) and body[name] != default:
            raise RequestError(400, f"eejax does not support {name}={body[name]!r} (only {default!r})", name)
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RequestError(400, f"{name} must be a number", name)
    return body


def max_tokens_of(body: dict, limit: int, field: str = "max_tokens") -> int:
    value = body.get(field, body.get("max_completion_tokens", 16))
    if value is None:
        value = 16
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"{field} must be an integer", field)
    if not 1 <= value <= limit:
        raise RequestError(400, f"{field} must lie in [1, {limit}], got {value}", field)
    return value


def create_app(engine, *, served_model_name: str, max_waiting: int = 256):
    """The FastAPI app serving `engine` (whose loop must be running: `engine.start()`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="eejax", version="0.1")
    tokenizer = engine.model.tokenizer

    def error(status: int, message: str, param: str | None = None):
        kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}.get(status, "error")
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)

    async def read_body(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"malformed JSON: {e}") from None

    def admit(body: dict, prompt) -> Any:
        model = body.get("model")
        if model is not None and model != served_model_name:
            raise RequestError(404, f"model {model!r} is not served here (this server serves {served_model_name!r})",
                               "model")
        if len(engine.waiting) >= max_waiting:
            raise RequestError(429, f"the server is at capacity ({max_waiting} requests waiting); retry later")
        max_tokens = max_tokens_of(body, engine.max_new_tokens)
        priority = body.get("priority", 0)
        if not isinstance(priority, int):
            raise RequestError(400, "priority must be an integer", "priority")
        exit_option, spec_option = body.get("exit"), body.get("spec")
        if exit_option is not None and not isinstance(exit_option, str):
            raise RequestError(400, 'exit must be a string such as "softmax:0.9", "static:15" or "none"', "exit")
        if spec_option is not None and not isinstance(spec_option, str):
            raise RequestError(400, 'spec must be a string "E:d" such as "15:3"', "spec")
        try:
            return engine.submit(prompt, max_new_tokens=max_tokens, priority=priority, exit=exit_option,
                                 spec=spec_option, temperature=body.get("temperature"), top_p=body.get("top_p"),
                                 top_k=body.get("top_k"))
        except EejaxError as e:
            message = str(e)
            param = next((f for f in ("spec", "exit", "temperature", "top_p", "top_k") if f in message), "prompt")
            raise RequestError(400, message, param) from None

    async def wait_tokens(seq, request: Request):
        """Yields token ids as they come; cancels the sequence if the client goes away."""
        loop = asyncio.get_running_loop()
        stream = seq.stream()
        try:
            while True:
                token = await loop.run_in_executor(None, next, stream, None)
                if token is None:
                    return
                yield token
                if await request.is_disconnected():
                    engine.cancel(seq)
                    return
        finally:
            if not seq.finished:
                engine.cancel(seq)

    def extras(seq) -> dict:
        out = {"tokens": seq.tokens, "exit_layers": seq.exit_layers}
        if seq.spec is not None:
            out["acceptance_rate"] = seq.accepted / seq.drafted if seq.drafted else 0.0
        return out

    def usage(seq) -> dict:
        return {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.tokens),
                "total_tokens": len(seq.prompt) + len(seq.tokens)}

    async def respond(request: Request, body: dict, seq, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            async def events():
                sent = ""
                async for _ in wait_tokens(seq, request):
                    text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
                    delta, sent = text[len(sent):], text
                    choice = ({"index": 0, "delta": {"content": delta}, "finish_reason": None} if chat
                              else {"index": 0, "text": delta, "finish_reason": None})
                    chunk = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                             "model": served_model_name, "choices": [choice]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                final = ({"index": 0, "delta": {}, "finish_reason": seq.finish_reason} if chat
                         else {"index": 0, "text": "", "finish_reason": seq.finish_reason})
                done = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                        "model": served_model_name, "choices": [final], "usage": usage(seq),
                        "eejax": extras(seq)}
                yield f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        async for _ in wait_tokens(seq, request):
            pass
        text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": seq.finish_reason}
                  if chat else {"index": 0, "text": text, "finish_reason": seq.finish_reason, "logprobs": None})
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": served_model_name,
                             "choices": [choice], "usage": usage(seq),
                             "eejax": extras(seq)})

    @app.exception_handler(RequestError)
    async def request_error(_, exc: RequestError):
        return error(exc.status, exc.message, exc.param)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = check_fields(await read_body(request), COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise RequestError(400, "prompt must be a non-empty string or a list of token ids (one prompt)", "prompt")
        return await respond(request, body, admit(body, prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = check_fields(await read_body(request), CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return await respond(request, body, admit(body, list(ids)), chat=True)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served_model_name}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(engine.prometheus.render(engine.metrics()), media_type=CONTENT_TYPE_LATEST)

    return app
