"""`generate`: batched generation (full depth or early exit) over one preallocated paged KV cache.

Host side: tokenize, bucket shapes, hand out pages, then drive the jitted prefill and decode
steps; the token loop state stays on device, a program runs several decode steps
(`steps.decode_steps`) and the host checks `done` once per program.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eejax.cache import PageAllocator, page_bytes, pages_needed
from eejax.options import ExitConfig, SpecConfig, StepOptions
from eejax.decode import cost, speculative, steps
from eejax.decode.buckets import MIN_PROMPT_BUCKET, batch_bucket, bucket
from eejax.decode.prompts import prompt_token_ids, validate_lengths
from eejax.decode.sampling import GREEDY, RowSampling, SamplingParams, row_keys, seed_key
from eejax.decode.spec_policy import SpeculationPolicy
from eejax.errors import EejaxError, OutOfPagesError
from eejax.kernels.attention import IMPLS
from eejax.models import exits
from eejax.models.registry import model_module
from eejax.sharding import to_host

POLL_EVERY = 4  # decode steps per dispatch (and speculation rounds between host checks of "all rows done")


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


def parse_bytes(size: int | str) -> int:
    """`1073741824`, `"512MiB"`, `"2GB"`, `"1.5GiB"` -> bytes."""
    if isinstance(size, (int, np.integer)):
        return int(size)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise EejaxError(f"cannot read {size!r} as a size (examples: 512MiB, 2GB, 1073741824)")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    return int(float(m.group(1)) * base**power)


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

    A row stops at an EOS token unless `ignore_eos`. Rows run in batches of `batch_size` (all
    at once by default) as far as the KV cache budget allows; results keep the input order.
    `exit` (an `ExitConfig` or its CLI spelling such as "softmax:0.9") turns on early exit in
    the decode steps; None is plain full depth. `spec` (a `SpecConfig` or "E:d") decodes by
    self-speculation instead: drafts from the first E layers verified by the rest; greedy output
    equals full depth token for token, sampled output has the full model's distribution (in
    `exit_layers`, accepted drafts show E, tokens of the full model L). `attention` is "auto"
    (Triton on CUDA, the jnp reference elsewhere), "reference" or "triton" (interpreted without
    a GPU: slow). Sampling is seeded per row and position: row i draws with
    `fold_in(seed_key(seed), i)` folded with each token's index, whatever batch it runs in.
    """
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
    options = StepOptions(max_new_tokens, () if ignore_eos else model.eos_token_ids, sampling.sampler,
                          exit_config, spec_config, attention=attention)
    batch_size = batch_size or len(rows)

    dtype = model.dtype
    per_page = page_bytes(config.num_layers, page_size, config.num_kv_heads, config.head_dim, dtype)
    budget_pages = parse_bytes(cache_budget) // per_page
    # The cache holds a Llama's prompt and new tokens, a T5 decoder's new tokens only (its
    # prompt is the encoder's). A speculation round may draft past max_new_tokens; those
    # positions go to the null page.
    prompt_in_cache = not model_module(config).ENCODER_DECODER
    need = [pages_needed(len(r) * prompt_in_cache + max_new_tokens, page_size) for r in rows]
    if budget_pages < 1 + max(need):
        longest = int(np.argmax(need))
        what = f"{len(rows[longest])} prompt + {max_new_tokens} new" if prompt_in_cache else "decoder tokens"
        raise EejaxError(
            f"KV cache budget {cache_budget} holds {max(budget_pages - 1, 0) * page_size} tokens; "
            f"prompt {longest} needs {len(rows[longest]) * prompt_in_cache + max_new_tokens} ({what})"
        )
    table_width = bucket(max(need))
    num_pages = min(budget_pages, 1 + bucket(batch_bucket(min(batch_size, len(rows))) * table_width))
    cache = model.new_cache(num_pages, page_size)
    allocator = PageAllocator(num_pages)

    out_tokens: list[list[int]] = [[] for _ in rows]
    out_layers: list[list[int]] = [[] for _ in rows]
    out_confident: list[list[int]] = [[] for _ in rows]
    compile_before = model.programs.compile_seconds
    key = seed_key(seed)  # row i draws with fold_in(key, i), whatever chunk it runs in
    start = time.perf_counter()
    prefill_s = 0.0
    spec_totals = dict.fromkeys(SPEC_COUNTERS, 0)
    speculations: list[int] = []
    bonuses: list[bool] = []
    measured_costs: list[tuple[float, float]] = []
    pending = list(range(len(rows)))
    while pending:
        chunk, tables = [], []
        for i in pending[:batch_size]:
            try:
                tables.append(allocator.allocate(need[i]))
            except OutOfPagesError:
                break
            chunk.append(i)
        pending = pending[len(chunk):]
        state, cache, chunk_prefill_s, spec_out = _run_chunk(
            model, cache, [rows[i] for i in chunk], tables, table_width, _chunk_keys(key, chunk), sampling, options)
        prefill_s += chunk_prefill_s
        if spec_out is not None:
            counters, policy = spec_out
            for name in SPEC_COUNTERS:
                spec_totals[name] += int(np.asarray(getattr(counters, name))[: len(chunk)].sum())
            speculations += [d for d in policy.chosen if d]  # rounds only; plain steps are counted apart
            bonuses += policy.bonuses
            if policy.c_draft is not None:
                measured_costs.append((policy.c_draft, policy.c_verify(spec_config.num_speculations)))
        toks, layers, confident, counts = to_host(
            (state.tokens, state.exit_layers, state.confident_layers, state.num_generated)
        )
        for j, i in enumerate(chunk):
            out_tokens[i] = toks[j, : counts[j]].tolist()
            out_layers[i] = layers[j, : counts[j]].tolist()
            out_confident[i] = confident[j, : counts[j]].tolist()
        for pages in tables:
            allocator.free(pages)
    compile_s = model.programs.compile_seconds - compile_before
    run_s = time.perf_counter() - start - compile_s

    generated = sum(len(t) for t in out_tokens)
    decoded_tokens = generated - sum(1 for t in out_tokens if t)  # the first token comes from prefill
    decode_s = run_s - prefill_s
    layers_run = sum(sum(x) for x in out_layers)
    if spec_config is not None:  # draft and verify passes and plain steps, plus the prefill's first tokens
        plain_and_first = spec_totals["plain_steps"] + sum(1 for t in out_tokens if t)
        layers_run = spec_totals["layer_passes"] + config.num_layers * plain_and_first
    weights_per_token = _weights_per_token(model, exit_config, spec_config, out_layers, spec_totals, decoded_tokens)
    confident_sum = sum(sum(x) for x in out_confident)
    decoded = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer else None for t in out_tokens]
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
        "kv_cache_pages": num_pages,
        "page_size": page_size,
    }
    if spec_config is not None:
        t = spec_totals
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
        if measured_costs:  # adaptive: measured seconds per draft pass, and of a verify pass at the first d
            stats["draft_pass_s"], stats["verify_pass_s"] = map(float, np.mean(measured_costs, axis=0))
    return GenerateResult(texts, rows, out_tokens, decoded, out_layers, out_confident, stats)


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


