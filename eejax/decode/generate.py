"""`generate`: batched generation (full depth, early exit or self-speculation) over one
preallocated paged KV cache: a thin offline loop over the serving engine's steps.

The prompts are submitted to an `Engine` sized for the call (slots for `batch_size` rows, the
pages they need); rows enter free slots as others finish (continuous batching), each decode
program runs several steps while nothing waits, and the host reads one program behind.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from eejax.cache import page_bytes, pages_for_budget, pages_needed
from eejax.decode import cost
from eejax.decode.buckets import batch_bucket, bucket
from eejax.decode.prompts import prompt_token_ids, validate_lengths
from eejax.decode.sampling import SamplingParams
from eejax.errors import EejaxError
from eejax.kernels.attention import IMPLS
from eejax.models import exits
from eejax.models.registry import model_module
from eejax.options import ExitConfig, SpecConfig


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
    stats: dict[str, Any]


SPEC_COUNTERS = ("drafted", "accepted", "rounds", "rejections", "layer_passes", "draft_heads", "plain_steps")


def generate(
    model,
    batch,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = False,
    batch_size: int | None = None,
    page_size: int = 16,
    cache_budget: int | str = "1GiB",
    truncate_prompt_tokens: int | None = None,
    exit: ExitConfig | str | None = None,  # noqa: A002 (the documented name of the option)
    spec: SpecConfig | str | None = None,
    attention: str = "auto",
) -> GenerateResult:
    """Generates up to `max_new_tokens` for each prompt of `batch` (see `prompt_token_ids`).

    A row stops at an EOS token unless `ignore_eos`. At most `batch_size` rows decode at once
    (all by default), as far as the KV cache budget allows; a row that ends frees its slot for
    the next; results keep the input order.
    `exit` (an `ExitConfig` or its CLI spelling such as "softmax:0.9") turns on early exit in
    the decode steps; None is plain full depth. `spec` (a `SpecConfig` or "E:d") decodes by
    self-speculation instead: drafts from the first E layers verified by the rest; greedy output
    equals full depth token for token, sampled output has the full model's distribution (in
    `exit_layers`, accepted drafts show E, tokens of the full model L). `attention` is "auto"
    (Triton on CUDA, the jnp reference elsewhere), "reference" or "triton" (interpreted without
    a GPU: slow). Sampling is seeded per row and position: row i draws with
    `fold_in(seed_key(seed), i)` folded with each token's index, whatever batch it runs in.
    """
    from eejax.serve.engine import Engine

    config = model.config
    if attention not in IMPLS:
        raise EejaxError(f"unknown attention {attention!r}; choose one of: " + ", ".join(IMPLS))
    exit_config = ExitConfig.parse(exit) if isinstance(exit, str) else exit
    spec_config = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    if exit_config is not None and spec_config is not None:
        raise EejaxError("choose early exit (exit=) or self-speculation (spec=), not both")
    exit_config, spec_config = exits.resolve_options(model.params, config, exit_config, spec_config)
    rows, texts = prompt_token_ids(model.tokenizer, batch)
    if truncate_prompt_tokens is not None:
        if truncate_prompt_tokens < 1:
            raise EejaxError(f"truncate_prompt_tokens must be >= 1, got {truncate_prompt_tokens}")
        rows = [r[:truncate_prompt_tokens] for r in rows]
    validate_lengths(rows, max_new_tokens, config.max_position_embeddings, config.vocab_size)
    if batch_size is not None and batch_size < 1:
        raise EejaxError(f"batch_size must be >= 1, got {batch_size}")
    if page_size < 1:
        raise EejaxError(f"page_size must be >= 1, got {page_size}")
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p))
    sampling.check_vocab(config.vocab_size)

    # The cache holds a Llama's prompt and new tokens, a T5 decoder's start and new tokens (its
    # prompt is the encoder's). A speculation round may draft past max_new_tokens; those
    # positions go to the null page.
    per_page = page_bytes(config.num_layers, page_size, config.num_kv_heads, config.head_dim, model.dtype)
    budget_pages = pages_for_budget(cache_budget, per_page)
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
    engine = Engine(model, max_slots=slots, max_new_tokens=max_new_tokens, cache_budget=num_pages * per_page,
                    page_size=page_size, exit=exit_config, temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, bucketing=False, attention=attention, prefix_caching=False,
                    max_prompt_tokens=max(map(len, rows)), ignore_eos=ignore_eos, batch_job=True)
    compile_before = model.programs.compile_seconds
    start = time.perf_counter()
    seqs = [engine.submit(r, max_new_tokens=max_new_tokens, spec=spec_config, seed=seed, choice=i)
            for i, r in enumerate(rows)]
    engine.run()
    failed = [seq for seq in seqs if seq.finish_reason == "error"]
    if failed:
        raise EejaxError(f"generation failed for prompt {seqs.index(failed[0])}: {failed[0].error}")
    compile_s = model.programs.compile_seconds - compile_before
    run_s = time.perf_counter() - start - compile_s
    out_tokens = [seq.tokens for seq in seqs]
    decoded = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer else None for t in out_tokens]
    stats = _stats(model, engine, seqs, exit_config, spec_config, run_s, compile_s)
    return GenerateResult(texts, rows, out_tokens, decoded, [seq.exit_layers for seq in seqs],
                          [seq.confident_layers for seq in seqs], stats)


def _stats(model, engine, seqs, exit_config, spec_config, run_s: float, compile_s: float) -> dict[str, Any]:
    """`GenerateResult.stats`: speeds, layers and weights per token, and speculation's counts."""
    config = model.config
    out_layers = [seq.exit_layers for seq in seqs]
    generated = sum(len(seq.tokens) for seq in seqs)
    decoded_tokens = generated - sum(1 for seq in seqs if seq.tokens)  # the first token comes from prefill
    prefill_s = engine.counters["prefill_s"]
    decode_s = run_s - prefill_s
    spec_totals = {name: sum(seq.spec_counters.get(name, 0) for seq in seqs) for name in SPEC_COUNTERS}
    layers_run = sum(sum(x) for x in out_layers)
    if spec_config is not None:  # draft and verify passes and plain steps, plus the prefill's first tokens
        plain_and_first = spec_totals["plain_steps"] + sum(1 for seq in seqs if seq.tokens)
        layers_run = spec_totals["layer_passes"] + config.num_layers * plain_and_first
    weights_per_token = _weights_per_token(model, exit_config, spec_config, out_layers, spec_totals, decoded_tokens)
    confident_sum = sum(sum(seq.confident_layers) for seq in seqs)
    stats = {
        "tokens_per_s": generated / run_s if run_s > 0 else float("nan"),
        "generated_tokens": generated,
        "decode_tokens_per_s": decoded_tokens / decode_s if decode_s > 0 and decoded_tokens else float("nan"),
        "mean_layers_per_token": layers_run / generated if generated else 0.0,
        "kv_fill_layers_per_token": (
            config.num_layers - layers_run / generated if generated and spec_config is None else 0.0
        ),
        "mean_confident_layer": confident_sum / generated if generated else 0.0,
        "weights_per_token": weights_per_token,
        "ideal_speedup": cost.ideal_speedup(cost.WeightCounts.of(model.params, config), weights_per_token),
        "num_layers": config.num_layers,
        "exit": "full" if exit_config is None else exit_config.spec,
        "spec": None if spec_config is None else spec_config.spec,
        "run_s": run_s,
        "prefill_s": prefill_s,
        "compile_s": compile_s,
        "compiled_programs": model.programs.num_programs,
        "kv_cache_pages": engine.allocator.num_pages,
        "page_size": engine.page_size,
        "engine_steps": engine.counters["steps"],
    }
    if spec_config is not None:
        t, policies = spec_totals, list(engine.policies.values())
        speculations = [d for p in policies for d in p.chosen if d]  # rounds only; plain steps are counted apart
        bonuses = [b for p in policies for b in p.bonuses]
        stats.update(
            acceptance_rate=t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
            tokens_per_round=(decoded_tokens - t["plain_steps"]) / t["rounds"] if t["rounds"] else 0.0,
            plain_step_rate=t["plain_steps"] / decoded_tokens if decoded_tokens else 0.0,
            drafted_tokens=t["drafted"],
            accepted_tokens=t["accepted"],
            rounds=t["rounds"],
            mean_speculations=float(np.mean(speculations)) if speculations else 0.0,
            bonus_pass_rate=float(np.mean(bonuses)) if bonuses else 0.0,
        )
        timed = [p for p in policies if p.c_draft is not None]
        if timed:  # adaptive: measured seconds per draft pass, and of a verify pass at the first d
            stats["draft_pass_s"] = float(np.mean([p.c_draft for p in timed]))
            stats["verify_pass_s"] = float(np.mean([p.c_verify(spec_config.num_speculations) for p in timed]))
    return stats


