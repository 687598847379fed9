"""What the `eejax` commands share: running a command with one-line errors, reading prompts,
and argparse types that name what they expected."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from eejax.bench.prompts import read_file
from eejax.errors import EejaxError
from eejax.quantized import ACTIVATIONS


def run_guarded(fn: Callable[[], int]) -> int:
    """Runs a command; bad input becomes one line on stderr and exit status 2."""
    try:
        return fn()
    except EejaxError as e:
        print(f"eejax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eejax: interrupted", file=sys.stderr)
        return 130


def read_prompts_file(path: str, field: str | None) -> list[str]:
    """Prompts from a .jsonl file: one JSON string or object per line (`bench.prompts.read_file`)."""
    return read_file(path, field, None)[0]


def prompts_from_args(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompt or --prompts-file (none when neither was given), cut to --limit."""
    if args.prompt is None and args.prompts_file is None:
        return []
    prompts = args.prompt if args.prompt is not None else read_prompts_file(args.prompts_file, args.prompt_field)
    return prompts[: args.limit] if args.limit else prompts


def add_model_and_prompts(
    parser: argparse.ArgumentParser, what: str, model_help: str, *, required: bool = True
) -> None:
    """--model, --prompt | --prompts-file (one of them `required`), --prompt-field, --limit."""
    parser.add_argument("--model", required=True, help=model_help)
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument(
        "--prompt",
        nargs="+",
        action="extend",
        metavar="TEXT",
        help=f"one or more {what} (repeat --prompt or give several)",
    )
    src.add_argument(
        "--prompts-file",
        metavar="F.jsonl",
        help=f"{what}, one JSON string or object per line (field prompt, text, article or document)",
    )
    parser.add_argument("--prompt-field", help="which field of --prompts-file objects holds the prompt")
    parser.add_argument("--limit", type=positive_int, help="use only the first N prompts")


def quantization(text: str) -> str | None:
    """--quantization's value: auto, gguf, int8, or none / off (float weights as stored)."""
    value = text.strip().lower()
    if value in ("none", "off", "no", "false", "0", ""):
        return None
    if value not in ("auto", "gguf", "int8"):
        raise argparse.ArgumentTypeError(f"expected auto, gguf, int8 or none, got {text!r}")
    return value


def add_model_placement(parser: argparse.ArgumentParser, default_layout: str = "auto", why: str = "") -> None:
    """--quantization, --activations, --prompt-activations, --layer-buffers, --tensor-parallel,
    --data-parallel: how the
    model's weights are stored and laid out."""
    parser.add_argument(
        "--quantization",
        type=quantization,
        default="auto",
        metavar="{auto,gguf,int8,none}",
        help="how the weights are kept: auto (default: the fastest exact setting for this device: on a CPU a "
        "known GGUF model's own blocks with int16 activations, e.g. smollm2-135m at ~3x its float32 decode "
        "speed; on a GPU, with a mesh, and for checkpoint directories the weights as stored), gguf (a GGUF "
        "model's own 4- and 8-bit blocks: for smollm2-135m, Q4_1 layers and a Q8_0 embedding and head, 97 MB "
        "instead of 538), int8 (every matrix int8 per output channel, made as the model loads), or none (the "
        "weights as stored, a known GGUF model dequantised to float32). Quantized models run on one device",
    )
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=None,
        help="how quantized products take their input: int16 (the default where --quantization auto keeps "
        "the blocks) or int8 (rounded per block of 32 to 16 or 8 bits, int8 as llama.cpp does: 2-3x faster "
        "products on a CPU than float32, and int8 half int16's multiply-adds where several rows share a product: "
        "batches, verify passes; int16's logits stay within ~1e-4 of float32's, int8's move visibly), or float32 "
        "(the default otherwise: the dequantised weights' products, up to summation order). Speculation "
        "gives full depth's tokens with each",
    )
    parser.add_argument(
        "--prompt-activations",
        choices=ACTIVATIONS,
        default=None,
        help="how a prefill's quantized products take their input (default: as --activations). int16 with "
        "float32 --activations runs prompts as an integer GEMM (~2x on a CPU with AVX-512 VNNI) while decode "
        "steps and speculation's verify passes take float32 input",
    )
    parser.add_argument(
        "--layer-buffers",
        choices=("auto", "stacked", "split", "rows"),
        default=default_layout,
        help="how decode steps read the layer weights: split (each layer's weights in their own "
        "buffer, views of the stack, the layers unrolled: on a CPU 1.01-1.27x faster decoding, for "
        "~3x the compile time of a decode program and ~4x its memory maps), stacked (a layer picked from "
        "the stack by index: what a GPU reads fastest), rows (stacked, with a transposed copy of the "
        "layers' float matrices, which XLA:GPU multiplies in one fused pass each; not yet timed on a GPU), "
        "or auto (split on a CPU, compiled in the "
        f"background while stacked steps run, unless EEJAX_BACKGROUND_COMPILE=off; stacked on a GPU or "
        f"a mesh); default {default_layout}{why}",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="T",
        help="split attention heads, MLP columns and the vocabulary over T devices (default 1; "
        "T must divide the attention heads)",
    )
    parser.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        metavar="D",
        help="split the rows of a batch over D devices (default 1); the mesh uses T x D devices",
    )


