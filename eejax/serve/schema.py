"""The OpenAI request bodies eejax accepts, validated with pydantic (strict types: `true` is not a
number, `"yes"` not a boolean; no NaN or infinity). Fields OpenAI defines that eejax does not
honour are accepted when they ask for nothing (null, 0, false, "", [], {}, "none") and refused
with a 400 naming them otherwise; fields nobody defines are ignored (and logged by the server).

Log-probabilities are those of the distribution a token is drawn from (vLLM's "processed"
logprobs): after temperature, top-k and top-p; at temperature 0 the model's own softmax.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from eejax.decode.sampling import SamplingParams

MAX_STOP = 4  # stop strings per request (OpenAI's bound)
MAX_N = 16  # choices per request
MAX_ROWS = 64  # prompts x choices per completions request
MAX_TOP_LOGPROBS = 20


class RequestError(Exception):
    """A request the server refuses: HTTP status, a message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _off(value) -> bool:
    """Whether a value asks for nothing."""
    return value is None or value is False or value == 0 or value in ("", "none") or value == [] or value == {}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = False


def _sampling_fields() -> type[BaseModel]:
    """The sampling options (`SamplingParams.options()`: temperature, top_p, top_k (vLLM's),
    presence_penalty, frequency_penalty, repetition_penalty (vLLM's)) as optional fields with
    their bounds (None: the server's default); on the wire top_k -1 is off too (vLLM's)."""
    fields = {}
    for name, (kind, bounds, _) in SamplingParams.options().items():
        bounds = {**bounds, "ge": -1} if name == "top_k" else bounds
        finite = {"allow_inf_nan": False} if kind is float else {}
        fields[name] = (kind | None, Field(None, **bounds, **finite))
    return create_model("_Sampling", __config__=ConfigDict(strict=True), **fields)


class _Common(_sampling_fields()):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extra
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # eejax's extras: scheduling priority,
    exit: str | None = None  # early exit ("softmax:0.9", "static:15", "none"),
    spec: str | None = None  # speculation ("auto", "none", "E:d", "draft:d", ":tree", ":stop=η", ":lookup"),
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds (capped by the server's)
    # Defined by OpenAI, honoured only when they ask for nothing:
    logit_bias: dict[str, float] | None = None

    NOT_HONOURED: ClassVar[tuple[str, ...]] = ("logit_bias",)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return [s for s in stops if s]  # empty strings stop nothing

    @property
    def stops(self) -> list[str]:
        return self.stop or []

    @property
    def sampling_options(self) -> dict[str, float | int | None]:
        """The sampling options as `Engine.submit` takes them (`SamplingParams.names()`; None:
        the server's default); vLLM's top_k -1 is 0 (off)."""
        options = {name: getattr(self, name) for name in SamplingParams.names()}
        if options["top_k"] is not None:
            options["top_k"] = max(options["top_k"], 0)
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1

    def check(self) -> None:
        """Refuses fields that are valid but not honoured, and combinations that make no sense."""
        for name in self.NOT_HONOURED:
            if not _off(getattr(self, name)):
                raise RequestError(400, f"eejax does not support {name}={getattr(self, name)!r}", name)
        if self.include_usage and not self.stream:
            raise RequestError(400, "stream_options is only for stream: true", "stream_options")


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch of them
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    NOT_HONOURED: ClassVar[tuple[str, ...]] = _Common.NOT_HONOURED + ("suffix",)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, value):
        return None if value is False else value  # false: off

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], str | list) and not all(value):
            raise ValueError(f"prompt {[bool(p) for p in value].index(False)} of the batch is empty")
        return value

    @property
    def prompts(self) -> list:
        """The batch: each prompt text or token ids (one for a single prompt). Choice j of prompt
        i is the response's choice i * n + j, as OpenAI numbers them."""
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return list(self.prompt) if batch else [self.prompt]

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, self.choices):
            raise RequestError(400, f"eejax does not support best_of={self.best_of!r} (only n)", "best_of")
        if len(self.prompts) * self.choices > MAX_ROWS:
            raise RequestError(
                400, f"{len(self.prompts)} prompts x n={self.choices} exceeds {MAX_ROWS} completions", "prompt"
            )

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives to report per token (0: the token's own log-prob only); None: off."""
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]  # text, or text parts (eejax has no tool calls or images)

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    NOT_HONOURED: ClassVar[tuple[str, ...]] = _Common.NOT_HONOURED + ("tools",)

    def check(self) -> None:
        super().check()
        if self.response_format not in (None, {}, {"type": "text"}):
            raise RequestError(
                400, f"eejax does not support response_format={self.response_format!r}", "response_format"
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError(400, f"eejax does not support tool_choice={self.tool_choice!r}", "tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def token_limit_field(self) -> str:
        """The field that set the token limit, as the user sent it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_NESTED = {"role", "content", "include_usage", "type", "text"}


def parse(body: Any, schema: type[_Common]) -> _Common:
    """The validated request, or RequestError (400) naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        request = schema.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        # The path to the field (messages.0.role), without pydantic's names of union members.
        path = [str(p) for p in error["loc"] if isinstance(p, int) or p in schema.model_fields or p in _NESTED]
        field = ".".join(path) or None
        raise RequestError(
            400, f"{field}: {error['msg']}" if field else error["msg"], path[0] if path else None
        ) from None
    request.check()
    return request


def unicode_error(body) -> str | None:
    """Where `body` (parsed JSON) holds a string that is not valid Unicode (a lone surrogate
    from a "\\ud800" escape), or None. Iterative: the depth is whatever json allowed."""
    stack = [("body", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"{where}: not valid Unicode ({e.reason} at character {e.start})"
        elif isinstance(value, dict):
            stack.extend((f"{where} key", k) for k in value)
            stack.extend((f"{where}.{k}" if where != "body" else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(value))
    return None
