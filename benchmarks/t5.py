"""T5 v1.1-small-shaped encoder-decoder (random weights, fp32): eejax vs HF transformers.

No real T5 weights can be had on these machines, so the model is an HF T5ForConditionalGeneration
with the T5 v1.1 small shape (d_model 512, 8 + 8 layers, 6 heads of 64, gated-GELU d_ff 1024,
vocabulary 32128) and HF's random init, converted to eejax. Prompts: "summarize: " + the CNN/DM
articles, cut to --prompt-tokens tokens (the real T5 SentencePiece vocabulary). Both
implementations generate exactly --new-tokens greedy tokens per row (EOS ignored) at batch 1
(prompts one at a time), 8 and 32, measured in the same run. Also eejax with the paper's
"static-half" exit (every decoder token runs 4 of 8 layers, KV fill for the rest) against
eejax's own full depth. Writes benchmarks/out/t5.json.

    python benchmarks/t5.py [--batches 1 8 32] [--prompt-tokens 512] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import ROOT, fmt_ratio, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser

SMALL = dict(
    vocab_size=32128,
    d_model=512,
    d_kv=64,
    d_ff=1024,
    num_layers=8,
    num_decoder_layers=8,
    num_heads=6,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
    dropout_rate=0.0,
)


def build(workdir: Path):
    """(HF model, tokenizer, eejax model) of the v1.1-small shape with HF's random init."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

    from conversion import convert

    (workdir / "spm").mkdir()
    shutil.copy(ROOT / "data" / "t5_spiece.model", workdir / "spm" / "spiece.model")
    tokenizer = T5Tokenizer.from_pretrained(str(workdir / "spm"))
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(T5Config(**SMALL)).eval()
    hf.save_pretrained(workdir / "hf")
    tokenizer.save_pretrained(workdir / "hf")
    model = eejax.load(convert(workdir / "hf", workdir / "eejax", progress=False))
    return hf, tokenizer, model


def prompts_for(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    with (ROOT / "data" / "cnndm_test_dev100.jsonl").open() as f:
        articles = [json.loads(line)["article"] for _, line in zip(range(n), f)]
    eos = tokenizer.eos_token_id
    return [tokenizer("summarize: " + a)["input_ids"][: prompt_tokens - 1] + [eos] for a in articles]


def hf_tokens_per_s(hf, prompts, new_tokens: int, batch: int) -> float:
    """HF generate, greedy, right-padded batches of `batch`, exactly `new_tokens` per row."""
    import torch

    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    elapsed, produced = 0.0, 0
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0][:8]]), do_sample=False, max_new_tokens=2)  # warm-up
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):
                ids[j, : len(p)] = torch.tensor(p)
                mask[j, : len(p)] = 1
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, **kw)
            elapsed += time.perf_counter() - start
            produced += (out.shape[1] - 1) * len(chunk)
    return produced / elapsed


def eejax_run(model, prompts, new_tokens: int, batch: int, exit=None):  # noqa: A002
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, batch_size=batch, exit=exit)
    eejax.generate(model, prompts, **kw)  # compiles
    return eejax.generate(model, prompts, **kw).stats


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", action="extend", default=[1, 8, 32])
    parser.add_argument("--batch1-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        hf, tokenizer, model = build(Path(tmp))
        half = model.config.num_layers // 2
        rows = []
        for batch in args.batches:
            prompts = prompts_for(
                tokenizer, max(batch, args.batch1_prompts if batch == 1 else batch), args.prompt_tokens
            )
            full = eejax_run(model, prompts, args.new_tokens, batch)
            static = eejax_run(model, prompts, args.new_tokens, batch, exit=f"static:{half}")
            peer = hf_tokens_per_s(hf, prompts, args.new_tokens, batch)
            row = {
                "batch": batch,
                "prompts": len(prompts),
                "hf_tokens_per_s": peer,
                "eejax_tokens_per_s": full["tokens_per_s"],
                "ratio_vs_hf": full["tokens_per_s"] / peer,
                "static_half_tokens_per_s": static["tokens_per_s"],
                "static_half_vs_full": static["tokens_per_s"] / full["tokens_per_s"],
                "static_half_decode_vs_full": static["decode_tokens_per_s"] / full["decode_tokens_per_s"],
                "layers_per_token_full": full["mean_layers_per_token"],
                "layers_per_token_static_half": static["mean_layers_per_token"],
                "kv_fill_layers_per_token_static_half": static["kv_fill_layers_per_token"],
                "prefill_s_full": full["prefill_s"],
                "compiled_programs": model.programs.num_programs,
            }
            rows.append(row)
            print(
                f"batch {batch:2d}: HF {peer:6.1f} tok/s | eejax full {full['tokens_per_s']:6.1f} "
                f"({fmt_ratio(full['tokens_per_s'], peer)} HF) | static-half {static['tokens_per_s']:6.1f} "
                f"({fmt_ratio(static['tokens_per_s'], full['tokens_per_s'])} full; decode only "
                f"{row['static_half_decode_vs_full']:.2f}x) | layers/token {full['mean_layers_per_token']:.1f} -> "
                f"{static['mean_layers_per_token']:.1f}",
                flush=True,
            )
    path = write_result(
        "t5", {"shape": SMALL, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
