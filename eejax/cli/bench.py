"""`eejax bench`: which decoding setting is fastest on this device, measured against full depth
in the same run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from eejax.bench.prompts import SETS
from eejax.bench.settings import FULL, parse_setting
from eejax.cli.args import add_model_placement, load_model, positive_int
from eejax.errors import EejaxError


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from eejax.bench import bench, environment
    from eejax.bench.prompts import bench_prompts
    from eejax.bench.run import bench_runs

    settings = [parse_setting(s) for s in [FULL, *args.settings]]
    json_path = _json_target(args.json)
    if args.reference_field is not None and args.data in SETS:
        raise EejaxError(f"--reference-field needs --data FILE; the set {args.data} has no references")
    if args.peer is not None:
        from eejax.bench.peers import check_peer

        check_peer(args.peer, args.model)  # before the model loads
    model = load_model(args)
    prompts = bench_prompts(
        model.tokenizer,
        args.data,
        args.prompts,
        args.prompt_tokens,
        chat=args.chat_template,
        field=args.prompt_field,
        reference_field=args.reference_field,
        suffix=args.prompt_suffix.replace("\\n", "\n"),
    )
    if prompts.references is not None:
        _needs_rouge()
    peer = None
    if args.peer is not None:
        from eejax.bench.peers import peer_runner

        pad = model.tokenizer.pad_token_id
        pad = model.tokenizer.eos_token_id if pad is None else pad
        peer = (f"{args.peer} (peer)", peer_runner(args.peer, args.model, pad, args.peer_threads))
    total = bench_runs(settings, args.batches, args.repeats, peer is not None)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
        rows = bench(model, prompts, settings, args.batches, args.new_tokens, args.repeats, bar.update, peer)
    print(format_table(rows))
    if json_path is not None:
        run = {
            "settings": [s.name for s in settings],
            "batches": args.batches,
            "new_tokens": args.new_tokens,
            "prompts": args.prompts,
            "data": args.data,
            "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats,
            "peer": args.peer,
        }
        rows_json = [dataclasses.asdict(r) for r in rows]
        payload = {"environment": environment(args.model, model), "run": run, "rows": rows_json}
        _write_atomically(json_path, json.dumps(payload, indent=2) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


def format_table(rows) -> str:
    """The rows as a fixed-width table: a line per setting and batch."""
    show_rouge = any(r.rouge_l is not None for r in rows)
    show_peer = any(r.peer_decode_ratio is not None for r in rows)
    head = ["setting", "batch", "decode tok/s", "x full", "e2e tok/s", "x full", "tok/round", "layers/tok", "= full"]
    head += ["agree"] + (["ROUGE-L"] if show_rouge else []) + (["decode x peer", "e2e x peer"] if show_peer else [])
    lines = []
    for r in rows:
        cells = [
            r.setting,
            str(r.batch),
            f"{r.decode_tokens_per_s:.1f}",
            f"{r.decode_ratio:.2f}x",
            f"{r.tokens_per_s:.1f}",
            f"{r.end_to_end_ratio:.2f}x",
            "-" if r.tokens_per_round is None else f"{r.tokens_per_round:.2f}",
            "-" if math.isnan(r.layers_per_token) else f"{r.layers_per_token:.1f}",
            "yes" if r.tokens_equal_full else "NO" if r.lossless else "no",
            f"{r.agreement:.1%}",
        ]
        if show_rouge:
            cells.append("-" if r.rouge_l is None or math.isnan(r.rouge_l) else f"{r.rouge_l:.3f}")
        if show_peer:
            ratios = (r.peer_decode_ratio, r.peer_end_to_end_ratio)
            cells += ["-" if x is None else f"{x:.2f}x" for x in ratios]
        lines.append(cells)
    widths = [max(len(c) for c in column) for column in zip(head, *lines)]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        for cells in [head, *lines]
    )


def _json_target(path: str | None) -> Path | None:
    """--json's path, checked before the run: its folder exists and it is not a folder."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise EejaxError(f"--json {path} is a directory; give a file name")
    if not p.parent.is_dir():
        raise EejaxError(f"--json {path}: the folder {p.parent} does not exist")
    return p


