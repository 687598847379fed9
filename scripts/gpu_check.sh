#!/usr/bin/env bash
# The GPU check in one command (issue 55), for a machine with an NVIDIA GPU that has the checkout,
# the SmolLM2 GGUF in $EEJAX_CACHE/downloads and, in $WHEELS (default .whl/), wheels of what its
# image lacks (an H100 image of 2026-11: jax-triton and gguf). Each step has a time limit (14.5 min
# in all at most; ~8 expected on an H100 from the steps' times there, not yet run as one):
#   1. the tests that need a GPU: the Triton kernel against the reference on the device, and
#      every speculation mode token-checked against full depth (tests/test_triton_attention.py,
#      test_speculative.py, test_draft_head.py);
#   2. full depth against HF at batch 1/8/32/64 in bf16 (HF eager; its static cache, compiled, at
#      batch 1), `benchmarks/full_depth.py`, and its layers unrolled against stacked at batch 1 and 8;
#   3. early exit and E:d (smollm2-135m-layerskip) and the draft head (smollm2-135m-eagle) at
#      batch 1 and 8, each paired with full depth in the same run, `benchmarks/gpu_profile.py`;
#   4. one table of it all (`benchmarks/gpu_table.py`), printed and written to OUT_DIR/gpu_check.md.
# A step that fails or runs out of time is said so in OUT_DIR/steps.log and the rest still run;
# OUT_DIR also keeps each step's log and JSON.
#
#   scripts/gpu_check.sh [OUT_DIR]          # default gpu_check/
#   EEJAX_GPU_CHECK_DRY=1 scripts/gpu_check.sh /tmp/dry   # a CPU: every step at toy sizes (to try it)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${1:-gpu_check}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT_DIR/json"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
step() { echo "== gpu_check [$((SECONDS - start)) s] $*" | tee -a "$OUT_DIR/steps.log"; }
run() {  # run LOG LIMIT_S COMMAND...: its output to OUT_DIR/LOG, within LIMIT_S x SLOW seconds
  local log=$1 limit=$2
  shift 2
  timeout $((limit * SLOW)) "$@" >"$OUT_DIR/$log" 2>&1 || step "$log: exit $? (124: out of time)"
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eejax-gpu-site "$WHEELS"/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/eejax-gpu-site"
fi
if [ "${EEJAX_GPU_CHECK_DRY:-0}" = 1 ]; then  # toy sizes; the test step only collects
  TESTS=(--collect-only) FULL=(--new-tokens 4 --prompt-tokens 16) NEW=(--new-tokens 4 --prompt-tokens 32)
  BATCHES=(1) LIMIT=1 SLOW=4  # a CPU compiles and runs slower: 4x the limits
else
  TESTS=() FULL=(--new-tokens 128 --prompt-tokens 256) NEW=(--new-tokens 128 --prompt-tokens 256) BATCHES=(1 8) LIMIT=0 SLOW=1
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$OUT_DIR/steps.log"
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT_DIR/steps.log"

step "converting the models (once per cache)"
run convert.log 120 python3 -c "import eejax; eejax.load('smollm2-135m-eagle'); eejax.load('smollm2-135m-layerskip')"

step "tests on the device"
run tests.log 150 python3 -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" tests/test_triton_attention.py \
  tests/test_speculative.py tests/test_draft_head.py
echo "tests: $(tail -1 "$OUT_DIR/tests.log")" | tee -a "$OUT_DIR/steps.log"

step "full depth against HF"
BENCH_OUT=benchmarks/out
rm -f $BENCH_OUT/full_depth_*.json $BENCH_OUT/gpu_modes_*.json
HF=(--hf-device cuda --hf-dtype bfloat16)
[ $LIMIT = 1 ] && HF=(--hf-device cpu)
STATIC=(--hf-static)
[ $LIMIT = 1 ] && STATIC=()  # HF's static cache compiles for minutes on a CPU: not tried there
run full_depth_b1.log 120 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers stacked "${FULL[@]}" \
  "${HF[@]}" "${STATIC[@]}" --batches 1
cp $BENCH_OUT/full_depth_*.json "$OUT_DIR/json/full_depth_b1.json" 2>/dev/null
if [ $LIMIT = 0 ]; then
  run full_depth.log 90 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers stacked "${FULL[@]}" \
    "${HF[@]}" --batches 8 32 64
  cp $BENCH_OUT/full_depth_stacked_bfloat16.json "$OUT_DIR/json/full_depth_b8_64.json" 2>/dev/null
fi
# The layers unrolled (per-layer buffers): a step with no loop over layers, which XLA can capture
# as one command buffer where the stacked layout's scan launches one per layer (~47 us each on
# the H100, in lockstep with the device).
step "full depth with its layers unrolled, paired with stacked"
run full_depth_split.log 90 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers split --versus-stacked \
  --skip-hf "${FULL[@]}" --batches "${BATCHES[@]}" --repeats 3
cp $BENCH_OUT/full_depth_split_bfloat16.json "$OUT_DIR/json/full_depth_split.json" 2>/dev/null

for b in "${BATCHES[@]}"; do
  step "early exit and E:d at batch $b"
  run "layerskip_b$b.log" 60 python3 benchmarks/gpu_profile.py --model smollm2-135m-layerskip --dtype bfloat16 \
    --batch "$b" --parts engine --specs 15:2 --exits softmax:0.9 --repeats 1 "${NEW[@]}" --name "gpu_modes_layerskip_b$b"
  for dtype in bfloat16 float32; do
    [ "$dtype" = float32 ] && [ "$b" != 1 ] && continue
    step "draft head ($dtype) at batch $b"
    run "eagle_${dtype}_b$b.log" 60 python3 benchmarks/gpu_profile.py --dtype $dtype --batch "$b" --parts engine \
      --specs draft:4 draft:4:lookup draft:4:tree --repeats 1 "${NEW[@]}" --name "gpu_modes_eagle_${dtype}_b$b"
  done
done
cp $BENCH_OUT/gpu_modes_*.json "$OUT_DIR/json/" 2>/dev/null

step "the table"
python3 benchmarks/gpu_table.py "$OUT_DIR/json" | tee "$OUT_DIR/gpu_check.md"
step "done (the logs: $OUT_DIR)"
