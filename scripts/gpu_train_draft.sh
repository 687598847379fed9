#!/usr/bin/env bash
# The draft head of smollm2-135m-eagle at GPU scale: `eejax train-draft` on ~8x the data of the
# CPU recipe (every greedily continued prompt also continued by 12 sampled copies, 128 tokens
# each: ~8,900 sequences, ~4M cached tokens), training at 32 windows per step. Run it from the
# repository root on a machine with a CUDA jaxlib, where the model's GGUF already lies in
# $EEJAX_CACHE/downloads (nothing is fetched there: `eejax.load` converts it; the 98 MB GGUF
# reaches a device-tool machine in two calls, 64 MiB each at most, the tracked tree included),
# with the run directory as the argument; the same command resumes.
#
#     EEJAX_CACHE=/tmp/ee scripts/gpu_train_draft.sh /tmp/run [STEPS]
#
# Status (session 19, an H200 with JAX 0.11.2): the tiny-model train-draft test and the draft's
# lossless test pass there, the GGUF converts, but the full run did not finish in its 8 minutes:
# it was started with JAX_DEFAULT_MATMUL_PRECISION=highest, under which XLA compiled each program
# 4-5x slower (26.5 s against 6.4 s for the first two), and the continuations compile a program
# per prompt-length bucket. JAX's default float32 precision is kept here (TF32 products: the
# continuations and features differ from the CPU's float32 model near ties only; the draft
# trains on noisy features anyway). Time one small call first.
set -euo pipefail
out=${1:?usage: gpu_train_draft.sh OUTPUT_DIR [STEPS]}
steps=${2:-1000}
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m eejax.cli train-draft --model smollm2-135m \
    --prompts-file data/cnndm_test_dev100.jsonl --skip 20 --text-file data/wikitext2_valid_test.txt.gz \
    --output "$out" --continuation-tokens 128 --sampled-copies 12 --sampled-prompts all \
    --generate-batch-size 256 --feature-batch-size 64 --batch-size 32 --steps "$steps" --save-every 250
echo "train-draft: $(($(date +%s) - start)) s" | tee -a "$out/phases.txt"
