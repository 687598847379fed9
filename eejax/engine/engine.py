"""The serving engine: a fixed number of decode slots over one preallocated paged KV cache,
iteration-level (continuous) batching, jitted programs drawn from a bounded set of shapes.

Each `step()`: finished rows leave (their pages return), the scheduler admits waiting requests
into free slots (a bucketed prefill writes their prompts' K/V and their first token into the
slot state), and one program runs for each group of slots with the same options: several
decode steps (`steps_per_dispatch`), or one when admission would wait on them, or a
speculation round. The host never waits for a program it just dispatched: it dispatches program
k + 1, then reads program k's tokens (one program behind), so host work overlaps device work; a
row that finished in program k idles through program k + 1. `generate` is this loop run to the
end over a batch job (`batch_job=True`). Llama and T5 (its slots keep the rows' cross K/V).

Per-request max_new_tokens, the absolute position of a row's tokens and its PRNG key ride on
device in the `DecodeState` (`limit`, `start`, `keys`), so a request decodes as `generate` with
its own options decodes it (its λ(t) schedule, its seed), whatever else shares the slots; the
programs are compiled for the engine's `max_new_tokens` (their record width).

Pages: a row's pages always cover every position the program being dispatched can write, the
program still in flight counted (`Dispatch.span`); writes past a row's block table go to the null page.
A request is accepted only if admission could start it in an empty cache (`max_len`).

Faults: a program that raises fails only the requests it ran for (finish reason "error"); lost
device state is rebuilt; the background loop survives any step and, if it dies itself, says so
(`alive`, `error`). Sampling values are traced per row; early-exit / speculation options are
static, and at most `max_decoding_options` of them are served, so the programs stay bounded.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax

from eejax.cache import pages_needed
from eejax.decode.buckets import MIN_PROMPT_BUCKET, bucket
from eejax.decode.sampling import SamplingParams
from eejax.decode.spec_policy import auto_speculates, on_cpu
from eejax.engine import inbox, replicas
from eejax.engine.admission import Admission
from eejax.engine.delivery import Delivery
from eejax.engine.device_slots import DeviceSlots
from eejax.engine.dispatch import Dispatch
from eejax.engine.faults import Faults
from eejax.engine.lifecycle import Lifecycle, Loop
from eejax.engine.metrics import ServeMetrics
from eejax.engine.requests import Requests, checked_exit
from eejax.engine.scheduler import BucketScheduler, safe_pages
from eejax.engine.sequence import Sequence
from eejax.engine.slots import SlotPages, SlotTable
from eejax.engine.speculation import Speculation
from eejax.engine.waiting import WaitingQueue
from eejax.engine.warmup import warmup
from eejax.errors import EejaxError, UnsupportedModelError
from eejax.models.registry import model_module
from eejax.options import DEFAULT_SPEC, ExitConfig, SpecConfig, StepOptions

__all__ = ["Engine", "Sequence"]


class Engine:
    """Continuous batching over `max_slots` decode slots and one paged cache of `cache_budget`;
    `pages="grow"` hands pages out as rows grow and preempts when they run out.

        engine = Engine(model, max_slots=8)
        seq = engine.submit("The capital of France is", max_new_tokens=16)
        engine.run()                     # or engine.start() for a background loop
        seq.tokens, seq.finish_reason

    Parts that own their state, reached only through their methods: the requests waiting for a
    slot (`WaitingQueue`, `self.waiting`), the slots, pages and block table (`SlotTable`,
    `self.slot_table`), the arrays on the device (`DeviceSlots`, `self.device`), the programs'
    dispatch and one-behind read (`Dispatch`, `self.dispatch`) with the speculation policies
    (`Speculation`, `self.speculation`), delivery to requests (`Delivery`, `self.delivery`) and
    faults (`Faults`, `self.faults`), admission with prefill (`Admission`, `self.admission`)
    the background loop (`Lifecycle`, `self.lifecycle`) and the front door, `submit`'s checks
    (`Requests`, `self.requests`). This object composes the parts and takes the step.
    """

    def __init__(
        self,
        model,
        *,
        max_slots: int = 8,
        max_new_tokens: int = 256,
        cache_budget: int | str = "1GiB",
        page_size: int = 16,
        exit: ExitConfig | str | None = None,  # noqa: A002
        sampling: SamplingParams | None = None,
        seed: int = 0,
        spec: SpecConfig | str | None = DEFAULT_SPEC,
        policy: str = "fcfs",
        bucketing: bool = True,
        online: bool = True,
        attention: str = "auto",
        pages: str = "reserve",
        max_decoding_options: int = 16,
        prefix_caching: bool = True,
        prefill_chunk: int | None = None,
        steps_per_dispatch: int = 4,
        max_prompt_tokens: int = 512,
        ignore_eos: bool = False,
        batch_job: bool = False,
        **sampling_options,
    ):
        """`exit`, `spec` (early exit or speculation, one of them) and `sampling` (or its options by
        name: temperature=, top_k=, ...) are a request's defaults (a request naming an exit or a
        spec of its own takes neither decoding default; `spec` not given is "auto" unless `exit` is
        given: `options.default_spec`); the other arguments are the class's."""
        config = model.config
        # A batch job (what `generate` runs): every request is submitted before the first step,
        # so admission keeps no pages back for later arrivals, prefills are timed (the host waits
        # for each: `AdmissionCounts.prefill_s`), and across processes each submits the same requests
        # itself (nothing is broadcast from process 0).
        self.batch_job = batch_job
        # An encoder-decoder (T5) encodes the prompt at admission; its cache holds decoder tokens
        # from the start token on, and each slot keeps its row's cross K/V for prompts of up to
        # `max_prompt_tokens` tokens. Its prefill cannot resume from generated tokens or a prefix,
        # so its rows keep their pages (no preemption) and prompts prefill whole, unshared.
        self.encoder_decoder = model_module(config).ENCODER_DECODER
        if self.encoder_decoder:
            if pages != "reserve" or prefill_chunk is not None:
                raise UnsupportedModelError(
                    "an encoder-decoder (T5) engine reserves each row's pages and prefills "
                    "whole prompts: use pages='reserve' and no prefill_chunk"
                )
            if max_prompt_tokens < 1:
                raise EejaxError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
            prefix_caching = False  # no prompt pages to share: the prompt is the encoder's
        self.max_prompt_tokens = max_prompt_tokens if self.encoder_decoder else None
        if max_slots < 1 or max_new_tokens < 1 or page_size < 1:
            raise EejaxError("max_slots, max_new_tokens and page_size must be >= 1")
        if (
            isinstance(steps_per_dispatch, bool)
            or int(steps_per_dispatch) != steps_per_dispatch
            or steps_per_dispatch < 1
        ):
            raise EejaxError(f"steps_per_dispatch must be an integer >= 1, got {steps_per_dispatch!r}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise EejaxError(
                f"prefill_chunk must be >= 1 prompt tokens per step (or None: whole prompts), got {prefill_chunk}"
            )
        self.model, self.config = model, config
        self.exit_config = checked_exit(model, exit)
        if pages not in ("reserve", "grow"):
            raise EejaxError(f"pages must be 'reserve' or 'grow', got {pages!r}")
        self.slots, self.max_new_tokens, self.page_size = max_slots, max_new_tokens, page_size
        # reserve: a row gets the pages of prompt + max tokens at admission (never runs out);
        # grow: the pages of its prompt, then one more as it needs it, preempting the
        # lowest-priority row (recomputed later) when none is free.
        self.grow = pages == "grow"
        # Chunked prefill: at most this many prompt tokens are prefilled per step (oldest
        # admission first), between the decode steps of the running rows; None: whole prompts.
        self.prefill_chunk = prefill_chunk
        # Decode steps per program (`Dispatch.plan` falls back to 1); 1: always one.
        self.steps_per_dispatch = int(steps_per_dispatch)
        num_pages = model.pages_for_budget(cache_budget, page_size)
        # The longest request admission can always start: it keeps 10% of the free pages back
        # (none in a batch job), so a request needing more pages than that share of an empty
        # cache would wait forever. (A preempted row comes back needing up to all of its pages.)
        margin = 0.0 if batch_job else 0.1
        self.cache_len = max(safe_pages(num_pages - 1, margin), 0) * page_size
        self.max_len = min(config.max_position_embeddings, self.cache_len)
        if self.max_len < 2:
            raise EejaxError(f"KV cache budget {cache_budget} holds no sequence")
        self.table_width = bucket(pages_needed(self.max_len, page_size))
        # The slots' pages and block table. With prefix caching, full pages of prompt tokens are
        # kept under a key of their prefix and shared by later prompts that start alike: a
        # prefill then starts after them.
        pages = SlotPages(num_pages, max_slots, page_size, self.table_width, prefix_caching)
        # Which row holds each slot: prefilling its prompt, or running (decoding).
        self.slot_table = SlotTable(max_slots, pages)
        # The requests waiting for a slot, and the scheduler that admits them: a part that owns them.
        scheduler = BucketScheduler(
            self.max_len + 1,
            page_size,
            policy=policy,
            bucketing=bucketing,
            online=online,
            max_rows=max_slots,
            margin=margin,
        )
        # Cache positions a row's prompt takes: the prompt's; an encoder-decoder's start token.
        self.prompt_positions = (lambda prompt: 1) if self.encoder_decoder else len
        self.waiting = WaitingQueue(scheduler, self.grow, self.prompt_positions)
        self.sampling = (sampling or SamplingParams()).override(**sampling_options)  # a request's default
        self.sampling.check_vocab(config.vocab_size)
        # The options of the engine's programs; a group of rows replaces the per-request ones.
        self.options = StepOptions(max_new_tokens, () if ignore_eos else model.eos_token_ids, attention=attention)
        # The cache, the slots' decode state, token counts, speculation counters and prompts on
        # the device, and the uploads of block tables and group masks: a part that owns them.
        context_width = bucket(max_prompt_tokens, MIN_PROMPT_BUCKET) if self.encoder_decoder else None
        self.device = DeviceSlots(model, max_slots, max_new_tokens, num_pages, page_size, self.max_len, context_width)
        # Across processes (jax.distributed): process 0's changes since the last step, which its
        # replicas apply before stepping with it (`engine/replicas.py`); inactive in one process.
        self.replication = replicas.ChangeLog(jax.process_count() > 1 and not batch_job)
        self.prometheus = ServeMetrics(config.num_layers)
        self.step_s = 0.0  # seconds in `step`, summed
        # Tokens to their requests; rows that ended released and finished: a part.
        self.delivery = Delivery(
            model.tokenizer,
            self.options.eos_ids,
            self.slot_table,
            self.device,
            self.waiting,
            self.prometheus,
        )
        # A program that raises fails its requests only; lost device arrays are rebuilt (and the
        # program in flight is forgotten): a part.
        self.faults = Faults(
            self.waiting, self.slot_table, self.device, self.delivery, lambda: self.dispatch.drop_in_flight()
        )
        # The speculating rows' policies and rounds, and the dispatch of every program with the
        # one-behind read of its outputs: parts.
        self.speculation = Speculation(model, self.device, batch_job, self.steps_per_dispatch, max_slots)
        self.dispatch = Dispatch(
            model,
            self.options,
            self.slot_table,
            self.device,
            self.speculation,
            self.delivery,
            self.faults,
            steps_per_dispatch=self.steps_per_dispatch,
            batch_job=batch_job,
            prompt_positions=self.prompt_positions,
        )
        # Free slots to waiting rows, their prefills, pages for growing rows, preemption: a part.
        self.admission = Admission(
            model,
            self.options,
            self.waiting,
            self.slot_table,
            self.device,
            self.dispatch,
            self.delivery,
            self.faults,
            self.prometheus,
            max_len=self.max_len,
            max_prompt_tokens=self.max_prompt_tokens,
            prefill_chunk=prefill_chunk,
            grow=self.grow,
            batch_job=batch_job,
            prompt_positions=self.prompt_positions,
        )
        # The background loop (what the HTTP server runs) and the inbox of what other threads ask
        # (submit, cancel, abort; deadlines): a part, handed the loop's functions.
        loop = Loop(  # looked up at each call: a test may replace a method of this engine
            lambda: self.step(),
            lambda: self.busy,
            lambda error: self.recover(error),
            self.take_messages,
            self.live,
            self.delivery.finish,
        )
        self.lifecycle = Lifecycle(loop, self.replication)
        # The front door: what `submit` checks, the seeds, ids and decoding options served: a part.
        self.requests = Requests(
            model,
            self.lifecycle.post,
            sampling=self.sampling,
            exit_config=self.exit_config,
            max_new_tokens=max_new_tokens,
            max_len=self.max_len,
            cache_len=self.cache_len,
            max_prompt_tokens=self.max_prompt_tokens,
            num_pages=num_pages,
            page_size=page_size,
            max_decoding_options=max_decoding_options,
            seed=seed,
            prompt_positions=self.prompt_positions,
            speculate_auto=auto_speculates(max_slots),
            auto_on_cpu=on_cpu(),
            spec=spec,
        )

    @functools.wraps(Requests.submit)
    def submit(self, prompt, **options) -> Sequence:
        return self.requests.submit(prompt, **options)

    def fresh_seed(self) -> int:
        """A seed for a request that names none (drawn from the engine's own seed)."""
        return self.requests.fresh_seed()

    @property
    def cache(self):
        """The paged KV cache (read-only: `DeviceSlots`)."""
        return self.device.cache

    @property
    def state(self):
        """The slots' decode state on the device (read-only: `DeviceSlots`)."""
        return self.device.state

    @property
    def scheduler(self) -> BucketScheduler:
        """The scheduler that picks the waiting requests admitted (`WaitingQueue.scheduler`)."""
        return self.waiting.scheduler

    @property
    def pages(self) -> SlotPages:
        """The slots' pages and block table (`SlotTable.pages`)."""
        return self.slot_table.pages

    @property
    def running(self):
        """slot -> the row decoding in it (read-only: `SlotTable`)."""
        return self.slot_table.running

    @property
    def prefilling(self):
        """slot -> the admitted row whose prompt is not all in the cache yet (read-only)."""
        return self.slot_table.prefilling

    @property
    def busy(self) -> bool:
        return bool(self.running or self.prefilling or self.waiting or self.dispatch.in_flight or self.lifecycle.inbox)

    def live(self) -> list[Sequence]:
        """The requests submitted and not yet finished (any thread may ask: `Requests.live`)."""
        return self.requests.live()

    # -- the loop ------------------------------------------------------------------------------
    def take_messages(self) -> None:
        """Applies what other threads posted (`Lifecycle.post`: submit, cancel, abort, deadlines),
        in the thread that steps the engine."""
        inbox.apply(self.lifecycle.inbox.take(), self.waiting, self.slot_table, self.delivery, self.replication)

    def step(self) -> None:
        """One iteration: what other threads posted (across processes, process 0's loop applies
        them before it tells its replicas: `Lifecycle`), then admit into free slots, prefill,
        dispatch the running rows' programs and read the previous ones (`Dispatch`). A program
        that fails fails only the requests it ran for (`Faults.guarded`)."""
        if self.lifecycle.inbox and not self.replication.active:
            self.take_messages()
        start, compiled = time.perf_counter(), self.model.programs.compile_seconds
        with self.model.programs.in_use():  # background compilations wait meanwhile
            last_end = self.dispatch.step_started()  # a step that raises times nothing after it
            self.admission.admit()
            prefills = bool(self.prefilling)
            self.admission.prefill_some()
            self.dispatch.choose_steps(waiting=bool(self.waiting))
            if self.grow:
                self.admission.grow_pages()
            self.dispatch.dispatch_and_read(self.dispatch.plan())
            end = time.perf_counter()
            timed = not prefills and self.model.programs.compile_seconds == compiled and last_end is not None
            self.dispatch.step_ended(end, end - last_end if timed else None)
        self.step_s += end - start

    def run(self) -> None:
        """Steps, in this thread, until every submitted request has finished."""
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

    def recover(self, error: BaseException) -> None:
        """After a step raised outside any one program (`Faults.recover`; the stepping thread)."""
        self.faults.recover(error)

    # -- the background loop (`Lifecycle`) -----------------------------------------------------
    def start(self) -> None:
        """Runs the loop in a background thread (what the HTTP server uses) until `stop()`."""
        self.lifecycle.start()

    def stop(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Stops the background loop after finishing (or, with `cancel`, cancelling) all requests.
        Waits at most `timeout` seconds for the loop (None: until it ends); False if it did not end."""
        return self.lifecycle.stop(cancel, timeout)

    @property
    def alive(self) -> bool:
        """Whether the background loop is running (started, not stopped, not died)."""
        return self.lifecycle.alive

    @property
    def error(self) -> BaseException | None:
        """What stopped the background loop, if it died."""
        return self.lifecycle.error

    def cancel(self, seq: Sequence) -> None:
        """Ends a request now (a client that went away): its slot and pages are freed."""
        self.lifecycle.cancel(seq)

    def abort(self, reason: str = "abort", wait: float = 1.0) -> int:
        """Ends every request now with finish reason `reason` (a server shutting down at its
        deadline); returns how many. A loop stuck for `wait` seconds ends them for their callers
        (`Lifecycle.abort`)."""
        return self.lifecycle.abort(reason, wait)

    def warmup(self, max_prompt_len: int | None = None, progress: bool = True, requests=()) -> int:
        """Compiles, before the first requests, every program requests of the engine's own options
        and of each of `requests` (dicts of `submit`'s options) can reach, for prompts of up to
        `max_prompt_len` tokens (default: the context); runs none. Returns how many programs
        were new (`engine/warmup.py` says which)."""
        return warmup(self, max_prompt_len, progress, requests)

    # -- reports -------------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int | float]:
        """What the parts did, summed, each part's own count (`AdmissionCounts`, `Dispatch.steps`,
        `Delivery.generated_tokens`) and the steps' seconds."""
        return {
            "steps": self.dispatch.steps,
            "generated_tokens": self.delivery.generated_tokens,
            **vars(self.admission.counts),
            "step_s": self.step_s,
        }

    def metrics(self) -> dict[str, Any]:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "prefilling": len(self.prefilling),
            "slots": self.slots,
            **self.pages.metrics(),
            "compiled_programs": self.model.programs.num_programs,
            "buckets": len(self.scheduler.buckets),
            **self.counters,
        }
