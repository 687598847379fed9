"""Warm-up: the programs a set of request kinds can reach, compiled before the first request
(`Engine.warmup`, `eejax serve --warmup TOKENS --warmup-for OPTIONS`). A plain function over the
engine's parts: it asks admission, dispatch and speculation for their programs, runs none."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from eejax.decode.buckets import MIN_PROMPT_BUCKET, bucket
from eejax.decode.programs import MAPS_PER_PROGRAM, map_headroom
from eejax.decode.sampling import RowSampling
from eejax.decode.slot_args import PrefillChunk

log = logging.getLogger("eejax.serve")


def warmup(engine, max_prompt_len: int | None = None, progress: bool = True, requests=()) -> int:
    """Compiles ahead of the first requests the programs they will need, for the engine's own
    options and for each of `requests` (dicts of `submit`'s options: exit, spec, temperature,
    top_k, top_p, logprobs, prompt_logprobs and the penalties; checked as `submit` checks them,
    and counted among the decoding options served): prefill for every batch bucket up to the
    slots x every prompt bucket up to `max_prompt_len` (default: the context), in its own
    table and, where a prefill may start after cached tokens (prefix caching, chunks), in the
    `Admission.resume_width` one (prefill programs do not depend on sampling: `Admission.prefill_options`);
    decode for every page-table width up to that prompt + max new tokens, of one step and of
    `steps_per_dispatch`, or every speculation round (`Speculation.compile`). Nothing runs. Returns
    how many programs were new. Mind the count: each compiled program maps memory, and an
    XLA:CPU process here failed ("LLVM compilation error: Cannot allocate memory") at ~340
    SmolLM2 programs (vm.max_map_count 65530)."""
    from tqdm.auto import tqdm

    admission = engine.admission

    seqs = [engine.submit([0], max_new_tokens=1, queue=False, **r) for r in ({}, *requests)]
    longest_prompt = engine.max_prompt_tokens or engine.max_len
    max_prompt_len = min(max_prompt_len or longest_prompt, longest_prompt)
    batches = sorted({bucket(n) for n in range(1, engine.slots + 1)})
    prompts = sorted({bucket(n, MIN_PROMPT_BUCKET) for n in range(1, max_prompt_len + 1)})
    longest = min(engine.prompt_positions(range(max_prompt_len)) + engine.max_new_tokens - 1, engine.max_len)
    widths = sorted({engine.pages.width(n) for n in range(1, longest + 1)})
    group = jnp.zeros((engine.slots,), bool)
    before = engine.model.programs.num_programs

    def prefill(b, t, width, options):
        zeros = np.zeros((b,), np.int32)
        table = np.zeros((b, width), np.int32)
        sampling = RowSampling.of(engine.sampling, b)
        keys = np.zeros((b, 2), np.uint32)
        admission.prefill_program(
            PrefillChunk(np.zeros((b, t), np.int32), zeros, table, zeros, keys, zeros, zeros, sampling, zeros), options
        )

    def decode(width, options):
        table = jnp.zeros((engine.slots, width), jnp.int32)
        if options.spec is None:
            engine.dispatch.decode_program(table, group, options, now=True)
        else:
            engine.speculation.compile(table, group, options)

    work = []
    prefill_options = {admission.prefill_options(s): None for s in seqs}
    for options in prefill_options:
        # A prefill after cached tokens (a shared prefix, unless the prompt is scored; an
        # earlier chunk) writes into the wider `Admission.resume_width` table.
        resumes = (engine.pages.prefix_caching and not options.prompt_logprobs) or engine.prefill_chunk is not None
        for b in batches:
            for t in prompts:
                first = admission.prefill_width(t)
                for width in sorted({first, max(first, admission.resume_width)} if resumes else {first}):
                    work.append(functools.partial(prefill, b, t, width, options))
    decode_options = {}
    for s in seqs:
        options = engine.dispatch.options_of(s)
        steps = {1, engine.steps_per_dispatch} if options.spec is None else {1}
        decode_options.update({dataclasses.replace(options, num_steps=k): None for k in steps})
    prefills = len(work)
    work += [functools.partial(decode, w, options) for options in decode_options for w in widths]
    headroom = map_headroom() if jax.default_backend() == "cpu" else None
    # Prefills read the stacked weights in either layout; decode programs use the model's.
    maps = prefills * MAPS_PER_PROGRAM["stacked"] + (len(work) - prefills) * MAPS_PER_PROGRAM[engine.model.layout]
    if headroom is not None and maps > headroom:
        log.warning(
            "warm-up compiles %d programs, ~%d memory maps in all (XLA:CPU): more than the %d this "
            "process has left under vm.max_map_count, and compiling then fails ('Cannot allocate memory'): "
            "raise it (sysctl -w vm.max_map_count=262144), warm fewer kinds of request, or use the "
            "stacked layer layout (a quarter of the maps)",
            len(work),
            maps,
            headroom,
        )
    for compile_one in tqdm(work, desc="compiling", disable=not progress):
        compile_one()
    return engine.model.programs.num_programs - before
