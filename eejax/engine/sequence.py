"""A request inside the engine, and what its caller reads back (tokens, stream, result): a
`Sequence` holds three pieces, each written by one part of the engine.

    request    `Request`, what the caller asked: frozen, built once by `Requests.submit`
    placement  `Placement`, where it runs: admission's (`SlotTable`: slot, pages, cached prefix;
               `Admission`: prefill progress, preemptions)
    output     `Output`, what it produced and how it ended: `Delivery`'s alone

and `spec_off`, the adaptive speculation policy's verdict on it (`Speculation`'s). Every field
of the three reads as the Sequence's own (`seq.tokens`, `seq.slot`, `seq.prompt`), read-only: a
part writes through the piece it owns (`seq.output.tokens.extend(...)`), and
`tests/test_sequence_writers.py` shows which part that is."""

from __future__ import annotations

import dataclasses
import operator
import queue
import threading
import time
from typing import Any

from eejax.decode.sampling import SamplingParams
from eejax.options import ExitConfig, SpecConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """What the caller asked, checked (`Requests.submit`), and how it travels to replicas."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    priority: int = 0
    exit: ExitConfig | None = None
    sampling: SamplingParams = SamplingParams()
    spec: SpecConfig | None = None
    key: Any = None  # the request's PRNG key (uint32 [2]): fold_in(seed_key(seed), choice)
    logprobs: int | None = None  # top alternatives to report per token (0: the token's own only); None: off
    stop: tuple[str, ...] = ()  # strings that end the request (matched on the detokenised text)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request (kept, like EOS)
    prompt_logprobs: int | None = None  # alternatives to report per prompt token; None: the prompt is not scored
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    deadline: float | None = None  # (perf_counter) it ends at the first step after this, finish reason "length"


@dataclasses.dataclass(eq=False)
class Placement:
    """Where the request runs: a decode slot, its pages, how much of its prompt is in them."""

    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # prompt tokens whose K/V this admission shares from the prefix cache (not prefilled)
    offset: int = 0  # tokens generated before the current admission (a preempted row recomputes them)
    prefilled: int = 0  # positions of this admission's prompt in the cache so far (chunked prefill)
    preemptions: int = 0


@dataclasses.dataclass(eq=False)
class Output:
    """What the request produced, and how it ended."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    exit_layers: list[int] = dataclasses.field(default_factory=list)
    confident_layers: list[int] = dataclasses.field(default_factory=list)  # the row's own first confident layer
    token_logprobs: list[float] = dataclasses.field(default_factory=list)  # with `logprobs`
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # With `prompt_logprobs`, per prompt token (None for the first: nothing precedes it):
    prompt_token_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    # Self-speculation's `SpecCounters` of the row (drafted, accepted, rounds, ...; by depth, a
    # tuple: set when the request ends).
    spec_counters: dict[str, int | tuple[int, ...]] = dataclasses.field(default_factory=dict)
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string), "length", "cancelled",
    # "abort" (the server shut down before it ended), "error" (a step failed on it: see `error`)
    error: str | None = None
    ending: str | None = None  # the finish reason it ends with once the step in flight is read (cancelled)
    timed_out: bool = False  # it ended at its deadline


class Sequence:
    """A request inside the engine, and what the caller reads back: `tokens` grow as they are
    generated; `stream()` yields them; `result()` waits for the end."""

    def __init__(self, request: Request):
        self.request = request
        self.placement = Placement()
        self.output = Output()
        # The adaptive policy turned its speculation off (`SpeculationPolicy.turned_off`): plain
        # full-depth steps from then on, its draft not kept up.
        self.spec_off = False
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._listeners: list = []

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, {self.placement}, finish_reason={self.finish_reason!r})"

    @property
    def drafted(self) -> int:
        """Self-speculation drafts judged (0 until the request ends)."""
        return self.spec_counters.get("drafted", 0)

    @property
    def accepted(self) -> int:
        """Self-speculation drafts accepted (0 until the request ends)."""
        return self.spec_counters.get("accepted", 0)

    @property
    def speculating(self) -> bool:
        """Whether its decode programs are speculation rounds (or plain steps in their place)."""
        return self.spec is not None and not self.spec_off

    @property
    def scoring_prompt(self) -> bool:
        """Whether its prefill must still score prompt tokens (`prompt_logprobs`)."""
        return self.prompt_logprobs is not None and len(self.prompt_token_logprobs) < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Sequence:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        return self

    def stream(self):
        """Yields each new token id as it is generated, until the request ends."""
        while True:
            token = self._events.get()
            if token is None:
                return
            yield token

    def listen(self, callback) -> None:
        """Calls `callback()` now and then, from the engine's thread, whenever tokens arrive or
        the request ends (an event loop's `call_soon_threadsafe`, say: it must be quick)."""
        self._listeners.append(callback)
        callback()

    def publish(self, tokens: list[int]) -> None:
        """Streams new tokens (already appended to `tokens`) and tells the listeners (Delivery)."""
        for token in tokens:
            self._events.put(token)
        self._notify()

    def close(self) -> None:
        """Ends the stream and wakes whoever waits (Delivery, once `finish_reason` is set)."""
        self._events.put(None)
        self._done.set()
        self._notify()

    def _notify(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # a listener that went away (its event loop closed) stops nothing
                self._listeners.remove(callback)


PIECES = {"request": Request, "placement": Placement, "output": Output}

# Each piece's fields read as the Sequence's own, read-only (no setter: a part writes its piece).
for _piece, _cls in PIECES.items():
    for _field in dataclasses.fields(_cls):
        setattr(Sequence, _field.name, property(operator.attrgetter(f"{_piece}.{_field.name}")))
