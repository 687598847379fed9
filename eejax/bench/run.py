"""A bench run: each setting and batch size timed against full depth in the same run (`paired`),
its tokens compared with full depth's, and the environment that produced the numbers."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import platform
from collections.abc import Callable

from eejax.bench.paired import paired_runs, runs_count
from eejax.bench.prompts import BenchPrompts
from eejax.bench.settings import FULL, Setting


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One setting at one batch size. Speeds are medians over the timed repeats (compilation
    excluded); ratios are to full depth timed around each run. `decode_tokens_per_s`: the steps
    after each row's first token; `tokens_per_s`: end to end, the prompts' prefill included.
    `tokens_per_round`: speculation's tokens per round; `layers_per_token`: mean layers a token
    ran. `tokens_equal_full`: every row's tokens equal full depth's; `agreement`: the share of
    generated positions whose token equals full depth's; `rouge_l`: mean ROUGE-L F1 against the
    prompts' references, where they have them. `peer_*_ratio`: the speeds over the peer's, timed
    before and after the batch's runs (the faster kept), where a peer ran; the peer's own row
    is named after it, with NaN layers per token."""

    setting: str
    batch: int
    lossless: bool
    decode_tokens_per_s: float
    tokens_per_s: float
    decode_ratio: float
    end_to_end_ratio: float
    tokens_per_round: float | None
    layers_per_token: float
    tokens_equal_full: bool
    agreement: float
    rouge_l: float | None = None
    peer_decode_ratio: float | None = None
    peer_end_to_end_ratio: float | None = None


def agreement(tokens: list[list[int]], full: list[list[int]]) -> float:
    """The share of positions, over every row, where `tokens` holds full depth's token (a row
    shorter or longer than full's counts its missing or extra positions as disagreements)."""
    same = sum(sum(a == b for a, b in zip(row, ref)) for row, ref in zip(tokens, full))
    total = sum(max(len(row), len(ref)) for row, ref in zip(tokens, full))
    return same / total if total else 1.0


