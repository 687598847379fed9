"""eejax on a GGUF's own blocks against llama.cpp on the same file (SmolLM2-135M-Instruct Q4_1), batch 1.

The same token ids for both: the prompts of --set (`benchmarks/eval_sets.py`; default CNN/DM
summary prompts: rows 0..N-1 of data/cnndm_test_dev100.jsonl, the first --prompt-tokens tokens
ending in "\\n\\nSummary:"; chat and mtbench: questions through the chat template; pydoc: Python's
docs), --new-tokens greedy tokens each, EOS ignored, one prompt at a time. llama.cpp
(llama-cpp-python, the `llamacpp` extra) runs in its own process with --threads threads (in
eejax's process its thread pool slowed eejax), once before eejax's runs and once after (the faster
run is kept). Reported for each side: prefill tokens/s, decode tokens/s (the steps after the first
token) and end-to-end tokens/s (prefill included), and eejax's ratios to llama.cpp; eejax's
settings are the GGUF blocks with float32, int8 and int16 activations, and float32 ones with int16
prompts (a prefill's products in integers), at full depth and, with the draft head
(smollm2-135m-eagle on the same blocks), --specs. Also the share of llama.cpp's greedy tokens
that eejax's float32 reference reproduces.

    python benchmarks/llamacpp.py [--set cnndm|mtbench|chat|pydoc|code] [--prompts 8] [--new-tokens 64] \
        [--threads 2] [--specs draft:2:lookup]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.eval_sets import SETS  # noqa: E402
from benchmarks.eval_sets import prompts as eval_prompts  # noqa: E402


def summarise(rows: list[dict], prompts: list[list[int]], new_tokens: int) -> dict:
    prefill = sum(r["prefill_s"] for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    return {
        "prefill_tokens_per_s": sum(map(len, prompts)) / prefill,
        "decode_tokens_per_s": len(rows) * (new_tokens - 1) / decode,
        "end_to_end_tokens_per_s": len(rows) * new_tokens / (prefill + decode),
        "tokens": [r["tokens"] for r in rows],
    }


def llamacpp_in_child(gguf: str, prompts, new_tokens: int, threads: int) -> dict:
    """llama.cpp's greedy decoding of each prompt in a process of its own (`eejax.bench.peers`)."""
    from eejax.bench.peers import llamacpp_in_child as run

    r = run(gguf, prompts, new_tokens, threads)
    return {
        "prefill_tokens_per_s": r.prefill_tokens_per_s,
        "decode_tokens_per_s": r.decode_tokens_per_s,
        "end_to_end_tokens_per_s": r.tokens_per_s,
        "tokens": r.tokens,
    }


def run_eejax(model, prompts, new_tokens: int, spec=None) -> dict:
    """eejax's greedy decoding of each prompt at batch 1 (a warm-up run first)."""
    import eejax

    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, spec=spec)
    eejax.generate(model, prompts[:1], **kw)
    rows = []
    for prompt in prompts:
        s = eejax.generate(model, [prompt], **kw)
        rows.append(
            {"prefill_s": s.stats.prefill_s, "decode_s": s.stats.run_s - s.stats.prefill_s, "tokens": s.tokens[0]}
        )
    return summarise(rows, prompts, new_tokens)


def main(argv=None) -> int:
    from eejax.cli.parsing import OneLineErrorParser

    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    parser.add_argument(
        "--specs",
        nargs="*",
        action="extend",
        default=None,
        help="draft-head settings (default draft:2:lookup, the best measured on the blocks: docs/quantization.md)",
    )
    parser.add_argument(
        "--set",
        choices=SETS,
        default="cnndm",
        help="the prompts (benchmarks/eval_sets.py): cnndm summaries (default), mtbench / chat questions through "
        "the chat template, pydoc / code text",
    )
    parser.add_argument("--name", default="llamacpp")
    args = parser.parse_args(argv)
    specs = ["draft:2:lookup"] if args.specs is None else args.specs
    if args.set == "cnndm" and args.prompts > 20:
        parser.error("at most 20 prompts: rows 0..19 are the draft head's held-out rows")

    import eejax
    from benchmarks.common import write_result
    from eejax.loading.hub import fetch_original
    from eejax.quantized import ACTIVATIONS

    gguf = str(fetch_original("smollm2-135m"))
    reference = eejax.load("smollm2-135m", quantization=None)
    try:
        prompts = eval_prompts(reference.tokenizer, args.set, args.prompts, args.prompt_tokens)
    except ValueError as e:
        parser.error(str(e))
    peers = [llamacpp_in_child(gguf, prompts, args.new_tokens, args.threads)]
    float32 = run_eejax(reference, prompts, args.new_tokens)
    del reference
    ours = {"float32 (dequantised)": float32}
    for activations, prompt_activations in [(a, None) for a in ACTIVATIONS] + [("float32", "int16")]:
        kw = dict(quantization="gguf", activations=activations, prompt_activations=prompt_activations)
        setting = f"gguf, {activations} activations" + (f", {prompt_activations} prompts" if prompt_activations else "")
        if (activations, prompt_activations) == ("int16", None):
            setting += " (eejax.load's default on a CPU)"
        ours[setting] = run_eejax(eejax.load("smollm2-135m", **kw), prompts, args.new_tokens)
        if specs:
            drafted = eejax.load("smollm2-135m-eagle", **kw)
            for spec in specs:
                ours[f"{setting}, {spec}"] = run_eejax(drafted, prompts, args.new_tokens, spec)
            del drafted
    peers.append(llamacpp_in_child(gguf, prompts, args.new_tokens, args.threads))
    peer = max(peers, key=lambda p: p["decode_tokens_per_s"])
    agree = sum(a == b for p, q in zip(peer["tokens"], float32["tokens"]) for a, b in zip(p, q))
    total = sum(map(len, float32["tokens"]))
    runs = ", ".join(f"{p['decode_tokens_per_s']:.1f}" for p in peers)
    lines = [
        f"llama.cpp ({args.threads} threads): prefill {peer['prefill_tokens_per_s']:.0f} tok/s, decode "
        f"{peer['decode_tokens_per_s']:.1f} tok/s (runs: {runs}), "
        f"end to end {peer['end_to_end_tokens_per_s']:.1f} tok/s; its greedy tokens equal eejax float32's at "
        f"{agree / total:.1%} of positions",
        "| eejax | prefill tok/s | decode tok/s | vs llama.cpp | end to end tok/s | vs llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in ours.items():
        lines.append(
            f"| {name} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s'] / peer['decode_tokens_per_s']:.2f}x | {r['end_to_end_tokens_per_s']:.1f} | "
            f"{r['end_to_end_tokens_per_s'] / peer['end_to_end_tokens_per_s']:.2f}x |"
        )
    print("\n".join(lines))
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens"}  # noqa: E731
    write_result(
        args.name,
        {
            "args": vars(args),
            "llamacpp": [strip(p) for p in peers],
            "eejax": {k: strip(v) for k, v in ours.items()},
            "llamacpp_agreement_with_float32": agree / total,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