def _weights_per_token(model, exit_config, spec_config, exit_layers, spec_totals, decoded_tokens: int) -> float:
    """Weights the decode tokens read per token, by the cost model (`eejax.decode.cost`); the
    first token of each row comes from the prefill in every configuration and is left out."""
    w = cost.WeightCounts.of(model.params, model.config)
    if not decoded_tokens:
        return float("nan")
    if spec_config is not None:
        t, e = spec_totals, spec_config.exit_layer
        passes = (t["layer_passes"] - t["rounds"] * (w.num_layers - e)) / e
        reduced = spec_config.uses_reduced_head(exits.has_reduced_head(model.params.get("exits")))
        rounds = cost.spec_weights(w, e, passes, t["draft_heads"], t["rounds"], reduced)
        return (rounds + t["plain_steps"] * w.full_depth) / decoded_tokens
    if exit_config is None:
        return w.full_depth
    checks = exit_config.check_layers(w.num_layers)
    reduced = exit_config.uses_reduced_head(exits.has_reduced_head(model.params.get("exits")))
    per_layer = {}
    total = 0.0
    for row in exit_layers:
        for e in row[1:]:
            if e not in per_layer:
                per_layer[e] = cost.exit_step_weights(w, exit_config, e, checks, *reduced)
            total += per_layer[e]
    return total / decoded_tokens
