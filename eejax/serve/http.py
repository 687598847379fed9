"""OpenAI-compatible HTTP API over an `Engine` (FastAPI; the `serve` extra).

POST /v1/completions, POST /v1/chat/completions (chat template from the tokenizer), `stream: true`
as server-sent events; GET /v1/models; GET /health; GET /metrics (Prometheus text). Honoured
besides the prompt: max_tokens / max_completion_tokens, temperature, top_p, top_k (vLLM's), n,
seed, stop, stop_token_ids (vLLM's), presence_penalty, frequency_penalty, repetition_penalty
(vLLM's), logprobs (completions: 0 to 20 alternatives; chat: logprobs and top_logprobs), echo
(completions; with logprobs, the prompt's own), stream_options.include_usage; see
`eejax.serve.schema` for what is refused.
eejax extras: `exit`, `spec` and `priority` in a request; `eejax.tokens` and `eejax.exit_layers`
(layers run per token) in a response (of its first choice; each choice has its own with n > 1).
Temperature / top_p / top_k default to the server's (`eejax serve --temperature`, greedy by
default); they and the penalties are traced values, so no setting compiles a new program.

Hostile input gets a 4xx and never reaches the engine: bodies over `max_body_bytes` (413), bad
JSON, JSON nested too deep and strings that are not Unicode (a lone surrogate) (400), and every
field checked by the schema and then against the model and the cache. Tokenizing runs off the
event loop. A request the engine failed on gets a 500 naming the error; `/health` is 503 once
the engine's loop has died.
"""

import asyncio
import contextlib
import json
import logging
import time

from eejax.decode.prompts import prompt_token_ids
from eejax.decode.sampling import SamplingParams
from eejax.engine.stops import visible_text
from eejax.errors import EejaxError
from eejax.options import ExitConfig, SpecConfig, is_auto, is_off
from eejax.serve import logprobs as spelled
from eejax.serve.access import AccessMiddleware, completion_fields, decoding_of
from eejax.serve.schema import ChatRequest, CompletionRequest, RequestError, parse, unicode_error

log = logging.getLogger("eejax.serve")

DISCONNECT_POLL_S = 0.5  # how often a request waiting for tokens checks that its client is still there
MAX_BODY_BYTES = 2 * 2**20  # the largest request body read (a prompt fills the context long before)