def rouge_l(texts: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F1 (rouge-score, stemmed) of `texts` against `references`."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return sum(scorer.score(r, t)["rougeL"].fmeasure for t, r in zip(texts, references)) / len(texts)


def bench(
    model,
    prompts: BenchPrompts,
    settings: list[Setting],
    batches: list[int],
    new_tokens: int = 64,
    repeats: int = 1,
    tick: Callable[[], None] = lambda: None,
    peer: tuple[str, Callable] | None = None,
) -> list[BenchRow]:
    """A `BenchRow` per setting and batch size (full depth first), each batch's settings timed
    against full depth by `paired_runs`. At batch b every prompt decodes once, b rows at a time
    (prompts are cycled up to b when there are fewer), greedy, exactly `new_tokens` each. A model
    that would compile its split layers in the background is pinned to them first, so that no
    run is timed while another compiles. `peer`: (name, `peers.peer_runner`'s run), timed on the
    same ids before and after each batch's runs."""
    import eejax

    if model.compiles_split_later:
        model = dataclasses.replace(model, layer_buffers=model.layout)
    others = timed_settings(settings)
    rows = []
    for batch in batches:
        ids = list(itertools.islice(itertools.cycle(prompts.ids), max(batch, len(prompts.ids))))

        def run(setting: Setting | None, ids=ids, batch=batch):
            options = Setting(FULL).generate_options() if setting is None else setting.generate_options()
            return eejax.generate(model, ids, max_new_tokens=new_tokens, ignore_eos=True, batch_size=batch, **options)

        peer_runs = [_peer_run(peer, ids, batch, new_tokens, tick)]
        timed = paired_runs(run, others, repeats, tick)
        peer_runs.append(_peer_run(peer, ids, batch, new_tokens, tick))
        full = timed.last(None)
        references = None
        if prompts.references is not None:
            references = list(itertools.islice(itertools.cycle(prompts.references), len(ids)))
        full_speeds = timed.speed(None, _decode), timed.speed(None, _e2e)
        batch_rows = [_row(Setting(FULL), batch, full, full, 1.0, 1.0, *full_speeds, references)]
        for i, setting in enumerate(others):
            speeds = timed.ratio(i, _decode), timed.ratio(i, _e2e), timed.speed(i, _decode), timed.speed(i, _e2e)
            batch_rows.append(_row(setting, batch, timed.last(i), full, *speeds, references))
        best = max(filter(None, peer_runs), key=lambda r: r.decode_tokens_per_s, default=None)
        if best is not None:
            batch_rows = [
                dataclasses.replace(
                    r,
                    peer_decode_ratio=r.decode_tokens_per_s / best.decode_tokens_per_s,
                    peer_end_to_end_ratio=r.tokens_per_s / best.tokens_per_s,
                )
                for r in batch_rows
            ]
            batch_rows.append(_peer_row(peer[0], batch, best, full, *full_speeds))
        rows += batch_rows
    return rows


def _peer_run(peer, ids, batch: int, new_tokens: int, tick):
    if peer is None:
        return None
    result = peer[1](ids, batch, new_tokens)
    tick()
    return result


def _peer_row(name: str, batch: int, result, full, full_decode: float, full_e2e: float) -> BenchRow:
    """The peer's row: its speeds, their ratios to full depth's, its tokens against full depth's."""
    return BenchRow(
        setting=name,
        batch=batch,
        lossless=False,
        decode_tokens_per_s=result.decode_tokens_per_s,
        tokens_per_s=result.tokens_per_s,
        decode_ratio=result.decode_tokens_per_s / full_decode,
        end_to_end_ratio=result.tokens_per_s / full_e2e,
        tokens_per_round=None,
        layers_per_token=float("nan"),
        tokens_equal_full=result.tokens == full.tokens,
        agreement=agreement(result.tokens, full.tokens),
        peer_decode_ratio=1.0,
        peer_end_to_end_ratio=1.0,
    )


def bench_runs(settings: list[Setting], batches: list[int], repeats: int, peer: bool = False) -> int:
    """How many runs `bench` makes (a progress bar's total): `generate` calls and a peer's."""
    return len(batches) * (runs_count(len(timed_settings(settings)), repeats) + 2 * peer)


def timed_settings(settings: list[Setting]) -> list[Setting]:
    """The settings timed against full depth: each once, in order, full depth itself left out."""
    return [s for s in dict.fromkeys(settings) if not s.is_full]


def _decode(result) -> float:
    return result.stats["decode_tokens_per_s"]


def _e2e(result) -> float:
    return result.stats["tokens_per_s"]


def _row(setting, batch, result, full, decode_ratio, e2e_ratio, decode_speed, e2e_speed, references) -> BenchRow:
    stats = result.stats
    return BenchRow(
        setting=setting.name,
        batch=batch,
        lossless=setting.lossless,
        decode_tokens_per_s=decode_speed,
        tokens_per_s=e2e_speed,
        decode_ratio=decode_ratio,
        end_to_end_ratio=e2e_ratio,
        tokens_per_round=stats.tokens_per_round,
        layers_per_token=stats["mean_layers_per_token"],
        tokens_equal_full=result.tokens == full.tokens,
        agreement=agreement(result.tokens, full.tokens),
        rouge_l=None if references is None else rouge_l(result.texts, references),
    )


def environment(model_name: str, model) -> dict:
    """What produced a run's numbers: the date, the device, the versions, the model and how it
    is stored."""
    import jax
    import jaxlib

    from eejax.quantized import formats, is_quantized

    quantized = [x for x in jax.tree.leaves(model.params, is_leaf=is_quantized) if is_quantized(x)]
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": {"platform": device.platform, "kind": device.device_kind, "count": jax.device_count()},
        "cpu": {"cores": os.cpu_count(), "processor": _cpu_name(), "avx512_vnni": _cpu_has("avx512_vnni")},
        "versions": {
            "eejax": _version("eejax"),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "python": platform.python_version(),
        },
        "model": {
            "name": model_name,
            "layers": model.config.num_layers,
            "weights": sorted(formats(model.params)) or [str(model.dtype)],
            "activations": sorted({x.activations for x in quantized}) or None,
            "prompt_activations": sorted({x.prompt_activations or x.activations for x in quantized}) or None,
            "layer_buffers": model.layout,
        },
    }


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the platform's."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _cpu_has(flag: str) -> bool | None:
    """Whether /proc/cpuinfo lists `flag` (None where there is no /proc/cpuinfo)."""
    info = _cpuinfo()
    return flag in info.split() if info else None


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"