def add_processes(parser: argparse.ArgumentParser, what_process_0_does: str) -> None:
    """--coordinator, --num-processes, --process-id: one run over several processes."""
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join a multi-process run (jax.distributed) whose process 0 listens at HOST:PORT: every "
        "process runs the same command with its own --process-id; the mesh of --tensor-parallel x "
        f"--data-parallel spans all processes' devices; {what_process_0_does}",
    )
    parser.add_argument(
        "--num-processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="processes in the multi-process run (default 1)",
    )
    parser.add_argument("--process-id", type=int, metavar="I", help="this process's index in [0, N)")


def join_processes(args: argparse.Namespace) -> None:
    """Joins the multi-process run --coordinator / --num-processes / --process-id name, if any."""
    if args.coordinator is not None or args.num_processes != 1:
        if args.coordinator is None or args.process_id is None:
            raise EejaxError("--num-processes needs --coordinator HOST:PORT and --process-id")
        from eejax.sharding import initialize_distributed

        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    elif args.process_id is not None:
        raise EejaxError("--process-id needs --coordinator and --num-processes")


def load_model(args: argparse.Namespace):
    """The model of --model, laid out as --layer-buffers / --tensor-parallel / --data-parallel say."""
    import eejax

    mesh = (args.tensor_parallel, args.data_parallel) != (1, 1)
    model = eejax.load(
        args.model,
        layer_buffers=args.layer_buffers,
        # a mesh shards float weights: "auto" keeps no blocks there
        quantization=None if mesh and args.quantization == "auto" else args.quantization,
        activations=args.activations,
        prompt_activations=args.prompt_activations,
    )
    if mesh:
        model = eejax.shard(model, eejax.make_mesh(tensor=args.tensor_parallel, data=args.data_parallel))
    return model


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (0: the option is off)."""
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: off), got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def seconds_or_off(text: str) -> float:
    """A duration in seconds >= 0; "off" / "none" are 0 (no limit)."""
    return 0.0 if text.strip().lower() in ("off", "none") else non_negative_float(text)


def number_or_off(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise EejaxError(f"{option}: expected a number or 'off', got {text!r}") from None


def layer_counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts such as 3,6,9, got {text!r}") from None


def sampling_types() -> dict[str, type]:
    """Each of `SamplingParams.names()` with the type a flag or `key=value` reads it as."""
    from eejax.decode.sampling import SamplingParams

    return {name: kind for name, (kind, _, _) in SamplingParams.options().items()}


def add_sampling_args(parser, what: str = "") -> None:
    """--temperature, --top-k, ... (`SamplingParams.options()`), each defaulting to its off
    value; `what` says whose they are in their help (e.g. "requests' default: ")."""
    from eejax.decode.sampling import SamplingParams

    defaults = SamplingParams()
    for name, (kind, _, help) in SamplingParams.options().items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=getattr(defaults, name), help=what + help)


def sampling_of(args):
    """The `SamplingParams` of parsed --temperature, --top-k, ... flags (`add_sampling_args`)."""
    from eejax.decode.sampling import SamplingParams

    return SamplingParams(**{name: getattr(args, name) for name in SamplingParams.names()})


# A request's options as `eejax serve --warmup-for` spells them, with their types.
REQUEST_OPTIONS = {"exit": str, "spec": str, **sampling_types(), "logprobs": int, "prompt_logprobs": int}


def request_options(text: str) -> dict:
    """`key=value,key=value` of a request's options (`REQUEST_OPTIONS`) -> submit's keyword arguments."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in REQUEST_OPTIONS:
            raise argparse.ArgumentTypeError(
                f"expected key=value pairs of {', '.join(REQUEST_OPTIONS)} separated by commas, got {item!r}"
            )
        if key in out:
            raise argparse.ArgumentTypeError(f"{key} given twice in {text!r}")
        try:
            out[key] = REQUEST_OPTIONS[key](value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{key}: expected {REQUEST_OPTIONS[key].__name__}, got {value!r}"
            ) from None
    return out
