"""SmolLM2-135M on device meshes (this CPU's virtual devices): tokens against one device, programs
compiled, and what a generated token communicates; then a paper estimate for a 7B LayerSkip Llama
on 8 GPUs.

For each mesh (tensor x data) and decoding mode (full depth, early exit, self-speculation, and
SmolLM2's trained draft head: `smollm2-135m-eagle`, `draft:2`), on
--prompts CNN/DM prompts of --prompt-tokens tokens and --new-tokens greedy tokens: whether the
tokens equal one device's, how many programs were compiled, and the bytes of the collectives
(`eejax.decode.collectives`: each collective's result size on one device, loops' trip counts
multiplied in) per generated token and row, for one decode step and for a speculation round
(draft + verify, divided by the round's measured tokens). Early exit's loops have trip counts
only the data knows: its bytes are the same mesh's full-depth bytes scaled by the layers run
per token ("est."). At tensor 9 the tensor axis exceeds SmolLM2's 3 KV heads (the cache and KV
projections are replicated and XLA partitions the attention itself) and divides neither the MLP
(1536) nor the vocabulary (49152): only attention is split, one all-reduce per layer. Timings on virtual CPU
devices mean nothing and are not reported.

    python benchmarks/sharding.py [--meshes 1x1 3x1 1x2 3x2 9x1] [--prompts 4]

Writes benchmarks/out/sharding.{json,md}.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
if "device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=16"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import OUT, cnndm_prompts, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.decode.collectives import collectives  # noqa: E402
from eejax.loading import shard  # noqa: E402
from eejax.sharding import make_mesh

MODES = {
    "full depth": {},
    "softmax:0.9 @8,16,24": dict(exit=eejax.ExitConfig("softmax", 0.9, exit_layers=(8, 16, 24))),
    "self-spec 15:2": dict(spec="15:2"),
    "draft head draft:2": dict(spec="draft:2"),  # on smollm2-135m-eagle (DRAFTED)
}
DRAFTED = {"draft head draft:2"}  # the modes that run on the model with its draft head


def per_token_bytes(model, stats, rows: int) -> tuple[float, int]:
    """(collective bytes per generated token and row, loops of unknown trip count) of the decode
    programs `model` compiled: a decode step's, or a speculation round's over its tokens."""
    programs = {
        name: (collectives(compiled.as_text()), options) for name, options, compiled in model.programs.entries()
    }
    if "decode_slots" in programs:
        moved, options = programs["decode_slots"]
        return moved.total / (options.num_steps * rows), moved.unknown_loops
    moved = programs["spec_round_slots"][0]
    return moved.total / (stats["tokens_per_round"] * rows), moved.unknown_loops


def estimate_7b(tensor: int = 8, exit_fraction: float = 0.5) -> dict:
    """Paper estimate for a Llama-2-7B-shaped LayerSkip model in bf16 on `tensor` GPUs (tensor
    parallel as eejax shards it): weights, KV pages and collective bytes per generated token."""
    layers, d, heads, kv_heads, dh, f, vocab, bf16 = 32, 4096, 32, 32, 128, 11008, 32000, 2
    weights = (layers * (d * heads * dh + 2 * d * kv_heads * dh + heads * dh * d + 3 * d * f) + 2 * vocab * d) * bf16
    kv_token = 2 * layers * kv_heads * dh * bf16
    hidden = d * bf16  # one row's hidden state
    full = (2 * layers + 1) * hidden  # two all-reduces per layer and the embedding's
    run = round(layers * exit_fraction)
    early = (2 * run + 1) * hidden  # KV fill of the skipped layers projects each device's own heads
    ring = 2 * (tensor - 1) / tensor  # bytes a ring all-reduce sends per device, per result byte
    return dict(
        tensor=tensor,
        weights_gib_per_gpu=weights / tensor / 2**30,
        kv_kib_per_token_per_gpu=kv_token / tensor / 1024,
        kv_page_kib_per_gpu=16 * kv_token / tensor / 1024,
        full_depth_kib=full / 1024,
        early_exit_kib=early / 1024,
        layers_run=run,
        ring_factor=ring,
        full_depth_sent_kib=full * ring / 1024,
        early_exit_sent_kib=early * ring / 1024,
    )


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--meshes",
        nargs="+",
        default=["1x1", "3x1", "1x2", "3x2", "9x1"],
        help="tensor x data meshes (default 1x1 3x1 1x2 3x2 9x1)",
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    base, drafting = (eejax.load(n, quantization=None) for n in ("smollm2-135m", "smollm2-135m-eagle"))
    prompts = cnndm_prompts(base.tokenizer, args.prompts, args.prompt_tokens)
    model_of = {mode: drafting if mode in DRAFTED else base for mode in MODES}
    want = {
        mode: eejax.generate(model_of[mode], prompts, max_new_tokens=args.new_tokens, ignore_eos=True, **kw)
        for mode, kw in MODES.items()
    }
    rows = []
    for spec in args.meshes:
        tensor, data = (int(x) for x in spec.split("x"))
        if tensor * data > len(jax.devices()):
            continue
        for mode, kw in MODES.items():
            model = shard(model_of[mode], make_mesh(tensor, data))
            out = eejax.generate(model, prompts, max_new_tokens=args.new_tokens, ignore_eos=True, **kw)
            moved, unknown = per_token_bytes(model, out.stats, len(prompts))
            layers = out.stats["mean_layers_per_token"]
            if unknown:  # data-dependent loops: scale this mesh's full depth by the layers run
                full = next(r for r in rows if r["mesh"] == spec and r["mode"] == "full depth")
                moved = full["kib_per_token"] * 1024 * layers / base.config.num_layers
            rows.append(
                dict(
                    mesh=spec,
                    mode=mode,
                    same_tokens=out.tokens == want[mode].tokens,
                    programs=out.stats["compiled_programs"],
                    kib_per_token=moved / 1024,
                    estimated=bool(unknown),
                    layers_per_token=layers,
                )
            )
            print(rows[-1], flush=True)
    paper = estimate_7b()
    lines = [
        "| mesh (tensor x data) | mode | tokens = 1 device | programs | KiB per token and row | layers/token |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        star = " (est.)" if r["estimated"] else ""
        lines.append(
            f"| {r['mesh']} | {r['mode']} | {'yes' if r['same_tokens'] else 'NO'} | {r['programs']} | "
            f"{r['kib_per_token']:.1f}{star} | {r['layers_per_token']:.1f} |"
        )
    lines += [
        "",
        f"7B LayerSkip Llama (Llama-2-7B shape, bf16) on {paper['tensor']} GPUs: "
        f"{paper['weights_gib_per_gpu']:.2f} GiB of weights and {paper['kv_kib_per_token_per_gpu']:.0f} KiB of KV "
        f"per token per GPU ({paper['kv_page_kib_per_gpu']:.0f} KiB per 16-token page); all-reduce results per "
        f"token and row {paper['full_depth_kib']:.0f} KiB at full depth, {paper['early_exit_kib']:.0f} KiB exiting "
        f"at {paper['layers_run']} of 32 layers (a ring sends {paper['ring_factor']:.2f}x that per GPU: "
        f"{paper['full_depth_sent_kib']:.0f} / {paper['early_exit_sent_kib']:.0f} KiB).",
    ]
    text = "\n".join(lines)
    print(text)
    write_result("sharding", dict(rows=rows, estimate_7b=paper, args=vars(args)))
    (OUT / "sharding.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
