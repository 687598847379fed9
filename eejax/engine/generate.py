"""`generate`: batched generation (full depth, early exit or self-speculation) over one
preallocated paged KV cache: a thin offline loop over the serving engine's steps.

The prompts are submitted to an `Engine` sized for the call (slots for `batch_size` rows, the
pages they need); rows enter free slots as others finish (continuous batching), a decode
program runs several steps, and the host reads one program behind (`engine/engine.py`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from eejax.cache import pages_needed
from eejax.decode.buckets import batch_bucket, bucket
from eejax.decode.prompts import prompt_token_ids, validate_lengths
from eejax.decode.sampling import SamplingParams
from eejax.decode.spec_policy import auto_speculates, on_cpu
from eejax.decode.stats import GenerateStats, generate_stats
from eejax.engine.engine import Engine
from eejax.errors import EejaxError
from eejax.kernels.attention import IMPLS
from eejax.models import draft_head, exits
from eejax.models.registry import model_module
from eejax.options import DEFAULT_SPEC, ExitConfig, SpecConfig, check_exit_or_spec, default_spec, resolve_spec


@dataclasses.dataclass
class GenerateResult:
    """Per prompt: `tokens` (generated ids only, EOS included), `texts`, `exit_layers` (layers
    run for each generated token: the batch's exit layer), `confident_layers` (the row's own
    first confident layer, the exit layer if it never was); `stats` for the whole call.

    The first token comes from the full-depth prefill, so its exit layer is the full depth."""

    prompts: list[str | None]
    prompt_tokens: list[list[int]]
    tokens: list[list[int]]
    texts: list[str | None]
    exit_layers: list[list[int]]
    confident_layers: list[list[int]]
    stats: GenerateStats


def generate(
    model,
    batch,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    row_offset: int = 0,
    ignore_eos: bool = False,
    batch_size: int | None = None,
    page_size: int = 16,
    cache_budget: int | str = "1GiB",
    truncate_prompt_tokens: int | None = None,
    exit: ExitConfig | str | None = None,  # noqa: A002 (the documented name of the option)
    spec: SpecConfig | str | None = DEFAULT_SPEC,
    attention: str = "auto",
    **sampling_options,
) -> GenerateResult:
    """Generates up to `max_new_tokens` for each prompt of `batch` (see `prompt_token_ids`).

    A row stops at an EOS token unless `ignore_eos`. At most `batch_size` rows decode at once
    (all by default), as far as the KV cache budget allows; a row that ends frees its slot for
    the next; results keep the input order.
    `exit` (an `ExitConfig` or its CLI spelling such as "softmax:0.9") turns on early exit in
    the decode steps; None is plain full depth. `spec` (a `SpecConfig` or "E:d") decodes by
    self-speculation instead: drafts from the first E layers verified by the rest; greedy output
    equals full depth token for token, sampled output has the full model's distribution (in
    `exit_layers`, accepted drafts show E, tokens of the full model L); "draft:d" drafts with the
    model's draft head, "auto" with it where it pays (`options.resolve_spec`; full depth on a
    CPU batch and without a head), "none" or None is full depth. Not given, `spec` is "auto"
    unless an `exit` is given (`options.default_spec`): a model with a draft head drafts with it
    where it pays, any other decodes at full depth. `attention` is "auto"
    (eejax's CPU kernel on a CPU, XLA's reference elsewhere), "reference", "cpu" or "triton"
    (interpreted without a GPU: slow). Sampling is seeded per row and position: row i draws with
    `fold_in(seed_key(seed), row_offset + i)` folded with each token's index, whatever batch it
    runs in (so prompts cut into several calls, each given the number of rows before it as
    `row_offset`, sample as one call over them all would).
    `sampling` (a `SamplingParams`; default greedy), or its options by name over it:
    `temperature`, `top_k`, `top_p`, and `presence_penalty` / `frequency_penalty` (OpenAI's, in
    [-2, 2], 0 = off) and `repetition_penalty` (vLLM's and HF's, > 0, 1 = off), which penalise
    tokens already seen before temperature, top-k and top-p (`decode/penalties.py`); lossless
    speculation stays exact.
    """

    config = model.config
    if attention not in IMPLS:
        raise EejaxError(f"unknown attention {attention!r}; choose one of: " + ", ".join(IMPLS))
    exit_config = ExitConfig.parse(exit) if isinstance(exit, str) else exit
    spec = default_spec(exit_config, spec)
    check_exit_or_spec(exit_config, spec, ("early exit (exit=)", "self-speculation (spec=)"))
    rows, texts = prompt_token_ids(model.tokenizer, batch)
    at_once = len(rows) if batch_size is None else min(max(batch_size, 1), len(rows))
    spec_config = resolve_spec(
        spec, draft_head.has_draft(model.params), auto_speculates(at_once), on_cpu(), model.drafts_in_blocks
    )
    exit_config, spec_config = exits.resolve_options(model.params, config, exit_config, spec_config)
    if truncate_prompt_tokens is not None:
        if truncate_prompt_tokens < 1:
            raise EejaxError(f"truncate_prompt_tokens must be >= 1, got {truncate_prompt_tokens}")
        rows = [r[:truncate_prompt_tokens] for r in rows]
    validate_lengths(rows, max_new_tokens, config.max_position_embeddings, config.vocab_size)
    if batch_size is not None and batch_size < 1:
        raise EejaxError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(row_offset, bool) or int(row_offset) != row_offset or row_offset < 0:
        raise EejaxError(f"row_offset must be an integer >= 0, got {row_offset!r}")
    if page_size < 1:
        raise EejaxError(f"page_size must be >= 1, got {page_size}")
    # Checked here, before any work (the engine checks them again as its defaults).
    sampling = (sampling or SamplingParams()).override(**sampling_options)
    sampling.check_vocab(config.vocab_size)

    # The cache holds a Llama's prompt and new tokens, a T5 decoder's start and new tokens (its
    # prompt is the encoder's). A speculation round may draft past max_new_tokens; those
    # positions go to the null page.
    budget_pages = model.pages_for_budget(cache_budget, page_size)
    encoder_decoder = model_module(config).ENCODER_DECODER
    in_cache = [(1 if encoder_decoder else len(r)) + max_new_tokens for r in rows]
    need = [pages_needed(n, page_size) for n in in_cache]
    if budget_pages < 1 + max(need):
        longest = int(np.argmax(need))
        what = "decoder start" if encoder_decoder else f"{len(rows[longest])} prompt"
        raise EejaxError(
            f"KV cache budget {cache_budget} holds {max(budget_pages - 1, 0) * page_size} tokens; "
            f"prompt {longest} needs {in_cache[longest]} ({what} + {max_new_tokens} new)"
        )
    # Decode slots: all rows, padded to a batch bucket (few programs across calls), or exactly
    # `batch_size` when it is given and smaller.
    slots = batch_bucket(len(rows)) if batch_size is None or batch_size >= len(rows) else batch_size
    num_pages = min(budget_pages, 1 + bucket(slots * bucket(max(need))))
    engine = Engine(
        model,
        max_slots=slots,
        max_new_tokens=max_new_tokens,
        cache_budget=num_pages * model.page_bytes(page_size),
        page_size=page_size,
        exit=exit_config,
        spec=None,  # each request names its own
        sampling=sampling,
        bucketing=False,
        attention=attention,
        prefix_caching=False,
        max_prompt_tokens=max(map(len, rows)),
        ignore_eos=ignore_eos,
        batch_job=True,
    )
    compile_before = model.programs.compile_seconds
    start = time.perf_counter()
    seqs = [
        engine.submit(r, max_new_tokens=max_new_tokens, spec=spec_config, seed=seed, choice=row_offset + i)
        for i, r in enumerate(rows)
    ]
    while engine.busy:  # nano-vllm's loop: admit, dispatch, read back
        engine.step()
    failed = [seq for seq in seqs if seq.finish_reason == "error"]
    if failed:
        raise EejaxError(f"generation failed for prompt {seqs.index(failed[0])}: {failed[0].error}")
    compile_s = model.programs.compile_seconds - compile_before
    run_s = time.perf_counter() - start - compile_s
    out_tokens = [seq.tokens for seq in seqs]
    decoded = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer else None for t in out_tokens]
    stats = generate_stats(model, engine, seqs, exit_config, spec_config, run_s, compile_s)
    return GenerateResult(
        texts,
        rows,
        out_tokens,
        decoded,
        [seq.exit_layers for seq in seqs],
        [seq.confident_layers for seq in seqs],
        stats,
    )
