"""Requests, a part of the `Engine`: its front door. What `submit` checks before a request may
queue (options, limits, token ids, stops, seeds) and how many early-exit / speculation options
the engine serves. It owns the request ids, the seeds drawn for requests that name none, the
decoding options served and the requests it let in that have not finished (`live`); a request
that passed its checks is posted to the engine's loop (`Lifecycle.post` of an `inbox.Submit`),
which queues it."""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable

import jax
import numpy as np

from eejax.decode.prompts import prompt_token_ids
from eejax.decode.sampling import SamplingParams, seed_key
from eejax.decode.state import TOP_LOGPROBS
from eejax.engine.inbox import Message, Submit
from eejax.engine.sequence import Request, Sequence
from eejax.errors import EejaxError
from eejax.models import draft_head, exits
from eejax.options import DEFAULT_SPEC, ExitConfig, SpecConfig, check_exit_or_spec, default_spec, resolve_spec


def checked_exit(model, exit) -> ExitConfig | None:  # noqa: A002
    """An early-exit option (ExitConfig or its CLI spelling) checked against `model`."""
    config = ExitConfig.parse(exit) if isinstance(exit, str) else exit
    if config is not None:
        config, _ = exits.resolve_options(model.params, model.config, exit=config)
    return config


class Requests:
    """`sampling`, `exit_config` and `spec`: a request's defaults (a request that names an exit
    or a spec of its own, "none" included, takes neither default; `spec` not given is "auto" unless
    `exit_config` is set: `options.default_spec`); `max_new_tokens`, `max_len`,
    `max_prompt_tokens` (an encoder-decoder's; None: decoder-only): its limits (`cache_len`,
    `num_pages` and `page_size` say which bound `max_len` is); at most `max_decoding_options`
    early-exit / speculation options are served; `seed` draws the seeds of requests that name
    none; `speculate_auto`: whether `spec="auto"` speculates here (`spec_policy.auto_speculates`
    of the engine's slots) and `auto_on_cpu` whether it runs a CPU's auto
    (`spec_policy.on_cpu`); `post`: hands a message to the engine's loop (`Lifecycle.post`).
    Any thread may submit."""

    def __init__(
        self,
        model,
        post: Callable[[Message], None],
        *,
        sampling: SamplingParams,
        exit_config: ExitConfig | None,
        max_new_tokens: int,
        max_len: int,
        cache_len: int,
        max_prompt_tokens: int | None,
        num_pages: int,
        page_size: int,
        max_decoding_options: int,
        seed: int,
        prompt_positions: Callable[[list[int]], int],
        speculate_auto: bool = True,
        auto_on_cpu: bool = False,
        spec: SpecConfig | str | None = DEFAULT_SPEC,
    ):
        self.model, self.config = model, model.config
        self._post = post
        self._lock = threading.Lock()  # submissions come from any thread
        self._live: weakref.WeakSet = weakref.WeakSet()  # submitted (or replicated), maybe finished
        self.sampling, self.exit_config = sampling, exit_config
        self.max_new_tokens, self.max_len, self.cache_len = max_new_tokens, max_len, cache_len
        self.max_prompt_tokens, self.encoder_decoder = max_prompt_tokens, max_prompt_tokens is not None
        self.num_pages, self.page_size = num_pages, page_size
        self.prompt_positions, self.speculate_auto = prompt_positions, speculate_auto
        self.auto_on_cpu = auto_on_cpu
        self._seeds = np.random.default_rng(seed)  # a request without a seed draws one from here
        self._ids = itertools.count()
        # Early-exit and speculation options are static in the programs (each compiles its own):
        # at most `max_decoding_options` distinct ones, so that no client keeps the server compiling.
        self.max_decoding_options = max_decoding_options
        spec = default_spec(exit_config, spec)
        check_exit_or_spec(exit_config, spec, ("a default exit", "a default spec"))
        self.spec = spec
        self.decoding_options: set = {(exit_config, self.checked_spec(spec))}

    def checked_exit(self, exit) -> ExitConfig | None:  # noqa: A002
        """An early-exit option (ExitConfig or its CLI spelling) checked against the model."""
        return checked_exit(self.model, exit)

    def checked_spec(self, spec: SpecConfig | str | None) -> SpecConfig | None:
        """The speculation `spec` runs here (None: none; "auto" resolved for this engine), checked
        against the model."""
        has_draft = draft_head.has_draft(self.model.params)
        cheap = self.model.drafts_in_blocks
        spec_config = resolve_spec(spec, has_draft, self.speculate_auto, self.auto_on_cpu, cheap)
        if spec_config is not None:
            if spec_config.adaptive and jax.process_count() > 1:
                raise EejaxError(
                    "adaptive speculation picks d from this process's timings; across processes use a "
                    "fixed E:d or draft:d"
                )
            exits.resolve_options(self.model.params, self.config, spec=spec_config)
        return spec_config

    def fresh_seed(self) -> int:
        """A seed for a request that names none (drawn from the engine's own seed)."""
        return int(self._seeds.integers(0, 2**31 - 1))

    def submit(
        self,
        prompt,
        *,
        max_new_tokens: int = 64,
        priority: int = 0,
        exit=None,  # noqa: A002
        sampling: SamplingParams | None = None,
        spec: SpecConfig | str | None = None,
        seed: int | None = None,
        choice: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        stop=(),
        stop_token_ids=(),
        timeout: float | None = None,
        queue: bool = True,
        **sampling_options,
    ) -> Sequence:
        """Queues a prompt (text or token ids); returns its Sequence at once. `exit` overrides the engine's
        early-exit option for this request ("none" = full depth), `spec` ("E:d", or "draft:d" with a draft
        head; "auto" where `speculate_auto`, "none") decodes it by speculation; a request that names
        neither takes the engine's default speculation (`spec`), if any; `sampling` (None: the
        engine's), and its options by name over it (temperature=, top_k=, top_p=, presence_penalty=,
        frequency_penalty=, repetition_penalty=: `SamplingParams`; None keeps the default), set its sampling
        and penalties (`decode/penalties.py`; traced values: a new setting compiles nothing, though rows with
        penalties run apart from those without). Sampled tokens depend only on the prompt,
        the options, `seed` and `choice`: they are row `choice` of `generate(seed=seed)`. `logprobs` (0 to
        20 alternatives) records each token's log-probability, `prompt_logprobs` (0 to 20) each prompt
        token's under the model (`seq.prompt_token_logprobs`); `stop` (strings) and `stop_token_ids` end the
        request like EOS does. `timeout` (seconds from now, waiting in the queue included; None: none): past
        it the request ends with what it has, finish reason "length" and `timed_out` set, its pages freed (a
        background loop's check, each step). `queue=False` checks the request and returns its Sequence
        without queueing it (`warmup` learns a request's programs so)."""
        if exit is None and spec is None:  # a request that names neither decodes as the defaults say
            spec = self.spec
        elif exit is None:  # one that names a spec, "none" included, takes no default exit either
            exit = "none"  # noqa: A001
        check_exit_or_spec(exit, spec)
        spec_config = self.checked_spec(spec)
        if spec_config is not None:
            exit = "none"  # noqa: A001
        sampling = (sampling or self.sampling).override(**sampling_options)
        sampling.check_vocab(self.config.vocab_size)
        if spec_config is not None:
            spec_config.check_sampling(sampling.sampler, sampling.penalized)
        exit_config = self.exit_config if exit is None else (None if exit == "none" else self.checked_exit(exit))
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise EejaxError(f"max_new_tokens must lie in [1, {self.max_new_tokens}], got {max_new_tokens}")
        (ids,), _ = prompt_token_ids(self.model.tokenizer, [prompt] if isinstance(prompt, str) else [list(prompt)])
        if self.encoder_decoder and len(ids) > self.max_prompt_tokens:
            raise EejaxError(
                f"prompt of {len(ids)} tokens exceeds this engine's max_prompt_tokens "
                f"({self.max_prompt_tokens}: the encoder output each slot holds)"
            )
        if self.prompt_positions(ids) + max_new_tokens > self.max_len:
            bound = (
                f"the model's context of {self.max_len} tokens"
                if self.max_len < self.cache_len
                else f"the {self.max_len} tokens a request may hold in this server's KV cache "
                f"({self.num_pages - 1} pages of {self.page_size} tokens, of which admission grants at "
                f"most 90%)"
            )
            prompt = "decoder start token" if self.encoder_decoder else f"prompt of {len(ids)} tokens"
            raise EejaxError(f"{prompt} + {max_new_tokens} new tokens exceeds {bound}")
        if max(ids) >= self.config.vocab_size or min(ids) < 0:
            raise EejaxError(f"token ids must lie in [0, {self.config.vocab_size})")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= TOP_LOGPROBS:
                raise EejaxError(f"{name} must lie in [0, {TOP_LOGPROBS}], got {value}")
        if prompt_logprobs is not None and self.encoder_decoder:
            raise EejaxError("prompt_logprobs need a decoder-only model (an encoder-decoder's prompt is the encoder's)")
        stop, stop_token_ids = tuple(stop), tuple(int(t) for t in stop_token_ids)
        if not all(isinstance(x, str) and x for x in stop):
            raise EejaxError("stop strings must be non-empty strings")
        if stop and self.model.tokenizer is None:
            raise EejaxError("stop strings need a model with a tokenizer (use stop_token_ids)")
        if any(not 0 <= t < self.config.vocab_size for t in stop_token_ids):
            raise EejaxError(f"stop_token_ids must lie in [0, {self.config.vocab_size})")
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise EejaxError(f"timeout must be a positive number of seconds, got {timeout}")
        if not 0 <= choice < 2**31:
            raise EejaxError(f"choice must lie in [0, 2^31), got {choice}")
        seed = self.fresh_seed() if seed is None else int(seed)
        if not -(2**63) <= seed < 2**64:
            raise EejaxError(f"seed must be a 64-bit integer, got {seed}")
        key = np.asarray(jax.random.fold_in(seed_key(seed), choice))
        with self._lock:
            self.count_decoding_options(exit_config, spec_config)
            submitted_at = time.perf_counter()
            request = Request(
                next(self._ids),
                ids,
                max_new_tokens,
                priority,
                exit_config,
                sampling,
                spec_config,
                key,
                logprobs,
                stop,
                stop_token_ids,
                prompt_logprobs,
                submitted_at,
                None if timeout is None or not queue else submitted_at + timeout,
            )
            seq = Sequence(request)
            if not queue:
                return seq
            self._live.add(seq)
        self._post(Submit(seq))
        return seq

    def replicated(self, request: Request) -> Sequence:
        """A request process 0 submitted (`replicas.submitted`), on a replica: its decoding options
        counted as process 0 counted them."""
        with self._lock:
            self.count_decoding_options(request.exit, request.spec)
            seq = Sequence(request)
            self._live.add(seq)
        return seq

    def live(self) -> list[Sequence]:
        """The requests let in that have not finished (any thread may ask)."""
        with self._lock:
            return [seq for seq in self._live if not seq.finished]

    def count_decoding_options(self, exit_config, spec_config) -> None:
        """Adds a request's early-exit / speculation option to those served, or refuses a new one
        past `max_decoding_options` (each compiles its own programs)."""
        options = (exit_config, spec_config)
        if options in self.decoding_options:
            return
        if len(self.decoding_options) >= self.max_decoding_options:
            served = sorted(
                "spec " + s.spec if s else "exit " + (e.spec if e else "none") for e, s in self.decoding_options
            )
            raise EejaxError(
                f"this server compiles programs for at most {self.max_decoding_options} early-exit / "
                f"speculation options and has them all; use one of: {', '.join(served)}"
            )
        self.decoding_options.add(options)