def _chunk_keys(key, chunk: list[int]):
    """Per-row PRNG keys [batch bucket, 2] of a chunk of rows (their indices in the call)."""
    index = np.zeros((batch_bucket(len(chunk)),), np.uint32)
    index[: len(chunk)] = chunk
    return row_keys(key, index)


def _run_chunk(model, cache, rows, tables, table_width, keys, sampling: SamplingParams, options: StepOptions):
    """Prefill then decode one batch of rows (padded to a batch bucket) on the shared cache.
    Returns (state, cache, seconds the prefill ran, (SpecCounters, SpeculationPolicy) or None)."""
    b = batch_bucket(len(rows))
    t = bucket(max(len(r) for r in rows), MIN_PROMPT_BUCKET)
    tokens = np.zeros((b, t), np.int32)
    lengths = np.zeros((b,), np.int32)
    block_table = np.zeros((b, table_width), np.int32)
    for j, (r, pages) in enumerate(zip(rows, tables)):
        tokens[j, : len(r)] = r
        lengths[j] = len(r)
        block_table[j, : len(pages)] = pages
    widths: dict[int, jax.Array] = {}

    def table_for(max_tokens: int) -> jax.Array:
        """The block table cut to the pages that `max_tokens` tokens need (bucketed)."""
        w = min(table_width, bucket(pages_needed(max_tokens, cache.page_size)))
        if w not in widths:
            widths[w] = jnp.asarray(block_table[:, :w])
        return widths[w]

    # Tokens in the longest row's cache after the prefill: a Llama's prompt, a T5's start token.
    max_len = 1 if model_module(model.config).ENCODER_DECODER else int(lengths.max())
    args = (model.run_params, cache, jnp.asarray(tokens), jnp.asarray(lengths), table_for(max_len), keys, None, None,
            jax.tree.map(jnp.asarray, RowSampling.of(sampling, b)))
    prefill = model.programs.get(steps.prefill, args, model.config, options.prefilling(), donate_argnums=(1,))
    start = time.perf_counter()
    state, cache = jax.block_until_ready(prefill(*args))
    prefill_s = time.perf_counter() - start
    if options.spec is not None:
        state, cache, spec_out = _speculate(model, cache, state, table_for, max_len, options)
        return state, cache, prefill_s, spec_out
    # POLL_EVERY decode steps per program (`steps.decode_steps`), then one check of "all rows
    # done"; a last program may run past max_new_tokens: its rows are done and idle.
    decoding = options.decoding(POLL_EVERY)
    for step in range(1, options.max_new_tokens, POLL_EVERY):
        args = (model.run_params, cache, state, table_for(max_len + step + POLL_EVERY - 1))
        state, cache = model.programs.get(steps.decode_steps, args, model.config, decoding,
                                          donate_argnums=(1, 2))(*args)
        if bool(to_host(state.done).all()):
            break
    return state, cache, prefill_s, None


