"""Markdown tables of `eejax bench --json` files, for docs/results/:

python -m eejax.bench.report RUN.json [RUN.json ...] >> docs/results/PAGE.md
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

COLUMNS = (
    ("setting", "setting", "{}"),
    ("batch", "batch", "{}"),
    ("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
    ("decode_ratio", "x full", "{:.2f}x"),
    ("tokens_per_s", "end to end tok/s", "{:.1f}"),
    ("end_to_end_ratio", "x full", "{:.2f}x"),
    ("tokens_per_round", "tokens a round", "{:.2f}"),
    ("layers_per_token", "layers a token", "{:.1f}"),
    ("tokens_equal_full", "= full depth", "{}"),
    ("agreement", "agreement", "{:.1%}"),
    ("rouge_l", "ROUGE-L", "{:.3f}"),
    ("peer_decode_ratio", "decode x peer", "{:.2f}x"),
    ("peer_end_to_end_ratio", "end to end x peer", "{:.2f}x"),
)


def cell(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return spec.format(value)


def markdown(doc: dict) -> str:
    """One bench run as a heading line (what ran, where, when) and a table (columns with no
    value in any row left out)."""
    env, run = doc["environment"], doc["run"]
    model = env["model"]
    weights = "weights " + ", ".join(model["weights"])
    for key in ("activations", "prompt_activations"):
        if model.get(key):
            weights += f", {key.replace('_', ' ')} {', '.join(model[key])}"
    cpu = env["cpu"]
    device = (
        env["device"]["kind"] if env["device"]["platform"] != "cpu" else f"{cpu['processor']}, {cpu['cores']} cores"
    )
    head = (
        f"`{model['name']}` ({weights}), {run['data']}: {run['prompts']} prompts, {run['new_tokens']} new tokens; "
        f"{device}, jax {env['versions']['jax']}, {env['date'][:10]}"
        + (f", peer {run['peer']}" if run.get("peer") else "")
    )
    rows = doc["rows"]
    shown = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    lines = [head, "", "| " + " | ".join(c[1] for c in shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(r.get(key), spec) for key, _, spec in shown) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(markdown(json.loads(Path(p).read_text())) for p in sys.argv[1:]))
