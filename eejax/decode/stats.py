"""What a `generate` call reports (`GenerateStats`): speeds, layers and weights read per token
(the cost model's ideal speed-up), and self-speculation's counts."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from eejax.decode import cost
from eejax.models import exits

SPEC_COUNTERS = (
    "drafted",
    "accepted",
    "rounds",
    "rejections",
    "layer_passes",
    "draft_heads",
    "draft_layers",
    "plain_steps",
)


@dataclasses.dataclass(frozen=True)
class GenerateStats(Mapping):
    """The whole call's numbers. Speeds exclude compilation; `decode_tokens_per_s` also the
    prefills (the first token of a row comes from its prefill). Layers and weights per token
    count every layer run, KV fill, exit head and draft (`eejax.decode.cost`); `ideal_speedup`
    is full depth's weights over these. The speculation fields are None without `spec`, the
    measured pass times None unless it was adaptive; `depth_acceptance[k]` is the share of draft
    k + 1 accepted where the k before it were (τ of a chain of d: 1 + a0 + a0·a1 + ...). Read as
    attributes or as a mapping (`stats["tokens_per_s"]`, `{**stats}`; `as_dict()` for JSON: the
    fields that are not None)."""

    tokens_per_s: float
    generated_tokens: int
    decode_tokens_per_s: float
    mean_layers_per_token: float
    kv_fill_layers_per_token: float
    mean_confident_layer: float
    weights_per_token: float
    ideal_speedup: float
    num_layers: int
    exit: str
    spec: str | None
    run_s: float
    prefill_s: float
    compile_s: float
    compiled_programs: int
    kv_cache_pages: int
    page_size: int
    engine_steps: int
    acceptance_rate: float | None = None
    tokens_per_round: float | None = None
    plain_step_rate: float | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    rounds: int | None = None
    mean_speculations: float | None = None
    bonus_pass_rate: float | None = None
    draft_pass_s: float | None = None
    verify_pass_s: float | None = None
    depth_acceptance: tuple[float, ...] | None = None

    OPTIONAL = (
        "acceptance_rate",
        "tokens_per_round",
        "plain_step_rate",
        "drafted_tokens",
        "accepted_tokens",
        "rounds",
        "mean_speculations",
        "bonus_pass_rate",
        "draft_pass_s",
        "verify_pass_s",
        "depth_acceptance",
    )

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k not in self.OPTIONAL}

    def __getitem__(self, name: str):
        try:
            return self.as_dict()[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in these stats (speculation fields need spec=)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


def generate_stats(model, engine, seqs, exit_config, spec_config, run_s: float, compile_s: float) -> GenerateStats:
    """The stats of a `generate` call from its engine and its rows (`serve.sequence.Sequence`)."""
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
    stats = GenerateStats(
        tokens_per_s=generated / run_s if run_s > 0 else float("nan"),
        generated_tokens=generated,
        decode_tokens_per_s=decoded_tokens / decode_s if decode_s > 0 and decoded_tokens else float("nan"),
        mean_layers_per_token=layers_run / generated if generated else 0.0,
        kv_fill_layers_per_token=config.num_layers - layers_run / generated
        if generated and spec_config is None
        else 0.0,
        mean_confident_layer=confident_sum / generated if generated else 0.0,
        weights_per_token=weights_per_token,
        ideal_speedup=cost.ideal_speedup(cost.WeightCounts.of(model.params, config), weights_per_token),
        num_layers=config.num_layers,
        exit="full" if exit_config is None else exit_config.spec,
        spec=None if spec_config is None else spec_config.spec,
        run_s=run_s,
        prefill_s=prefill_s,
        compile_s=compile_s,
        compiled_programs=model.programs.num_programs,
        kv_cache_pages=engine.pages.num_pages,
        page_size=engine.page_size,
        engine_steps=engine.counters["steps"],
    )
    if spec_config is not None:
        t, policies = spec_totals, list(engine.speculation.policies.values()) + engine.speculation.past_policies
        chosen = sum((p.chosen for p in policies), collections.Counter())
        bonuses = sum((p.bonuses for p in policies), collections.Counter())
        rounds = sum(n for d, n in chosen.items() if d)  # rounds only; plain steps are counted apart
        stats = dataclasses.replace(
            stats,
            acceptance_rate=t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
            tokens_per_round=(decoded_tokens - t["plain_steps"]) / t["rounds"] if t["rounds"] else 0.0,
            plain_step_rate=t["plain_steps"] / decoded_tokens if decoded_tokens else 0.0,
            drafted_tokens=t["drafted"],
            accepted_tokens=t["accepted"],
            rounds=t["rounds"],
            mean_speculations=sum(d * n for d, n in chosen.items()) / rounds if rounds else 0.0,
            bonus_pass_rate=bonuses[True] / bonuses.total() if bonuses.total() else 0.0,
            depth_acceptance=depth_acceptance(seqs),
        )
        timed = [p for p in policies if p.c_draft is not None]
        if timed:  # adaptive: measured seconds per draft pass, and of a verify pass at the first d
            stats = dataclasses.replace(
                stats,
                draft_pass_s=float(np.mean([p.c_draft for p in timed])),
                verify_pass_s=float(np.mean([p.c_verify(spec_config.num_speculations) for p in timed])),
            )
    return stats


def depth_acceptance(seqs) -> tuple[float, ...]:
    """Per draft position k + 1 that any round judged, the share accepted of the rounds that
    judged it (its k predecessors accepted): `SpecCounters.depth_judged` and `depth_accepted`
    summed over the rows."""
    judged = sum(np.asarray(seq.spec_counters.get("depth_judged", 0)) for seq in seqs)
    accepted = sum(np.asarray(seq.spec_counters.get("depth_accepted", 0)) for seq in seqs)
    return tuple(float(a / j) for a, j in zip(np.atleast_1d(accepted), np.atleast_1d(judged)) if j)


def _weights_per_token(model, exit_config, spec_config, exit_layers, spec_totals, decoded_tokens: int) -> float:
    """Weights the decode tokens read per token, by the cost model (`eejax.decode.cost`); the
    first token of each row comes from the prefill in every configuration and is left out."""
    w = cost.WeightCounts.of(model.params, model.config)
    if not decoded_tokens:
        return float("nan")
    if spec_config is not None:
        t, e = spec_totals, spec_config.exit_layer
        # a draft head's module: d - 1 drafts and the catch-up (one in a round that copied its drafts)
        passes = (
            t["draft_layers"] if spec_config.draft_head else (t["layer_passes"] - t["rounds"] * (w.num_layers - e)) / e
        )
        reduced = spec_config.uses_reduced_head(exits.has_reduced_head(model.params.get("exits")))
        rounds = cost.spec_weights(w, e, passes, t["draft_heads"], t["rounds"], reduced, spec_config.draft_head)
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
