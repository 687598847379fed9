"""eejax full-depth greedy decoding vs HF transformers `generate` on SmolLM2-135M (fp32).

Same CNN/DM prompts (first --prompt-tokens tokens of each article), --new-tokens generated
tokens per row with EOS ignored, batch 1 / 8 / 32, both measured in this run. Prints tokens/s
of each (prefill included), the ratio, layers executed per token, then the decode steps alone
(HF's: a 64-token generate's time beyond a 1-token one) against the memory-bandwidth bound: a
decode step reads every weight once and each row's K/V (at the mean context of the run), so at
batch B the bound is B x (measured read bandwidth) / (weight bytes + B x K/V bytes per row), and
each side's share of it.

    python benchmarks/full_depth.py [--batches 1 8 32] [--new-tokens 64] [--prompt-tokens 256] \
        [--layer-buffers auto|stacked|split|rows] [--dtype float32|bfloat16] \
        [--quantization gguf|int8] [--activations float32|int16|int8] [--prompt-activations int16] \
        [--versus-float] [--hf-device cuda] [--hf-dtype bfloat16] [--hf-static]

HF runs on --hf-device in --hf-dtype; --hf-static also times its decode steps with its static
cache (compiled by torch.compile at each batch's shapes). With --quantization the bound counts
the bytes a step reads of the quantized weights (blocks, scales and minimums), and
--versus-float pairs their decode steps with the float model's (the GGUF converted) in --dtype.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_quantization_args,
    cnndm_prompts,
    fmt_ratio,
    hf_decode_tokens_per_s,
    hf_generate_tokens_per_s,
    load_hf_smollm2,
    load_model,
    paired_runs,
    read_bandwidth_gbs,
    write_result,
)
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.loading.model import Model  # noqa: E402
from eejax.models.llama import param_bytes_per_token  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", action="extend", default=None, help="default: 1 8 32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="eejax timed runs per batch (best is kept)")
    parser.add_argument("--skip-hf", action="store_true", help="measure eejax only")
    parser.add_argument("--hf-device", default="cpu", help="where HF runs (cuda on a GPU machine)")
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32", help="HF's weights")
    parser.add_argument(
        "--hf-static", action="store_true", help="also HF's decode steps with its static cache (torch.compile)"
    )
    parser.add_argument(
        "--layer-buffers",
        choices=("auto", "stacked", "split", "rows"),
        default="auto",
        help="how eejax's decode steps read the layer weights (see eejax.Model.layout)",
    )
    parser.add_argument(
        "--versus-stacked",
        action="store_true",
        help="also time the decode steps of the stacked layout (same weights) paired with the chosen one: "
        "the layouts alternate and the median ratio of --repeats pairs is printed",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="eejax's weights, activations and KV cache (HF runs float32 either way)",
    )
    parser.add_argument(
        "--versus-triton",
        action="store_true",
        help="also time the decode steps of the Triton layer (attention='triton': the Triton attention kernel and "
        "the fused products of eejax/kernels/triton_linear.py; a GPU) paired with the default: the two alternate "
        "and the median ratio of --repeats pairs is printed",
    )
    add_quantization_args(parser)
    parser.add_argument(
        "--versus-float",
        action="store_true",
        help="with --quantization: also time the decode steps of the float model (the GGUF converted, in "
        "--dtype) paired with the quantized one: the two alternate and the median ratio of --repeats pairs "
        "is printed",
    )
    args = parser.parse_args(argv)
    args.batches = args.batches or [1, 8, 32]
    if args.versus_float and not args.quantization:
        parser.error("--versus-float compares quantized weights with float ones: give --quantization")

    model = load_model(args, dtype=jnp.dtype(args.dtype))
    float_model = None
    if args.versus_float:
        float_model = eejax.load("smollm2-135m", layer_buffers=args.layer_buffers, dtype=jnp.dtype(args.dtype))
    hf = None if args.skip_hf else load_hf_smollm2(args.hf_dtype, args.hf_device)
    bw = read_bandwidth_gbs()
    weight_bytes = param_bytes_per_token(model.params, model.config)
    bound = bw * 1e9 / weight_bytes
    c = model.config
    context = args.prompt_tokens + args.new_tokens / 2  # the mean context a decode step attends to
    kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize * context
    print(
        f"read bandwidth {bw:.1f} GB/s; a decode step reads {weight_bytes / 1e6:.0f} MB of weights and "
        f"{kv_bytes / 1e6:.1f} MB of K/V per row; batch-1 bound {bound:.1f} tokens/s"
    )
    rows = []
    for b in args.batches:
        prompts = cnndm_prompts(model.tokenizer, b, args.prompt_tokens)
        kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
        eejax.generate(model, prompts, **kw)  # compile
        runs = [eejax.generate(model, prompts, **kw).stats for _ in range(args.repeats)]
        ours = max(r["tokens_per_s"] for r in runs)
        ours_decode = max(r["decode_tokens_per_s"] for r in runs)
        pad = model.config.pad_token_id or 0
        peer = float("nan") if hf is None else hf_generate_tokens_per_s(hf, prompts, args.new_tokens, pad)
        peer_decode = float("nan") if hf is None else hf_decode_tokens_per_s(hf, prompts, args.new_tokens, pad)
        static = float("nan")
        if hf is not None and args.hf_static:
            static = hf_decode_tokens_per_s(hf, prompts, args.new_tokens, pad, cache="static")
        step_bytes = weight_bytes + b * kv_bytes
        batch_bound = b * bw * 1e9 / step_bytes
        row = {
            "batch": b,
            "eejax_tokens_per_s": ours,
            "hf_tokens_per_s": peer,
            "ratio": ours / peer if peer else None,
            "eejax_decode_tokens_per_s": ours_decode,
            "hf_decode_tokens_per_s": peer_decode,
            "decode_ratio": ours_decode / peer_decode if peer_decode else None,
            "hf_static_decode_tokens_per_s": static,
            "static_decode_ratio": ours_decode / static if args.hf_static else None,
            "layers_per_token": runs[0]["mean_layers_per_token"],
            "compiled_programs": model.programs.num_programs,
            "bytes_per_step": step_bytes,
            "bandwidth_bound_tokens_per_s": batch_bound,
            "fraction_of_bandwidth_bound": ours_decode / batch_bound,
            "hf_fraction_of_bandwidth_bound": peer_decode / batch_bound,
        }
        if args.versus_stacked:
            stacked = Model(model.config, model.params, model.tokenizer, layer_buffers="stacked")
            paired = paired_runs(
                lambda layout, stacked=stacked, prompts=prompts, kw=kw: eejax.generate(
                    stacked if layout is None else model, prompts, **kw
                ),
                [model.layout],
                args.repeats,
            )
            row["decode_versus_stacked"] = paired.speedups[0]
            print(f"   {model.layout} decode steps over stacked's, paired: {paired.speedups[0]:.2f}x")
        if args.versus_triton:
            paired = paired_runs(
                lambda impl, prompts=prompts, kw=kw: eejax.generate(model, prompts, attention=impl or "auto", **kw),
                ["triton"],
                args.repeats,
            )
            row["decode_triton_versus_auto"] = paired.speedups[0]
            print(f"   the Triton layer's decode steps over the default's, paired: {paired.speedups[0]:.2f}x")
        if float_model is not None:
            paired = paired_runs(
                lambda weights, prompts=prompts, kw=kw: eejax.generate(
                    float_model if weights is None else model, prompts, **kw
                ),
                [args.quantization],
                args.repeats,
            )
            row["decode_versus_float"] = paired.speedups[0]
            print(f"   {args.quantization} decode steps over {args.dtype}'s, paired: {paired.speedups[0]:.2f}x")
        rows.append(row)
        print(
            f"batch {b:3d}: eejax {ours:7.1f} tok/s | HF {peer:7.1f} tok/s | ratio {fmt_ratio(ours, peer)} | "
            f"layers/token {row['layers_per_token']:.0f}\n"
            f"   decode steps alone: eejax {ours_decode:7.1f} tok/s | HF {peer_decode:7.1f} tok/s | ratio "
            f"{fmt_ratio(ours_decode, peer_decode)}"
            + (f" | HF static cache {static:7.1f} tok/s: {fmt_ratio(ours_decode, static)}" if args.hf_static else "")
            + f" | {step_bytes / 1e6:.0f} MB per step, bound {batch_bound:.1f} "
            f"tok/s: eejax {ours_decode / batch_bound:.0%}, HF {peer_decode / batch_bound:.0%}",
            flush=True,
        )
    name = "_".join(
        ["full_depth", model.layout]
        + ([args.dtype] if args.dtype != "float32" else [])
        + ([args.quantization] if args.quantization else [])
        + ([f"act_{args.activations}"] if args.quantization and args.activations != "float32" else [])
    )
    path = write_result(
        name,
        {
            "read_bandwidth_gbs": bw,
            "weight_bytes_per_token": weight_bytes,
            "bandwidth_bound_tokens_per_s": bound,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "layer_buffers": model.layout,
            "dtype": args.dtype,
            "quantization": model.quantization,
            "activations": args.activations if args.quantization else None,
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
