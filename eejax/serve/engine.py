"""The serving engine: a fixed number of decode slots over one preallocated paged KV cache,
iteration-level (continuous) batching, jitted programs drawn from a bounded set of shapes.

Each `step()`: finished rows leave (their pages return), the scheduler admits waiting requests
into free slots (a bucketed prefill writes their prompts' K/V and their first token into the
slot state), and one decode step runs for every slot. The host never waits for a step it just
dispatched: it dispatches step k + 1, then reads step k's tokens (one step behind), so host work
overlaps device work; a row that finished at step k idles through step k + 1.

Per-request max_new_tokens, the absolute position of a row's tokens and its PRNG key ride on
device in the `DecodeState` (`limit`, `start`, `keys`), so a request decodes as `generate` with
its own options decodes it (its λ(t) schedule, its seed), whatever else shares the slots; the
programs are compiled for the engine's `max_new_tokens` (their record width).

Pages: a row's pages always cover every position the step being dispatched can write, the step
still in flight counted (`Engine._span`); writes past a row's block table go to the null page.
A request is accepted only if admission could start it in an empty cache (`max_len`).

Faults: a program that raises fails only the requests it ran for (finish reason "error"); lost
device state is rebuilt; the background loop survives any step and, if it dies itself, says so
(`alive`, `error`). Sampling values are traced per row; early-exit / speculation options are
static, and at most `max_decoding_options` of them are served, so the programs stay bounded.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import PageAllocator, init_cache, page_bytes, pages_needed, prefix_keys
from eejax.config import ExitConfig, SpecConfig
from eejax.decode import speculative, steps
from eejax.decode.buckets import bucket
from eejax.decode.generate import parse_bytes
from eejax.decode.prompts import prompt_token_ids
from eejax.decode.sampling import RowSampling, SamplingParams, seed_key
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.models import exits
from eejax.models.registry import model_module
from eejax.serve.scheduler import BucketScheduler, Request, safe_pages
from eejax.serve.stops import first_stop

log = logging.getLogger("eejax.serve")

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request inside the engine, and what the caller reads back: `tokens` grow as they are
    generated; `stream()` yields them; `result()` waits for the end."""

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
    drafted: int = 0  # self-speculation drafts judged and accepted (set when the request ends)
    accepted: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    exit_layers: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[float] = dataclasses.field(default_factory=list)  # with `logprobs`
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string), "length", "cancelled",
    # "abort" (the server shut down before it ended), "error" (a step failed on it: see `error`)
    error: str | None = None
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    offset: int = 0  # tokens generated before the current admission (a preempted row recomputes them)
    cached: int = 0  # prompt tokens whose K/V this admission shares from the prefix cache (not prefilled)
    prefilled: int = 0  # positions of this admission's prompt in the cache so far (chunked prefill)
    preemptions: int = 0
    _events: queue.Queue = dataclasses.field(default_factory=queue.Queue, repr=False)
    _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    _listeners: list = dataclasses.field(default_factory=list, repr=False)

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

    def _notify(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # a listener that went away (its event loop closed) stops nothing
                self._listeners.remove(callback)


def _insert_rows(state: steps.DecodeState, new: steps.DecodeState, slots):
    """`new`'s rows written into `state` at `slots` (out-of-range slots, the prefill's padding
    rows, are dropped); a log-prob record only when `new` has one."""
    def put(old, fresh):
        return old.at[slots].set(fresh, mode="drop")

    rows = {f.name: jax.tree.map(put, getattr(state, f.name), getattr(new, f.name))
            for f in dataclasses.fields(state)
            if f.name != "context" and getattr(new, f.name) is not None}
    return dataclasses.replace(state, **rows)


def prefill_slots(params, cache, state, tokens, lengths, block_table, slots, keys, start, limit, sampling, offset,
                  *, config, sampler, max_new_tokens, eos_ids, attention, logprobs):
    """Prefills right-padded prompts into decode slots `slots` [b] of `state`: tokens [b, T] are
    positions offset..lengths-1 of each row (offset [b]: a shared prefix already cached), with
    the rows' keys [b, 2], start [b] (tokens generated before, recomputed), limit [b] (max new
    tokens from there) and sampling (`RowSampling` [b]). Returns (state, cache)."""
    new, cache = steps.prefill(params, cache, tokens, lengths, block_table, keys, start, limit, sampling, offset,
                               config=config, sampler=sampler, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                               attention=attention, logprobs=logprobs)
    return _insert_rows(state, new, slots), cache


def decode_slots(params, cache, state, block_table, group, *, config, sampler, max_new_tokens, eos_ids,
                 exit_config, attention, logprobs):
    """One decode step of the slots in `group` [S] bool that are not done (the others wait: they
    run with their own options in another program)."""
    waiting = ~group & ~state.done
    new, cache = steps.decode(params, cache, dataclasses.replace(state, done=state.done | waiting), block_table,
                              config=config, sampler=sampler, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              exit_config=exit_config, attention=attention, logprobs=logprobs)
    return dataclasses.replace(new, done=jnp.where(waiting, False, new.done)), cache


def spec_round_slots(params, cache, state, counters, block_table, group, *, config, spec, sampler,
                     max_new_tokens, eos_ids, attention, logprobs):
    """One self-speculation round (d drafts from layers [0, E), one verify pass of the rest) of
    the slots in `group` that are not done; the others wait. Returns (state, cache, counters)."""
    waiting = ~group & ~state.done
    masked = dataclasses.replace(state, done=state.done | waiting)
    drafts, masked, cache = speculative.draft(params, cache, masked, block_table, config=config, spec=spec,
                                              num_speculations=spec.num_speculations, sampler=sampler,
                                              attention=attention)
    new, cache, counters = speculative.verify(params, cache, masked, drafts, counters, block_table, config=config,
                                              spec=spec, sampler=sampler, max_new_tokens=max_new_tokens,
                                              eos_ids=eos_ids, attention=attention, logprobs=logprobs)
    return dataclasses.replace(new, done=jnp.where(waiting, False, new.done)), cache, counters


def empty_state(slots: int, max_new_tokens: int) -> steps.DecodeState:
    zeros = jnp.zeros((slots,), jnp.int32)
    record = jnp.zeros((slots, max_new_tokens), jnp.int32)
    return steps.DecodeState(last_token=zeros, seq_len=zeros, num_generated=zeros,
                             done=jnp.ones((slots,), bool), tokens=record, exit_layers=record,
                             confident_layers=record, keys=jnp.zeros((slots, 2), jnp.uint32), start=zeros,
                             limit=zeros, sampling=jax.tree.map(jnp.asarray, RowSampling.of(SamplingParams(), slots)),
                             logprobs=steps.LogprobRecord.zeros(slots, max_new_tokens))


class Engine:
    """Continuous batching over `max_slots` decode slots and one paged cache of `cache_budget`;
    `pages="grow"` hands pages out as rows grow and preempts when they run out.

        engine = Engine(model, max_slots=8)
        seq = engine.submit("The capital of France is", max_new_tokens=16)
        engine.run()                     # or engine.start() for a background loop
        seq.tokens, seq.finish_reason
    """

    def __init__(self, model, *, max_slots: int = 8, max_new_tokens: int = 256, cache_budget: int | str = "1GiB",
                 page_size: int = 16, exit: ExitConfig | str | None = None,  # noqa: A002
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 policy: str = "fcfs", bucketing: bool = True, online: bool = True, attention: str = "auto",
                 pages: str = "reserve", max_decoding_options: int = 16, prefix_caching: bool = True,
                 prefill_chunk: int | None = None):
        config = model.config
        if model_module(config).ENCODER_DECODER:
            raise UnsupportedModelError("the serving engine runs decoder-only (Llama) models")
        if max_slots < 1 or max_new_tokens < 1 or page_size < 1:
            raise EejaxError("max_slots, max_new_tokens and page_size must be >= 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise EejaxError(f"prefill_chunk must be >= 1 prompt tokens per step (or None: whole prompts), "
                             f"got {prefill_chunk}")
        self.model, self.config = model, config
        self.exit_config = self.checked_exit(exit)
        if pages not in ("reserve", "grow"):
            raise EejaxError(f"pages must be 'reserve' or 'grow', got {pages!r}")
        self.slots, self.max_new_tokens, self.page_size = max_slots, max_new_tokens, page_size
        # reserve: a row gets the pages of prompt + max tokens at admission (never runs out);
        # grow: the pages of its prompt, then one more as it needs it, preempting the
        # lowest-priority row (recomputed later) when none is free.
        self.grow = pages == "grow"
        # Full pages of prompt tokens are kept under a key of their prefix and shared by later
        # prompts that start alike (`PageAllocator.match`): a prefill then starts after them.
        self.prefix_caching = prefix_caching
        # Chunked prefill: at most this many prompt tokens are prefilled per step (oldest
        # admission first), between the decode steps of the running rows; None: whole prompts.
        self.prefill_chunk = prefill_chunk
        per_page = page_bytes(config.num_layers, page_size, config.num_kv_heads, config.head_dim, model.dtype)
        num_pages = parse_bytes(cache_budget) // per_page
        # The longest request admission can always start: it keeps 10% of the free pages back,
        # so a request needing more pages than that share of an empty cache would wait forever.
        # (A preempted row comes back needing up to all of its pages, in either page mode.)
        self.cache_len = max(safe_pages(num_pages - 1), 0) * page_size
        self.max_len = min(config.max_position_embeddings, self.cache_len)
        if self.max_len < 2:
            raise EejaxError(f"KV cache budget {cache_budget} holds no sequence")
        self.table_width = bucket(pages_needed(self.max_len, page_size))
        self.cache = init_cache(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim,
                                model.dtype)
        self.allocator = PageAllocator(num_pages)
        self.scheduler = BucketScheduler(self.max_len + 1, page_size, policy=policy, bucketing=bucketing,
                                         online=online, max_rows=max_slots)
        self.sampling = SamplingParams(float(temperature), int(top_k), float(top_p))  # a request's default
        self.sampling.check_vocab(config.vocab_size)
        self.static = dict(config=config, max_new_tokens=max_new_tokens, eos_ids=model.eos_token_ids,
                           attention=attention)
        self._seeds = np.random.default_rng(seed)  # a request without a seed draws one from here
        # Early-exit and speculation options are static in the programs (each compiles its own):
        # at most `max_decoding_options` distinct ones, so that no client keeps the server compiling.
        self.max_decoding_options = max_decoding_options
        self.decoding_options: set = {(self.exit_config, None)}
        self.state = empty_state(max_slots, max_new_tokens)
        self.spec_counters = speculative.SpecCounters.zeros(max_slots)
        self.block_table = np.zeros((max_slots, self.table_width), np.int32)
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.prefilling: dict[int, Sequence] = {}  # slot -> admitted sequence whose prompt is not all cached yet
        self.waiting: dict[int, Sequence] = {}  # id -> sequence
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending = None  # (state, slot -> sequence) of the last dispatched step, not read yet
        self.error: BaseException | None = None  # what stopped the background loop, if it died
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        from eejax.serve.metrics import ServeMetrics

        self.prometheus = ServeMetrics(config.num_layers)
        self.counters = {"steps": 0, "prefills": 0, "preemptions": 0, "generated_tokens": 0, "padding_tokens": 0,
                         "prompt_tokens": 0, "prefix_cache_hit_tokens": 0, "scheduler_s": 0.0, "step_s": 0.0}

    # -- requests ------------------------------------------------------------------------------
    def checked_exit(self, exit) -> ExitConfig | None:  # noqa: A002
        """An early-exit option (ExitConfig or its CLI spelling) checked against the model."""
        config = ExitConfig.parse(exit) if isinstance(exit, str) else exit
        if config is not None:
            config, _ = exits.resolve_options(self.model.params, self.config, exit=config)
        return config

    def fresh_seed(self) -> int:
        """A seed for a request that names none (drawn from the engine's own seed)."""
        return int(self._seeds.integers(0, 2**31 - 1))

    def submit(self, prompt, *, max_new_tokens: int = 64, priority: int = 0, exit=None,  # noqa: A002
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               spec: SpecConfig | str | None = None, seed: int | None = None, choice: int = 0,
               logprobs: int | None = None, stop=(), stop_token_ids=()) -> Sequence:
        """Queues a prompt (text or token ids); returns its Sequence at once. `exit` overrides the
        engine's early-exit option for this request ("none" = full depth), `spec` ("E:d") decodes
        it by self-speculation, `temperature`, `top_k`, `top_p` set its sampling (traced values:
        a new setting compiles nothing). Sampled tokens depend only on the prompt,
        the options, `seed` and `choice`: they are row `choice` of `generate(seed=seed)`.
        `logprobs` (0 to 20 alternatives) records each token's log-probability; `stop` (strings)
        and `stop_token_ids` end the request like EOS does."""
        spec_config = SpecConfig.parse(spec) if isinstance(spec, str) else spec
        if spec_config is not None:
            if exit not in (None, "none"):
                raise EejaxError("choose early exit (exit) or self-speculation (spec), not both")
            if spec_config.adaptive:
                raise EejaxError("the engine runs a fixed number of drafts per round: use spec E:d, not adaptive")
            exits.resolve_options(self.model.params, self.config, spec=spec_config)
            exit = "none"  # noqa: A001
        default = self.sampling
        sampling = SamplingParams(default.temperature if temperature is None else float(temperature),
                                  default.top_k if top_k is None else int(top_k),
                                  default.top_p if top_p is None else float(top_p))
        sampling.check_vocab(self.config.vocab_size)
        exit_config = self.exit_config if exit is None else (None if exit == "none" else self.checked_exit(exit))
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise EejaxError(f"max_new_tokens must lie in [1, {self.max_new_tokens}], got {max_new_tokens}")
        (ids,), _ = prompt_token_ids(self.model.tokenizer, [prompt] if isinstance(prompt, str) else [list(prompt)])
        if len(ids) + max_new_tokens > self.max_len:
            bound = (f"the model's context of {self.max_len} tokens" if self.max_len < self.cache_len else
                     f"the {self.max_len} tokens a request may hold in this server's KV cache "
                     f"({self.allocator.num_pages - 1} pages of {self.page_size} tokens, of which admission grants at "
                     f"most 90%)")
            raise EejaxError(f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds {bound}")
        if max(ids) >= self.config.vocab_size or min(ids) < 0:
            raise EejaxError(f"token ids must lie in [0, {self.config.vocab_size})")
        if logprobs is not None and not 0 <= logprobs <= steps.TOP_LOGPROBS:
            raise EejaxError(f"logprobs must lie in [0, {steps.TOP_LOGPROBS}], got {logprobs}")
        stop, stop_token_ids = tuple(stop), tuple(int(t) for t in stop_token_ids)
        if not all(isinstance(x, str) and x for x in stop):
            raise EejaxError("stop strings must be non-empty strings")
        if stop and self.model.tokenizer is None:
            raise EejaxError("stop strings need a model with a tokenizer (use stop_token_ids)")
        if any(not 0 <= t < self.config.vocab_size for t in stop_token_ids):
            raise EejaxError(f"stop_token_ids must lie in [0, {self.config.vocab_size})")
        if not 0 <= choice < 2**31:
            raise EejaxError(f"choice must lie in [0, 2^31), got {choice}")
        seed = self.fresh_seed() if seed is None else int(seed)
        if not -(2**63) <= seed < 2**64:
            raise EejaxError(f"seed must be a 64-bit integer, got {seed}")
        key = np.asarray(jax.random.fold_in(seed_key(seed), choice))
        with self._lock:
            self._count_decoding_options(exit_config, spec_config)
            seq = Sequence(next(self._ids), ids, max_new_tokens, priority, exit_config, sampling, spec_config, key,
                           logprobs, stop, stop_token_ids)
            self._queue(seq)
        self._wake.set()
        return seq

    def _count_decoding_options(self, exit_config, spec_config) -> None:
        """Adds a request's early-exit / speculation option to those served, or refuses a new one
        past `max_decoding_options` (each compiles its own programs)."""
        options = (exit_config, spec_config)
        if options in self.decoding_options:
            return
        if len(self.decoding_options) >= self.max_decoding_options:
            served = sorted("spec " + s.spec if s else "exit " + (e.spec if e else "none")
                            for e, s in self.decoding_options)
            raise EejaxError(f"this server compiles programs for at most {self.max_decoding_options} early-exit / "
                             f"speculation options and has them all; use one of: {', '.join(served)}")
        self.decoding_options.add(options)

    def _queue(self, seq: Sequence) -> None:
        """Hands `seq` (new, or preempted: its prompt then grows by the tokens it has) to the
        scheduler, which counts the pages admission must find: all of them, or with `grow`,
        those of the prompt and one token."""
        prompt_len = len(seq.prompt) + len(seq.tokens)
        remaining = seq.max_new_tokens - len(seq.tokens)
        request = Request(seq.id, prompt_len, 1 if self.grow else remaining, arrival=seq.submitted_at,
                          priority=seq.priority)
        self._requests[seq.id] = request
        self.waiting[seq.id] = seq
        self.scheduler.submit(request)

    def cancel(self, seq: Sequence) -> None:
        """Ends a request now (a client that went away): its slot and pages are freed."""
        with self._lock:
            if seq.finished:
                return
            if seq.id in self.waiting:
                self.scheduler.remove(self._requests[seq.id])
                del self.waiting[seq.id]
                self._finish(seq, "cancelled")
            elif seq.slot is not None and self.prefilling.get(seq.slot) is seq:  # no tokens in flight
                self._release(seq)
                self._finish(seq, "cancelled")
            else:
                seq.finish_reason = "cancelled"  # released after the step in flight

    def _in_slots(self) -> list[Sequence]:
        """The rows that hold a slot: decoding, or prefilling their prompt."""
        return list(self.running.values()) + list(self.prefilling.values())

    @property
    def busy(self) -> bool:
        return bool(self.running or self.prefilling or self.waiting or self._pending)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> None:
        """One iteration: admit into free slots, dispatch a decode step, read the previous one.
        A program that fails fails only the requests it ran for (see `_guarded`)."""
        start = time.perf_counter()
        with self._lock:
            self._admit()
            self._prefill_some()
            if self.grow:
                self._grow()
            pending = self._pending
            if self.running:
                table = self._table()
                # One program per (early exit, sampler, speculation, log-probs) option among the
                # running rows (usually one); the other rows wait through it.
                for options in {self._options(seq): None for seq in self.running.values()}:
                    members = [seq for seq in self.running.values() if self._options(seq) == options]
                    group = np.zeros((self.slots,), bool)
                    group[[seq.slot for seq in members]] = True
                    self._guarded(members, self._dispatch, table, jnp.asarray(group), *options)
            self._pending = (self.state, dict(self.running), self.spec_counters) if self.running else None
            if pending is not None:
                self._read(*pending)
        self.counters["step_s"] += time.perf_counter() - start

    def _dispatch(self, table, group, exit_config, sampler: str, spec, logprobs: bool) -> None:
        """Dispatches one decode step (or speculation round) of the slots in `group`."""
        if spec is None:
            program, args = self._decode_program(table, group, exit_config, sampler, logprobs)
            self.state, self.cache = program(*args)
        else:
            args = (self.model.params, self.cache, self.state, self.spec_counters, table, group)
            static = dict(self.static, spec=spec, sampler=sampler, logprobs=logprobs)
            program = self.model.programs.get(spec_round_slots, args, static, donate_argnums=(1,))
            self.state, self.cache, self.spec_counters = program(*args)
        self.counters["steps"] += 1

    # -- faults --------------------------------------------------------------------------------
    def _guarded(self, seqs: list[Sequence], work, *args) -> None:
        """Runs `work(*args)`, a program over the rows of `seqs`. If it raises, those requests
        end with finish reason "error" (pages freed) and the others go on; if the device state
        (cache, slot state) did not survive, every running request fails and it is rebuilt."""
        try:
            work(*args)
        except Exception as e:  # noqa: BLE001 - whatever a program raises fails its requests only
            log.exception("a step failed; failing requests %s", [seq.id for seq in seqs])
            if not self._device_state_ok():
                self._reset_device_state(e)
            self._fail(seqs, e)

    def _device_state_ok(self) -> bool:
        try:
            jax.block_until_ready((self.cache, self.state, self.spec_counters))
            return True
        except Exception:  # noqa: BLE001 - donated to a program that failed, or computed by one
            return False

    def _reset_device_state(self, error: BaseException) -> None:
        """A fresh cache and slot state after they were lost: every running request fails."""
        log.error("the device state was lost; failing %d running requests", len(self.running))
        c = self.config
        self.cache = init_cache(c.num_layers, self.allocator.num_pages, self.page_size, c.num_kv_heads, c.head_dim,
                                self.model.dtype)
        self.state = empty_state(self.slots, self.max_new_tokens)
        self.spec_counters = speculative.SpecCounters.zeros(self.slots)
        self._pending = None
        self._fail(self._in_slots(), error)

    def _fail(self, seqs: list[Sequence], error: BaseException) -> None:
        """Ends `seqs` (running or waiting) with finish reason "error"; the lock is held."""
        for seq in seqs:
            if seq.finished:
                continue
            if self.waiting.pop(seq.id, None) is not None:
                self.scheduler.remove(self._requests[seq.id])
            self._release(seq)
            seq.error = f"{type(error).__name__}: {error}"
            self._finish(seq, "error")

    def _recover(self, error: BaseException) -> None:
        """After a step raised outside any one program: its requests (the running ones; the
        waiting ones if none ran, so that a fault in admission cannot repeat forever) fail."""
        with self._lock:
            victims = self._in_slots() or list(self.waiting.values())
            if not self._device_state_ok():
                self._reset_device_state(error)
            self._pending = None
            self._fail(victims, error)

    @property
    def alive(self) -> bool:
        """Whether the background loop is running (started, not stopped, not died)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def abort(self, reason: str = "abort", lock_timeout: float = 1.0) -> int:
        """Ends every request now with finish reason `reason` (a server shutting down at its
        deadline); returns how many. If the loop is stuck inside a program for longer than
        `lock_timeout`, the requests still end for their callers (the engine is going away)."""
        locked = self._lock.acquire(timeout=lock_timeout)
        try:
            seqs = list(self.waiting.values()) + self._in_slots()
            for seq in seqs:
                if seq.finished:
                    continue
                if locked:
                    if self.waiting.pop(seq.id, None) is not None:
                        self.scheduler.remove(self._requests[seq.id])
                    self._release(seq)
                self._finish(seq, reason)
            return len(seqs)
        finally:
            if locked:
                self._lock.release()

    def run(self) -> None:
        """Steps until every submitted request has finished."""
        while self.busy:
            self.step()

    def generate_offline(self, prompts, *, max_new_tokens: int = 64, progress: bool = True) -> list[Sequence]:
        """Runs a batch job to the end (in this thread) with a progress bar over finished requests;
        returns the Sequences in the prompts' order."""
        from tqdm.auto import tqdm

        seqs = [self.submit(p, max_new_tokens=max_new_tokens) for p in prompts]
        with tqdm(total=len(seqs), desc="requests", disable=not progress) as bar:
            while self.busy:
                self.step()
                bar.update(sum(s.finished for s in seqs) - bar.n)
        return seqs

    def start(self) -> None:
        """Runs the loop in a background thread (what the HTTP server uses) until `stop()`."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="eejax-engine", daemon=True)
        self._thread.start()

    def stop(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Stops the background loop after finishing (or, with `cancel`, cancelling) all requests.
        Waits at most `timeout` seconds for the loop (None: until it ends); False if it did not end."""
        if cancel:
            with self._lock:
                seqs = list(self.waiting.values()) + self._in_slots()
            for seq in seqs:
                self.cancel(seq)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine loop did not stop within %s s", timeout)
                return False
            self._thread = None
        return True

    def _loop(self) -> None:
        try:
            while True:
                if self.busy:
                    try:
                        self.step()
                    except Exception as e:  # noqa: BLE001 - the loop lives on for the other requests
                        log.exception("an engine step failed")
                        self._recover(e)
                    continue
                if self._stopping.is_set():
                    return
                self._wake.wait(0.05)
                self._wake.clear()
        except BaseException as e:  # the loop itself died: nothing will be served any more
            self.error = e
            log.critical("the engine loop died", exc_info=True)
            self.abort("error", lock_timeout=0)

    @staticmethod
    def _options(seq: Sequence) -> tuple:
        """What a row's decode program depends on besides shapes; rows alike share one. (Greedy
        rows never share a program with sampled ones: their argmax runs alone; nor do rows that
        filter (top-k / top-p: a sort) with rows that only scale.)"""
        return seq.exit, seq.sampling.sampler, seq.spec, seq.logprobs is not None

    def _table(self):
        longest = max(self._span(s) for s in self.running.values())
        width = min(self.table_width, bucket(pages_needed(longest, self.page_size)))
        return jnp.asarray(self.block_table[:, :width])

    @staticmethod
    def _span(seq: Sequence) -> int:
        """Cache positions a running row may have written once the step about to be dispatched
        has run. The host reads a step's tokens after dispatching the next one, so beyond the
        prompt and the tokens read back the device may hold those of the step in flight (1; a
        speculation round d + 1) and, until the first read after admission, the prefill's token;
        the new step then writes up to d positions past the row's last token (a round's drafts).
        Never more than prompt + max tokens - 1: nothing past a row's limit is written."""
        d = 0 if seq.spec is None else seq.spec.num_speculations
        unread = (d + 1) + (len(seq.tokens) == seq.offset)
        return min(len(seq.prompt) + len(seq.tokens) + unread + d, len(seq.prompt) + seq.max_new_tokens - 1)

    def _admit(self) -> None:
        free = [s for s in range(self.slots) if s not in self.running and s not in self.prefilling]
        start = time.perf_counter()
        chosen = self.scheduler.admit(len(free), self.allocator.num_free)
        self.counters["scheduler_s"] += time.perf_counter() - start
        seqs = [self.waiting.pop(r.id) for r in chosen]
        for seq, slot in zip(seqs, free):
            seq.offset = len(seq.tokens)
            tokens = len(seq.prompt) + (seq.offset + 1 if self.grow else seq.max_new_tokens)
            shared = self._shared_prefix(seq)
            try:  # (admission counted every page as fresh: a shared one only lowers the need)
                fresh = self.allocator.allocate(pages_needed(tokens, self.page_size) - len(shared))
            except BaseException:
                self.allocator.free(shared)
                raise
            seq.slot, seq.pages, seq.cached = slot, shared + fresh, len(shared) * self.page_size
            seq.prefilled = seq.cached
            self.block_table[slot] = 0
            self.block_table[slot, : len(seq.pages)] = seq.pages
            self.prefilling[slot] = seq

    def _prefill_some(self) -> None:
        """Prefills the admitted rows' prompts: whole, or with `prefill_chunk`, that many tokens
        in all this step, the oldest admission first. A row whose prompt is then complete has
        sampled its first token and decodes from the next step."""
        budget = self.prefill_chunk or float("inf")
        work = []
        for seq in self.prefilling.values():
            if budget <= 0:
                break
            end = int(min(len(seq.prompt) + seq.offset, seq.prefilled + budget))
            budget -= end - seq.prefilled
            work.append((seq, end))

        # The prefill samples each row's first token: one program per (sampler, log-probs) option.
        def options(item):
            return item[0].sampling.sampler, item[0].logprobs is not None

        for group in {options(item): None for item in work}:
            members = [item for item in work if options(item) == group]
            self._guarded([seq for seq, _ in members], self._prefill, members, *group)

    def _shared_prefix(self, seq: Sequence) -> list[int]:
        """The cached pages of the longest prefix of `seq`'s prompt that it shares, one more
        hold each; at least the last token is left to prefill (it gives the first new token)."""
        if not self.prefix_caching:
            return []
        shareable = (len(seq.prompt) + seq.offset - 1) // self.page_size
        return self.allocator.match(prefix_keys(seq.prompt, self.page_size)[:shareable])

    def _publish(self, seq: Sequence) -> None:
        """Keys the row's full prompt pages, now written (prefills run in order on the device):
        later prompts that start alike share them. Only prompt pages, computed at full depth by
        the prefill, so they are valid for any early-exit or speculation setting."""
        if self.prefix_caching:
            for page, key in zip(seq.pages, prefix_keys(seq.prompt, self.page_size)):
                self.allocator.publish(page, key)

    def _prefill(self, work: list[tuple[Sequence, int]], sampler: str, logprobs: bool) -> None:
        """One prefill program over rows (seq, end): positions seq.prefilled..end-1 of each. A row
        that ends its prompt there is written into its decode slot; the others only fill the
        cache (their slot index is out of range, so the row is dropped)."""
        b = bucket(len(work))  # 1, 2, 3, 4, 6, 8, ...: little row padding, few programs
        t = bucket(max(end - seq.prefilled for seq, end in work), MIN_PROMPT_BUCKET)
        longest = bucket(max(end for _, end in work), MIN_PROMPT_BUCKET)
        tokens = np.zeros((b, t), np.int32)
        lengths, start, limit, offset = (np.zeros((b,), np.int32) for _ in range(4))
        keys = np.zeros((b, 2), np.uint32)
        slots = np.full((b,), self.slots, np.int32)  # padding rows and unfinished prompts: dropped
        table = np.zeros((b, self._prefill_width(longest)), np.int32)
        sampling = RowSampling.of([seq.sampling for seq, _ in work] + [SamplingParams()] * (b - len(work)))
        for j, (seq, end) in enumerate(work):
            prompt = seq.prompt + seq.tokens[: seq.offset]
            tokens[j, : end - seq.prefilled] = prompt[seq.prefilled:end]
            lengths[j], start[j], limit[j] = end, seq.offset, seq.max_new_tokens - seq.offset
            keys[j], offset[j] = seq.key, seq.prefilled
            slots[j] = seq.slot if end == len(prompt) else self.slots
            table[j] = self.block_table[seq.slot, : table.shape[1]]
            # The prefill writes positions prefilled.. only, into pages no one shares.
            assert all(self.allocator.writable(p) for p in seq.pages[seq.prefilled // self.page_size:]), seq.id
        program, args = self._prefill_program(tokens, lengths, table, slots, keys, start, limit, sampling, offset,
                                              sampler, logprobs)
        self.state, self.cache = program(*args)
        self.spec_counters = jax.tree.map(lambda x: x.at[slots].set(0, mode="drop"), self.spec_counters)
        for seq, end in work:
            self.prometheus.prefill_chunk.observe(end - seq.prefilled)
            seq.prefilled = end
            if end == len(seq.prompt) + seq.offset:  # the prompt is complete: the row decodes
                del self.prefilling[seq.slot]
                self.running[seq.slot] = seq
                self._publish(seq)
                self.counters["prompt_tokens"] += end
                self.counters["prefix_cache_hit_tokens"] += seq.cached
                self.prometheus.prompt_tokens.inc(end)
                self.prometheus.prefix_hits.inc(seq.cached)
        self.counters["prefills"] += 1
        self.counters["padding_tokens"] += int(b * t - (lengths - offset).sum())

    def _prefill_width(self, prompt_bucket: int) -> int:
        return min(self.table_width, bucket(pages_needed(prompt_bucket, self.page_size)))

    def _prefill_program(self, tokens, lengths, table, slots, keys, start, limit, sampling: RowSampling, offset,
                         sampler: str, logprobs: bool = False):
        args = (self.model.params, self.cache, self.state, *map(jnp.asarray, (tokens, lengths, table, slots, keys,
                                                                               start, limit)),
                jax.tree.map(jnp.asarray, sampling), jnp.asarray(offset))
        static = dict(self.static, sampler=sampler, logprobs=logprobs)
        return self.model.programs.get(prefill_slots, args, static, donate_argnums=(1,)), args

    def _decode_program(self, table, group, exit_config: ExitConfig | None, sampler: str, logprobs: bool = False):
        args = (self.model.params, self.cache, self.state, table, group)
        static = dict(self.static, exit_config=exit_config, sampler=sampler, logprobs=logprobs)
        return self.model.programs.get(decode_slots, args, static, donate_argnums=(1,)), args

    def warmup(self, max_prompt_len: int | None = None, progress: bool = True) -> int:
        """Compiles ahead of the first requests the programs they will need with the engine's
        own options: prefill for every batch bucket up to the slots x every prompt bucket up to
        `max_prompt_len` (default: the context), decode for every page-table width up to that
        prompt + max new tokens. Nothing runs. Returns how many programs were new."""
        from tqdm.auto import tqdm

        max_prompt_len = min(max_prompt_len or self.max_len, self.max_len)
        batches = sorted({bucket(n) for n in range(1, self.slots + 1)})
        prompts = sorted({bucket(n, MIN_PROMPT_BUCKET) for n in range(1, max_prompt_len + 1)})
        longest = min(max_prompt_len + self.max_new_tokens - 1, self.max_len)
        widths = sorted({min(self.table_width, bucket(pages_needed(n, self.page_size)))
                         for n in range(1, longest + 1)})
        sampler, before = self.sampling.sampler, self.model.programs.num_programs
        shapes = [(b, t) for b in batches for t in prompts] + [(None, w) for w in widths]
        for b, n in tqdm(shapes, desc="compiling", disable=not progress):
            if b is None:  # decode at table width n
                table = jnp.zeros((self.slots, n), jnp.int32)
                group = jnp.zeros((self.slots,), bool)
                self._decode_program(table, group, self.exit_config, sampler)
            else:  # prefill of b rows of n tokens
                zeros = np.zeros((b,), np.int32)
                self._prefill_program(np.zeros((b, n), np.int32), zeros,
                                      np.zeros((b, self._prefill_width(n)), np.int32), zeros,
                                      np.zeros((b, 2), np.uint32), zeros, zeros, RowSampling.of(self.sampling, b),
                                      zeros, sampler)
        return self.model.programs.num_programs - before

    def _read(self, state, running: dict[int, Sequence], counters) -> None:
        """Delivers the tokens a finished step produced; releases rows that ended (EOS, limit,
        stop token or string, cancelled). If the step failed on the device, its requests fail."""
        wanted = (state.num_generated, state.done, state.tokens, state.exit_layers, counters.drafted,
                  counters.accepted)
        scored = any(seq.logprobs is not None for seq in running.values())
        out = {}

        def fetch():
            out["host"] = jax.device_get(wanted + (state.logprobs if scored else None,))

        self._guarded(list(running.values()), fetch)
        if "host" not in out:
            return
        now = time.perf_counter()
        for slot, seq in running.items():
            if not seq.finished and self.running.get(slot) is seq:  # else ended, or preempted (recomputed later)
                self._guarded([seq], self._deliver, seq, slot, *out["host"], now)

    def _deliver(self, seq: Sequence, slot: int, num, done, tokens, layers, drafted, accepted, record, now) -> None:
        """Appends a row's new tokens (and log-probs) to its Sequence; releases it if it ended."""
        n = min(seq.offset + int(num[slot]), seq.max_new_tokens)
        stopped = False
        for i in range(len(seq.tokens), n):
            j = i - seq.offset
            seq.tokens.append(int(tokens[slot, j]))
            seq.exit_layers.append(int(layers[slot, j]))
            if seq.logprobs is not None:
                seq.token_logprobs.append(float(record.chosen[slot, j]))
                seq.top_logprobs.append([(int(t), float(x)) for t, x in zip(
                    record.top_ids[slot, j, : seq.logprobs], record.top[slot, j, : seq.logprobs])
                    if np.isfinite(x)])  # tokens that top-k / top-p filtered out cannot be drawn
            seq.token_times.append(now)
            seq._events.put(seq.tokens[-1])
            self.counters["generated_tokens"] += 1
            if self._stops_at(seq):
                stopped = True
                break
        seq._notify()
        if seq.finish_reason == "cancelled" or done[slot] or stopped:
            ended_at_eos = bool(seq.tokens) and seq.tokens[-1] in self.static["eos_ids"]
            seq.drafted, seq.accepted = int(drafted[slot]), int(accepted[slot])
            self._release(seq)
            self._finish(seq, seq.finish_reason or ("stop" if ended_at_eos or stopped else "length"))

    def _stops_at(self, seq: Sequence) -> bool:
        """Whether the request's newest token ends it: a stop token, or a stop string now in its text."""
        if seq.tokens[-1] in seq.stop_token_ids:
            return True
        if not seq.stop:
            return False
        text = self.model.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return first_stop(text, seq.stop) is not None

    def _grow(self) -> None:
        """Gives every running row the pages for the tokens it may hold after the step about to
        be dispatched (its known tokens, one in flight, one more), preempting when none is free."""
        from eejax.errors import OutOfPagesError
        from eejax.serve.scheduler import preemption_victim

        for seq in sorted(self.running.values(), key=lambda s: (-s.priority, s.submitted_at)):
            if seq.slot is None:
                continue  # preempted in this loop
            need = pages_needed(self._span(seq), self.page_size)
            while seq.slot is not None and len(seq.pages) < need:
                try:
                    (page,) = self.allocator.allocate(1)
                except OutOfPagesError:
                    self._preempt(preemption_victim([self._requests[s.id] for s in self.running.values()]))
                    continue
                self.block_table[seq.slot, len(seq.pages)] = page
                seq.pages.append(page)

    def _preempt(self, request: Request) -> None:
        """Frees a running row's slot and pages; it waits again and is recomputed (its prompt and
        the tokens it has) when admitted."""
        seq = next(s for s in self.running.values() if s.id == request.id)
        self._release(seq)
        self._queue(seq)
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        self.prometheus.preemptions.inc()

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None and self.prefilling.get(seq.slot) is seq:
            del self.prefilling[seq.slot]
            self.block_table[seq.slot] = 0
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.block_table[seq.slot] = 0
            # The slot is done on device after the step that ended it; a cancelled row is
            # stopped here.
            self.state = dataclasses.replace(self.state, done=self.state.done.at[seq.slot].set(True))
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []
        seq.slot = None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.prometheus.finished(seq)
        self._requests.pop(seq.id, None)
        seq._events.put(None)
        seq._done.set()
        seq._notify()

    # -- reports -------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        return {
            "waiting": len(self.waiting), "running": len(self.running), "prefilling": len(self.prefilling),
            "slots": self.slots,
            "kv_pages_used": self.allocator.num_allocated, "kv_pages_total": self.allocator.num_free
            + self.allocator.num_allocated, "kv_pages_cached": self.allocator.num_cached,
            "prefix_cache_evictions": self.allocator.evictions, "compiled_programs": self.model.programs.num_programs,
            "buckets": len(self.scheduler.buckets), **self.counters,
        }