def _speculate(model, cache, state, table_for, max_len, options: StepOptions):
    """Self-speculation rounds until every row is done. Returns (state, cache, (counters,
    policy)). With a fixed d the host only polls every few rounds; adaptive rounds are
    timed (draft and verify programs apart) and their acceptance read back to choose d, or a
    plain full-depth step (d = 0, `speculative.plain_step`) while no round pays."""
    programs, params, config, spec = model.programs, model.run_params, model.config, options.spec
    reduced = spec.uses_reduced_head(exits.has_reduced_head(model.params.get("exits")))
    unit_costs = cost.spec_unit_weights(cost.WeightCounts.of(model.params, model.config), spec.exit_layer, reduced)
    policy = SpeculationPolicy(spec, unit_costs=unit_costs, sampled=options.sampler != GREEDY)
    counters = speculative.SpecCounters.zeros(state.done.shape[0])
    longest = max_len  # an upper bound on the tokens of the longest row in the cache
    seen = (0, 0)  # accepted, rejections summed over rows, as of the last read
    rounds = 0
    done = bool(to_host(state.done).all())  # max_new_tokens = 1, or every row ended at its first token
    while not done:
        d = policy.next_speculations()
        if d == 0:  # adaptive, and no round pays at the measured acceptance: one plain step
            args = (params, cache, state, counters, table_for(longest + 1))
            plain = programs.get(speculative.plain_step, args, config, options.decoding(), donate_argnums=(1, 2, 3))
            start = time.perf_counter()
            state, cache, counters = jax.block_until_ready(plain(*args))
            policy.observe_plain(time.perf_counter() - start)
            row_done, seq_len = to_host((state.done, state.seq_len))
            done, longest = bool(row_done.all()), int(seq_len.max())
            continue
        bonus = policy.bonus(d)
        table = table_for(longest + d + 1)
        args = (params, cache, state, table)
        round_options = options.round(d, bonus)
        draft = programs.get(speculative.draft, args, config, round_options.drafting(), donate_argnums=(1, 2))
        start = time.perf_counter()
        drafts, state, cache = draft(*args)
        if spec.adaptive:
            jax.block_until_ready(drafts.hidden)
        drafted_at = time.perf_counter()
        args = (params, cache, state, drafts, counters, table)
        verify = programs.get(speculative.verify, args, config, round_options.verifying(), donate_argnums=(1, 2, 4))
        verify_start = time.perf_counter()
        state, cache, counters = verify(*args)
        longest += d + 1
        rounds += 1
        if spec.adaptive or rounds % POLL_EVERY == 0:
            row_done, seq_len, accepted, rejections = to_host(
                (state.done, state.seq_len, counters.accepted.sum(), counters.rejections.sum())
            )
            timed = (drafted_at - start, time.perf_counter() - verify_start) if spec.adaptive else (None, None)
            policy.observe(d, int(accepted) - seen[0], int(rejections) - seen[1], *timed, passes=d + bonus)
            seen = (int(accepted), int(rejections))
            done = bool(row_done.all())
            longest = int(seq_len.max())
    return state, cache, (to_host(counters), policy)
