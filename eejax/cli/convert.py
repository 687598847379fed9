"""`eejax convert`: the command line over `conversion.convert`."""

from __future__ import annotations

import argparse

from eejax.cli.args import quantization
from eejax.cli.parsing import RenamedOption

DESCRIPTION = """Convert an HF PyTorch checkpoint or a GGUF file into an eejax checkpoint.

SRC is an HF model directory (config.json plus model.safetensors, pytorch_model.bin, or their
sharded *.index.json; read with torch: pip install 'eejax[convert]') or a .gguf file
(dequantised by gguf-py, no torch: 'eejax[gguf]'). DST receives
eejax.json, params/ (orbax) and tokenizer/. The conversion is atomic: on any error nothing is
left at DST. What converts (config.json's model_type):
  llama    Llama 2/3.x, SmolLM2, TinyLlama, LayerSkip Llamas, ...
  qwen2    Qwen2 and Qwen2.5 (q/k/v biases; a sliding window only on every layer or none)
  qwen3    Qwen3 dense models (RMSNorm on q and k)
  mistral  Mistral (its sliding attention window)
  t5       T5ForConditionalGeneration: T5 v1.0, v1.1, Flan-T5, CALM-style T5s
A .gguf file of llama.cpp's llama, qwen2 or qwen3 architecture converts without torch (float, or
its own blocks with --quantization gguf); another architecture's goes through transformers (torch)."""


def add_parsers(sub) -> None:
    """Adds `convert` to the `eejax` command's subparsers."""
    parser = sub.add_parser(
        "convert",
        help="convert an HF checkpoint or .gguf file to eejax",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="HF model directory or .gguf file")
    parser.add_argument("dst", help="directory to create for the eejax checkpoint")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the stored weights (default: float32). bfloat16 halves the bytes a decode step "
        "reads, which pays on a GPU; on a CPU with eejax's matmul kernel, SmolLM2 decodes 1.1x faster "
        "in bfloat16 at batch 1 and 0.95x at batch 8 (an AMD EPYC with avx512_bf16: widening bf16 "
        "weights costs the kernel compute), and ~3x slower with EEJAX_CPU_MATMUL=off",
    )
    parser.add_argument(
        "--quantization",
        type=quantization,
        default=None,
        metavar="{gguf,int8,none}",
        help="store the matrices quantized (Llama): gguf keeps a .gguf file's own Q4_0 / Q4_1 / Q8_0 blocks "
        "(no float copy), int8 stores every matrix as int8 per output channel (any checkpoint); default none "
        "(float weights; a .gguf file dequantised). Norms stay --dtype",
    )
    parser.add_argument(
        "--quantize",
        dest="quantization",
        type=quantization,
        action=RenamedOption,
        new_name="--quantization",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from conversion.convert import convert

    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so the partial checkpoint is removed on the way out.
        signal.signal(signal.SIGTERM, _interrupt)
    dst = convert(
        args.src,
        args.dst,
        dtype=args.dtype,
        quantization=args.quantization,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(f"wrote {dst}")
    return 0