def create_app(
    engine,
    *,
    served_model_name: str,
    max_waiting: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_keys: tuple[str, ...] = (),
    protect_metrics: bool = False,
    log_format: str = "text",
    request_timeout: float | None = None,
):
    """The FastAPI app serving `engine` (whose loop must be running: `engine.start()`). With
    `api_keys`, /v1/* (and /metrics with `protect_metrics`) need one as a Bearer token
    (`eejax.serve.access`); every request gets an id and a line in the access log. A request
    ends at `request_timeout` seconds after it arrived (None: never), or at its own `timeout`
    if that is sooner."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.requests import ClientDisconnect

    app = FastAPI(title="eejax", version="0.1")
    app.add_middleware(
        AccessMiddleware,
        keys=tuple(api_keys),
        protect_metrics=protect_metrics,
        log_format=log_format,
        summarize=completion_fields,
    )
    tokenizer = engine.model.tokenizer
    created_at = int(time.time())

    def error(status: int, message: str, param: str | None = None):
        kind = {
            400: "invalid_request_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            500: "server_error",
            503: "server_error",
            504: "timeout",
        }.get(status, "error")
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)

    async def read_body(request: Request):
        """The parsed JSON body: at most `max_body_bytes` are read (413 beyond)."""
        too_large = RequestError(413, f"request body over {max_body_bytes} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                raise too_large
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(400, f"malformed JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, "malformed JSON: nested too deep") from None
        problem = unicode_error(body)
        if problem:
            raise RequestError(400, problem, problem.split(":")[0].split(".")[0])
        return body

    def check_served(name: str) -> None:
        if name != served_model_name:
            raise RequestError(
                404, f"model {name!r} is not served here (this server serves {served_model_name!r})", "model"
            )

    async def read_request(request: Request, schema):
        """The body validated against `schema`; fields no schema knows are logged and ignored."""
        body = await read_body(request)
        req = parse(body, schema)
        ignored = sorted(set(body) - set(schema.model_fields))
        if ignored:
            log.info("ignoring unknown fields: %s", ", ".join(ignored))
        return req

    def admit(req, prompts: list, max_tokens: int | None, limit_field: str, top_logprobs: int | None) -> list:
        """Submits the request's n choices of each prompt; returns their Sequences, prompt-major."""
        if req.model is not None:
            check_served(req.model)
        if not engine.alive:
            raise RequestError(503, "the engine is not running (see /health)")
        if len(engine.waiting) + len(prompts) * req.choices > max_waiting:
            raise RequestError(429, f"the server is at capacity ({max_waiting} requests waiting); retry later")
        max_tokens = 16 if max_tokens is None else max_tokens
        if max_tokens > engine.max_new_tokens:
            raise RequestError(
                400, f"{limit_field} must lie in [1, {engine.max_new_tokens}], got {max_tokens}", limit_field
            )
        for field, parse_option in (("exit", ExitConfig.parse), ("spec", SpecConfig.parse)):
            value = getattr(req, field)
            if value is not None and not is_off(value) and not (field == "spec" and is_auto(value)):
                try:
                    parse_option(value)
                except EejaxError as e:
                    raise RequestError(400, f"{field}: {e}", field) from None
        seed = engine.fresh_seed() if req.seed is None else req.seed  # one seed, a key per choice
        timeout = min((t for t in (req.timeout, request_timeout) if t), default=None)
        seqs = []
        try:
            for prompt in prompts:
                if isinstance(prompt, str):  # tokenized once for all n choices
                    (prompt,), _ = prompt_token_ids(tokenizer, [prompt])
                for choice in range(req.choices):
                    seqs.append(
                        engine.submit(
                            prompt,
                            max_new_tokens=max_tokens,
                            priority=req.priority,
                            exit=req.exit or None,
                            spec=req.spec,  # "none": full depth, whatever the server's default
                            **req.sampling_options,
                            seed=seed,
                            choice=choice,
                            logprobs=top_logprobs,
                            prompt_logprobs=top_logprobs if getattr(req, "echo", False) else None,
                            stop=req.stops,
                            stop_token_ids=req.stop_token_ids or (),
                            timeout=timeout,
                        )
                    )
        except EejaxError as e:
            for seq in seqs:
                engine.cancel(seq)
            message = str(e)
            param = next(
                (
                    f
                    for f in (
                        "spec",
                        "exit",
                        *SamplingParams.names(),
                        "stop_token_ids",
                        "stop",
                        "seed",
                        "logprobs",
                    )
                    if f in message
                ),
                "prompt",
            )
            raise RequestError(400, message, param) from None
        return seqs

    async def updates(seqs, request: Request):
        """Yields whenever some of `seqs` has new tokens or ended, until all ended; cancels them
        if the client goes away. Tokens reach the event loop through `call_soon_threadsafe`."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        for seq in seqs:
            seq.listen(lambda: loop.call_soon_threadsafe(wake.set))
        try:
            while True:
                wake.clear()
                yield
                if all(seq.finished for seq in seqs):
                    return
                with contextlib.suppress(asyncio.TimeoutError):  # no news: check the client is still there
                    await asyncio.wait_for(wake.wait(), DISCONNECT_POLL_S)
                if await request.is_disconnected():
                    return
        finally:
            for seq in seqs:
                if not seq.finished:
                    engine.cancel(seq)

    def text_of(seq, stops) -> str:
        return visible_text(tokenizer.decode(seq.tokens, skip_special_tokens=True), stops, seq.finished)

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def completion_logprobs(seq, start: int, end: int, offset: int, echo: bool = False) -> dict:
        """Legacy completions logprobs of tokens [start, end), text offsets from `offset`; with
        `echo`, the prompt's tokens first (from offset 0)."""
        prompt = (seq.prompt, seq.prompt_token_logprobs, seq.prompt_top_logprobs) if echo else ([], [], [])
        return spelled.completion_logprobs(
            token_text,
            prompt[0] + seq.tokens[start:end],
            prompt[1] + seq.token_logprobs[start:end],
            prompt[2] + seq.top_logprobs[start:end],
            0 if echo else offset,
        )

    def chat_logprobs(seq, start: int, end: int) -> dict:
        tokens, logprobs, tops = seq.tokens[start:end], seq.token_logprobs[start:end], seq.top_logprobs[start:end]
        return spelled.chat_logprobs(token_text, tokens, logprobs, tops)

    def extras(seq) -> dict:
        out = {"tokens": seq.tokens, "exit_layers": seq.exit_layers}
        if seq.timed_out:
            out["timed_out"] = True  # ended at its deadline: finish reason "length"
        if seq.spec is not None:
            out["acceptance_rate"] = seq.accepted / seq.drafted if seq.drafted else 0.0
        return out

    def usage(seqs, n: int) -> dict:
        prompt, completion = sum(len(s.prompt) for s in seqs[::n]), sum(len(s.tokens) for s in seqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def failure(seq) -> dict:
        message = f"the engine failed on this request ({seq.error or 'its loop died'}); other requests go on"
        return {"error": {"message": message, "type": "server_error", "param": None, "code": 500}}

    async def respond(request: Request, req, seqs, chat: bool):
        rid = request.state.request_id  # the response's X-Request-Id (`eejax.serve.access`)
        request.state.completions, request.state.choices = seqs, req.choices
        request.state.decoding = decoding_of(req, engine)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        scored = seqs[0].logprobs is not None
        echo = not chat and bool(req.echo)

        def echoed(j: int) -> str:
            """The prompt text choice j starts with (`echo`): the prompt as sent, or its ids' text."""
            if not echo:
                return ""
            prompt = req.prompts[j // req.choices]
            return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)

        if req.stream:
            head = {
                "id": rid,
                "object": kind + (".chunk" if chat else ""),
                "created": created,
                "model": served_model_name,
            }

            def chunk(choices, **more) -> str:
                return f"data: {json.dumps({**head, 'choices': choices, **more})}\n\n"

            async def events():
                sent = [""] * len(seqs)  # text streamed so far, per choice
                scored_upto = [0] * len(seqs)  # tokens whose log-probs were streamed
                seen = [0] * len(seqs)  # tokens looked at (decoding the text is the costly part)
                ended = [False] * len(seqs)
                echoed_yet = [False] * len(seqs)
                async with contextlib.aclosing(updates(seqs, request)) as ticks:  # closed with the stream
                    async for _ in ticks:
                        for j, seq in enumerate(seqs):
                            if ended[j] or (len(seq.tokens) == seen[j] and not seq.finished):
                                continue
                            seen[j] = len(seq.tokens)
                            text = text_of(seq, req.stops)
                            delta, n = text[len(sent[j]) :], len(seq.tokens)
                            first = echo and not echoed_yet[j]  # the echoed prompt goes first
                            if delta or (scored and n > scored_upto[j]) or first:
                                message = (
                                    {"content": delta}
                                    if sent[j] or scored_upto[j]
                                    else {"role": "assistant", "content": delta}
                                )
                                choice = (
                                    {"index": j, "delta": message, "finish_reason": None}
                                    if chat
                                    else {"index": j, "text": echoed(j) * first + delta, "finish_reason": None}
                                )
                                if scored:
                                    choice["logprobs"] = (
                                        chat_logprobs(seq, scored_upto[j], n)
                                        if chat
                                        else completion_logprobs(
                                            seq, scored_upto[j], n, len(echoed(j) + sent[j]), first
                                        )
                                    )
                                    scored_upto[j] = n
                                sent[j], echoed_yet[j] = text, echo
                                yield chunk([choice])
                            if seq.finish_reason == "error":  # the engine failed on it: say so, end the stream
                                yield f"data: {json.dumps(failure(seq))}\n\n"
                                yield "data: [DONE]\n\n"
                                return
                            if seq.finished:
                                ended[j] = True
                                final = (
                                    {"index": j, "delta": {}, "finish_reason": seq.finish_reason}
                                    if chat
                                    else {"index": j, "text": "", "finish_reason": seq.finish_reason}
                                )
                                yield chunk([final], eejax=extras(seq))
                    if req.include_usage:
                        yield chunk([], usage=usage(seqs, req.choices))
                    yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        async with contextlib.aclosing(updates(seqs, request)) as ticks:
            async for _ in ticks:
                pass
        failed = next((seq for seq in seqs if seq.finish_reason == "error"), None)
        if failed is not None:
            return JSONResponse(failure(failed), 500)
        if all(seq.timed_out and not seq.tokens for seq in seqs):
            return error(504, "the request passed its deadline before it produced a token", "timeout")
        choices = []
        for j, seq in enumerate(seqs):
            text = text_of(seq, req.stops)
            if chat:
                choice = {
                    "index": j,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": seq.finish_reason,
                    "logprobs": None,
                }
                if scored:
                    choice["logprobs"] = chat_logprobs(seq, 0, len(seq.tokens))
            else:
                choice = {
                    "index": j,
                    "text": echoed(j) + text,
                    "finish_reason": seq.finish_reason,
                    "logprobs": completion_logprobs(seq, 0, len(seq.tokens), 0, echo) if scored else None,
                }
            if len(seqs) > 1:
                choice["eejax"] = extras(seq)
            choices.append(choice)
        return JSONResponse(
            {
                "id": rid,
                "object": kind,
                "created": created,
                "model": served_model_name,
                "choices": choices,
                "usage": usage(seqs, req.choices),
                "eejax": extras(seqs[0]),
            }
        )

    @app.exception_handler(RequestError)
    async def request_error(_, exc: RequestError):
        return error(exc.status, exc.message, exc.param)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_, exc: ClientDisconnect):
        """The client hung up while its body was read: 499 in the access log, as a hang-up after
        the body is (nobody is there to read it), not a 500 with a traceback."""
        return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest)
        # Tokenizing (and waiting for the engine's lock) runs off the event loop.
        seqs = await asyncio.to_thread(admit, req, req.prompts, req.max_tokens, "max_tokens", req.top_logprobs)
        return await respond(request, req, seqs, chat=False)

    def chat_prompt(req) -> list[int]:
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding, or the ids

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatRequest)

        def submit():
            return admit(req, [chat_prompt(req)], req.token_limit, req.token_limit_field, req.top_logprobs_wanted)

        seqs = await asyncio.to_thread(submit)
        return await respond(request, req, seqs, chat=True)

    def model_card() -> dict:
        return {
            "id": served_model_name,
            "object": "model",
            "created": created_at,
            "owned_by": "eejax",
            "max_model_len": engine.max_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_served(model_id)
        return model_card()

    @app.get("/health")
    async def health():
        if not engine.alive:
            reason = f"the engine loop died: {engine.error!r}" if engine.error else "the engine loop is not running"
            return JSONResponse({"status": "error", "model": served_model_name, "error": reason}, 503)
        return {"status": "ok", "model": served_model_name}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return PlainTextResponse(engine.prometheus.render(engine.metrics()), media_type=CONTENT_TYPE_LATEST)

    return app
