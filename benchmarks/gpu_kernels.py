"""What SmolLM2-135M's decode programs launch on a GPU, compiled for one on this CPU.

Each setting generates a few tokens here with smollm2-135m-eagle (SmolLM2 and its draft head:
full depth is SmolLM2's), which compiles its programs; then its decode programs (not the
prefills) are traced as a GPU traces them and compiled by XLA:GPU for an H100 or H200 with no
device (`ProgramCache.compile_for`, `eejax.kernels.gpu_targets`). From the optimised HLO
(`control_flow.kernel_launches`) it prints, per program and batch:
- kernels a step, or a round for speculation (a program's outer loop runs a dispatch's steps or
  rounds): at batch 1 the H100 ran ~720 a full-depth step, and its time was their count
  (docs/gpu.md);
- kernels a layer: the layer loop's body;
- MB a step writes beyond updates in place: a product XLA left unfused writes its elementwise
  products (4 bytes a weight) and reads them back, on top of reading the weights;
- data-dependent loops (a host round trip an iteration on a GPU).
No timing: XLA's cost model, not autotuning, picks the fusions of a device-less compile.
`--attention triton` counts the Triton layer (the fused products, the attention kernel and the
head, each a custom call: one launch): the programs that ran here ("auto") traced again with
attention "triton" (`ProgramCache.compile_for`) and lowered through jax-triton with the target's
compute capability (no Triton kernel runs here).

    scripts/gpu_compiler.sh python benchmarks/gpu_kernels.py [--weights float32 bfloat16 gguf int8] \\
        [--settings full draft:4:lookup] [--batches 1 8] [--attention auto triton] [--target h100|h200]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("EEJAX_BACKGROUND_COMPILE", "off")  # every program compiled when first used

import jax.numpy as jnp  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import cnndm_prompts, decoding_options, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.decode.control_flow import kernel_launches  # noqa: E402
from eejax.kernels.gpu_targets import TARGETS, compile_only_device  # noqa: E402

WEIGHTS = {  # name -> eejax.load's keywords
    "float32": {},
    "bfloat16": {"dtype": jnp.bfloat16},
    "gguf": {"quantization": "gguf"},
    "int8": {"quantization": "int8"},
}
DECODES = ("decode_slots", "spec_round_slots", "plain_step_slots", "draft_slots", "verify_slots")


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", action="extend", choices=tuple(WEIGHTS), default=None)
    parser.add_argument(
        "--settings", nargs="+", action="extend", default=None, help="full, exit:MEASURE, draft:4:lookup, ..."
    )
    parser.add_argument("--batches", type=int, nargs="+", action="extend", default=None, help="default: 1 8")
    parser.add_argument(
        "--layer-buffers",
        nargs="+",
        action="extend",
        choices=("stacked", "rows", "split"),
        default=None,
        help="layouts of the layer weights (eejax.Model.layout; default stacked rows; rows only for float weights)",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        action="extend",
        choices=("auto", "triton"),
        default=None,
        help="the decode layer: auto (XLA's on a GPU; default) and/or triton (the Triton layer)",
    )
    parser.add_argument("--target", choices=tuple(TARGETS), default="h100")
    parser.add_argument("--hlo-dir", default=None, help="also write each program's optimised HLO there")
    args = parser.parse_args(argv)
    device = compile_only_device(args.target)
    rows = []
    print(f"compiled for {device.device_kind} on this CPU (no device)")
    print(
        f"{'weights':9s} {'layout':7s} {'attention':9s} {'setting':15s} {'batch':>5s}  {'program':18s} "
        f"{'kernels/step':>12s} {'kernels/layer':>13s} {'MB written/step':>15s} {'dynamic loops':>13s}"
    )
    runs = [
        (weights, layout, attention)
        for weights in args.weights or ["float32", "bfloat16", "gguf"]
        for layout in args.layer_buffers or ["stacked", "rows"]
        for attention in args.attention or ["auto"]
        if layout != "rows" or weights in ("float32", "bfloat16")  # quantized weights are rows already
    ]
    for weights, layout, attention in runs:
        model = eejax.load("smollm2-135m-eagle", layer_buffers=layout, **WEIGHTS[weights])
        layers = model.config.num_layers
        for setting in args.settings or ["full"]:
            for batch in args.batches or [1, 8]:
                model = model.with_params(model.params)  # its own programs: this setting's alone
                prompts = cnndm_prompts(model.tokenizer, batch, 64)
                eejax.generate(model, prompts, max_new_tokens=8, ignore_eos=True, **decoding_options(setting))
                triton = "triton" if attention == "triton" else None
                for name, compiled in model.programs.compile_for(device, names=DECODES, attention=triton):
                    text = compiled.as_text()
                    if args.hlo_dir:
                        os.makedirs(args.hlo_dir, exist_ok=True)
                        file = f"{weights}_{layout}_{attention}_{setting.replace(':', '-')}_b{batch}_{name}.hlo"
                        path = os.path.join(args.hlo_dir, file)
                        with open(path, "w") as f:
                            f.write(text)
                    k = kernel_launches(text)
                    outer = k.loops[-1] if k.loops else (1, k.total)  # the steps (rounds) of one dispatch
                    steps = outer[0] or 1
                    layer = max((n for trips, n in k.loops if trips == layers), default=0)
                    row = dict(
                        weights=weights,
                        layout=layout,
                        attention=attention,
                        setting=setting,
                        batch=batch,
                        program=name,
                        kernels_per_step=k.total / steps,
                        kernels_per_layer=layer,
                        mb_written_per_step=k.written_bytes / steps / 1e6,
                        dynamic_loops=k.dynamic_loops,
                    )
                    rows.append(row)
                    print(
                        f"{weights:9s} {layout:7s} {attention:9s} {setting:15s} {batch:5d}  {name:18s} "
                        f"{row['kernels_per_step']:12.0f} {layer or '-':>13} {row['mb_written_per_step']:15.1f} "
                        f"{k.dynamic_loops:13d}",
                        flush=True,
                    )
    path = write_result(f"gpu_kernels_{args.target}", {"target": args.target, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