def _write_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` whole or not at all (a temporary file beside it, then renamed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _needs_rouge() -> None:
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        needs = "the prompts have references, and ROUGE-L needs rouge-score: pip install 'eejax[bench]'"
        raise EejaxError(needs) from None


def add_parsers(sub) -> None:
    """Adds `eejax bench` to the `eejax` subparsers."""
    p = sub.add_parser(
        "bench",
        help="measure decoding settings on this device against full depth",
        description="Time decoding settings on this device, each against full depth in the same run: every "
        "setting runs between two full-depth runs and its ratio is to their mean (this corrects for a machine "
        "whose speed drifts), the median over --repeats. Each batch size decodes every prompt once, greedy, "
        "exactly --new-tokens tokens each (EOS ignored), after one warm-up run per setting that compiles it. "
        "A row per setting and batch: decode tokens/s (the steps after each row's first token) and end-to-end "
        "tokens/s (prefill included) with their ratios to full depth, tokens per round (speculation), mean "
        "layers per token, whether every token equals full depth's (a lossless setting must: NO marks a "
        "failure), the share of positions that do, and with references ROUGE-L. --json writes the rows "
        "with the device, the versions and the run's settings.",
    )
    p.add_argument("--model", required=True, help='eejax checkpoint directory or a known name such as "smollm2-135m"')
    p.add_argument(
        "--settings",
        nargs="+",
        action="extend",
        default=["auto"],
        metavar="S",
        help="settings to time besides full depth (which always runs): a speculation spec such as "
        "draft:4:lookup, 15:2 or auto (also spec=SPEC), or exit=SPEC for early exit such as exit=softmax:0.9 "
        "(see `eejax generate --help`); default: auto",
    )
    p.add_argument(
        "--batches",
        nargs="+",
        action="extend",
        type=positive_int,
        default=[1, 8],
        metavar="B",
        help="batch sizes: rows decoded together (default 1 8)",
    )
    p.add_argument("--new-tokens", type=positive_int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument(
        "--prompts",
        type=positive_int,
        default=8,
        metavar="K",
        help="prompts per run (default 8; a larger batch cycles them)",
    )
    p.add_argument(
        "--data",
        default="chat",
        metavar="SET|F.jsonl",
        help="the prompts: chat (everyday questions) or code (coding requests), both through the chat template, "
        "pydoc (Python's docs, continued as plain text), or a .jsonl file of prompts (one JSON string or object "
        "a line; an object's reference field, if any, is scored by ROUGE-L). Default chat",
    )
    p.add_argument("--chat-template", action="store_true", help="put a file's prompts through the chat template")
    p.add_argument("--prompt-field", help="which field of --data objects holds the prompt")
    p.add_argument("--reference-field", help="which field of --data objects holds a reference text (default reference)")
    p.add_argument(
        "--prompt-suffix",
        default="",
        metavar="TEXT",
        help="text put after each plain-text prompt's cut, within --prompt-tokens; \\n is a newline "
        "(e.g. '\\n\\nSummary:' for news summaries; default none)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=256,
        metavar="N",
        help="cut plain-text prompts to their first N tokens (default 256)",
    )
    p.add_argument("--repeats", type=positive_int, default=1, help="timed repeats; ratios are their median (default 1)")
    p.add_argument(
        "--peer",
        choices=("hf", "llamacpp"),
        help="also time a peer on the same token ids, before and after each batch's runs (the faster kept), and "
        "give every row's ratio to it: hf (transformers, the GGUF dequantised to float32; the convert extra) or "
        "llamacpp (llama-cpp-python on the GGUF's blocks in its own process, batch 1 only; the llamacpp extra). "
        "Needs a known model made from a GGUF file",
    )
    p.add_argument("--peer-threads", type=positive_int, metavar="N", help="llama.cpp's threads (default: every core)")
    p.add_argument("--json", metavar="FILE", help="also write the rows, the device and the versions to FILE")
    add_model_placement(p)
    p.set_defaults(func=cmd_bench)
