"""One markdown table of a GPU check's results (`scripts/gpu_check.sh`): full depth against HF
(`full_depth.py`'s JSON), the Triton kernel against XLA's attention (`kernels.py`'s), and each
early-exit and speculation setting against full depth in the same run (`gpu_profile.py`'s
engine part).

    python benchmarks/gpu_table.py DIR [DIR ...]   # the directories holding their JSON files
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eejax.cli.parsing import OneLineErrorParser  # noqa: E402


def full_depth_lines(record: dict) -> list[str]:
    dtype, layout = record["dtype"], record.get("layer_buffers", "stacked")
    setting = "full depth" if layout == "stacked" else f"full depth, {layout} layers"
    if record.get("quantization"):
        activations = record.get("activations") or "float32"
        setting += f", {record['quantization']} weights" + (f" ({activations} x)" if activations != "float32" else "")
    out = []
    for r in record["rows"]:
        against = []
        if r["hf_decode_tokens_per_s"] == r["hf_decode_tokens_per_s"]:  # NaN: HF not run
            against.append(f"HF eager {r['hf_decode_tokens_per_s']:.0f}: {r['decode_ratio']:.2f}x")
            static, ratio = r.get("hf_static_decode_tokens_per_s"), r.get("static_decode_ratio")
            static_text = "-" if static is None or static != static else f"{static:.0f}"
            against.append(f"HF static {static_text}{'' if ratio is None else f': {ratio:.2f}x'}")
        if r.get("decode_versus_stacked") is not None:
            against.append(f"{r['decode_versus_stacked']:.2f}x stacked (paired)")
        if r.get("decode_versus_float") is not None:
            against.append(f"{r['decode_versus_float']:.2f}x {dtype} weights (paired)")
        out.append(
            f"| {setting} | {dtype} | {r['batch']} | {r['eejax_decode_tokens_per_s']:.0f} "
            f"| {'; '.join(against) or '-'} | - |"
        )
    return out


def engine_lines(record: dict) -> list[str]:
    out = []
    dtype, batch = record["args"]["dtype"], record["args"]["batch"]
    model = record["args"]["model"]
    for runs in record["runs"].values():
        for r in runs.get("engine", []):
            if r["setting"] == "full depth":
                out.append(f"| {model} full depth | {dtype} | {batch} | {r['tok_s']:.0f} | (the peer below) | - |")
                continue
            tau = r.get("tokens_per_round")
            extra = f", τ {tau:.2f}" if tau else f", {r['layers_per_token']:.1f} layers/token"
            out.append(
                f"| {model} {r['setting']} | {dtype} | {batch} | {r['tok_s']:.0f} "
                f"| {r['speedup']:.2f}x full depth{extra} | {_equal(r)} |"
            )
    return out


def _equal(r: dict) -> str:
    """Whether a setting's tokens equal full depth's: yes, or how many rows do and the share of
    tokens before each row's first difference (`gpu_profile.agreement`; older records: no)."""
    if r["identical"]:
        return "yes"
    if "rows_equal" not in r:
        return "no"
    return f"no: {r['rows_equal']} of {r['rows']} rows, {r['shared']:.0%} of tokens before a difference"


def kernel_lines(record: dict) -> list[str]:
    return [
        f"| attention, Triton kernel ({r['shape']}, {r['context']} keys) | bf16 | {r['batch']} "
        f"| {r['kernel_us']:.1f} µs a call | {r['speedup']:.2f}x XLA's ({r['reference_us']:.1f} µs), "
        f"{r['kernel_gbs']:.0f} GB/s | max diff {r['max_abs_diff']:.1e} |"
        for r in record["rows"]
    ]


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="directories of the check's JSON results")
    args = parser.parse_args()
    lines = [
        "| setting | dtype | batch | decode tok/s | against | tokens equal full depth's |",
        "|---|---|---|---|---|---|",
    ]
    found = 0
    for path in sorted(p for d in args.dirs for p in d.glob("*.json")):
        record = json.loads(path.read_text())
        if path.name.startswith("full_depth"):
            lines += full_depth_lines(record)
        elif path.name.startswith("kernels_gpu"):
            lines += kernel_lines(record)
        elif "runs" in record:
            lines += engine_lines(record)
        else:
            continue
        found += 1
    if not found:
        parser.error(f"no full_depth*.json or gpu_profile results in {', '.join(map(str, args.dirs))}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
