#!/usr/bin/env bash
# The GPU check in one command (issue 55), for a machine with an NVIDIA GPU that has the checkout,
# the SmolLM2 GGUF in $EEJAX_CACHE/downloads and, in $WHEELS (default .whl/), wheels of what its
# image lacks (the H100/H200 image of 2026-11: jax-triton, absl-py and gguf) and eejax's own
# wheel, which it installs first as `pip install eejax[gpu]` would (below). The steps run in order of
# what the issue needs most, within GPU_CHECK_SECONDS (default 540: a device lease is 15 minutes,
# its start included); each has its own limit too, and one that would start with too little time
# left is skipped and said so:
#   1. the models converted from the GGUF (once per cache);
#   2. the Triton kernel against XLA's attention on the device (`benchmarks/kernels.py`: time,
#      bandwidth and the largest difference, SmolLM2's shapes);
#   3. the draft head (smollm2-135m-eagle) at batch 1 in float32 and bfloat16 and at batch 8 in
#      bfloat16, each paired with full depth in the same run (`benchmarks/gpu_profile.py`);
#   4. full depth in bf16 with its layers unrolled, paired with stacked, at batch 1 and 8
#      (`benchmarks/full_depth.py`); the Triton layer (attention="triton", fused products) paired
#      with the default, bf16 and fp32; then with its matrices held as their rows ("rows": each
#      product one fused kernel, compiled for an H100 on a CPU, `benchmarks/gpu_kernels.py`);
#   5. full depth against HF at batch 1 in bf16 (eager, and its static cache compiled);
#   6. the GGUF's own blocks (issue 56: XLA's dequantise-and-dot) at batch 1 and 8, paired with
#      the float model's decode steps in bf16 (`benchmarks/full_depth.py --versus-float`);
#   7. early exit and E:d (smollm2-135m-layerskip) at batch 1 and 8, paired with full depth;
#   8. full depth against HF eager at batch 8/32/64;
#   9. the tests that need a GPU: every speculation mode token-checked against full depth
#      (tests/test_speculative.py, test_draft_head.py; the kernel's own tests run Triton's
#      interpreter, so step 2 is the kernel's check on the device), and quantized weights'
#      decoding token-checked (tests/test_quantized.py's model tests: the blocks against their
#      dequantised float model, lossless modes against the blocks' full depth, int16 prompts);
#   10. in the time left, the chat head (smollm2-135m-eagle-chat) on chat in float32 at batch 1,
#      `draft:4:lookup` and `auto` paired with full depth (`benchmarks/draft_head.py`: the drafting
#      issue's GPU target, >= 2.0x);
#   11. one table of it all (`benchmarks/gpu_table.py`), printed and written to OUT_DIR/gpu_check.md.
# A step that fails or runs out of time is said so in OUT_DIR/steps.log and the rest still run;
# OUT_DIR also keeps each step's log and JSON. GPU_CHECK_SKIP leaves steps out by name
# (convert kernel eagle chat split triton rows hf quantized layerskip batches tests), e.g. when a lease has run some already.
#
#   scripts/gpu_check.sh [OUT_DIR]          # default gpu_check/
#   EEJAX_GPU_CHECK_DRY=1 scripts/gpu_check.sh /tmp/dry   # a CPU: every step at toy sizes (to try it)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${1:-gpu_check}
WHEELS=${WHEELS:-.whl}
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-540}))
SKIP=" ${GPU_CHECK_SKIP:-} "
mkdir -p "$OUT_DIR/json"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
step() { echo "== gpu_check [$((SECONDS - start)) s] $*" | tee -a "$OUT_DIR/steps.log"; }
wanted() {  # wanted NAME: false (and said so) when GPU_CHECK_SKIP names it
  [[ $SKIP != *" $1 "* ]] || { step "skipped: $1 (GPU_CHECK_SKIP)"; return 1; }
}
run() {  # run LOG LIMIT_S COMMAND...: its output to OUT_DIR/LOG, within LIMIT_S x SLOW seconds
  local log=$1 limit=$(($2 * SLOW)) left=$((DEADLINE - SECONDS - 10))  # 10 s kept for the table
  shift 2
  ((left < 20)) && { step "$log: not run, ${left} s left of GPU_CHECK_SECONDS"; return 1; }
  ((limit > left)) && limit=$left
  timeout "$limit" "$@" >"$OUT_DIR/$log" 2>&1 && return 0
  local rc=$?
  if ((rc == 124)); then step "$log: out of time (${limit} s)"; else step "$log: failed (exit $rc)"; fi
  return 1
}

# The checkout as a package: its wheel in $WHEELS (built beside the others: `pip wheel --no-deps
# -w .whl .`) installed as a user would, `pip install eejax[gpu]`, its requirements resolved with
# no index against the image's own packages and the wheels: a requirement the image's jax fails
# stops here, and the install must not bring another jax. The steps then run the checkout (the
# same code). Without that wheel, or when the install fails (said so), the wheels are unpacked
# beside the checkout instead.
installed=0
eejax_wheel=$(compgen -G "$WHEELS/eejax-*.whl" | tail -n 1)
if [ -n "$eejax_wheel" ]; then
  dry=() && [ "${EEJAX_GPU_CHECK_DRY:-0}" = 1 ] && dry=(--dry-run)  # a CPU only resolves
  jax_before=$(python3 -c 'import jax; print(jax.__version__)')
  if python3 -m pip install -q --no-index --find-links "$WHEELS" "${dry[@]}" --report "$OUT_DIR/install.json" \
    "$eejax_wheel[gpu]" >"$OUT_DIR/install.log" 2>&1; then
    python3 - "$OUT_DIR/install.json" "$jax_before" <<'PY' | tee -a "$OUT_DIR/steps.log"
import json, sys
import jax
names = [i["metadata"]["name"] + " " + i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]]
other = [n for n in names if n.split()[0].lower() in ("jax", "jaxlib") or "cuda" in n.lower()]
print(f"pip install eejax[gpu] (jax {sys.argv[2]} before, {jax.__version__} after):", ", ".join(names) or "nothing")
print("  installs another jax:", ", ".join(other) if other else "no")
PY
    [ ${#dry[@]} = 0 ] && installed=1
  else
    echo "pip install eejax[gpu] failed (exit $?): $OUT_DIR/install.log" | tee -a "$OUT_DIR/steps.log"
    tail -n 5 "$OUT_DIR/install.log" | tee -a "$OUT_DIR/steps.log"
  fi
fi
if [ $installed = 1 ]; then  # the benchmarks put the checkout first on sys.path: the same code
  (cd /tmp && env -u PYTHONPATH python3 -c "import eejax; print('eejax installed at', eejax.__file__)") 2>&1 |
    tail -n 1 | tee -a "$OUT_DIR/steps.log"
elif compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eejax-gpu-site "$WHEELS"/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/eejax-gpu-site"
fi
if [ "${EEJAX_GPU_CHECK_DRY:-0}" = 1 ]; then  # toy sizes; the test step only collects
  TESTS=(--collect-only) FULL=(--new-tokens 4 --prompt-tokens 16) NEW=(--new-tokens 4 --prompt-tokens 32)
  CHAT=(--new-tokens 4 --prompt-tokens 32 --prompts 1)
  BATCHES=(1) LIMIT=1 SLOW=4  # a CPU compiles and runs slower: 4x the limits
  DEADLINE=$((DEADLINE + 3 * ${GPU_CHECK_SECONDS:-540}))
else
  TESTS=() FULL=(--new-tokens 128 --prompt-tokens 256) NEW=(--new-tokens 128 --prompt-tokens 256) BATCHES=(1 8) LIMIT=0 SLOW=1
  CHAT=(--new-tokens 64 --prompt-tokens 256 --prompts 8)  # the drafting issue's terms
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$OUT_DIR/steps.log"
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT_DIR/steps.log"
BENCH_OUT=benchmarks/out
rm -f $BENCH_OUT/full_depth_*.json $BENCH_OUT/gpu_modes_*.json $BENCH_OUT/kernels_gpu.json $BENCH_OUT/gpu_chat_head.*

if wanted convert; then
  step "converting the models (once per cache)"
  run convert.log 150 python3 -c "import eejax; eejax.load('smollm2-135m-eagle'); eejax.load('smollm2-135m-eagle-chat'); eejax.load('smollm2-135m-layerskip')"
fi

if wanted kernel && [ $LIMIT = 0 ]; then
  step "the Triton kernel against XLA's attention on the device"
  run kernels.log 60 python3 benchmarks/kernels.py --repeats 10 &&
    cp $BENCH_OUT/kernels_gpu.json "$OUT_DIR/json/"
fi

eagle() {  # eagle DTYPE BATCH
  step "draft head ($1) at batch $2"
  run "eagle_$1_b$2.log" 75 python3 benchmarks/gpu_profile.py --dtype "$1" --batch "$2" --parts engine \
    --specs draft:4 draft:4:lookup draft:4:tree --repeats 1 "${NEW[@]}" --name "gpu_modes_eagle_$1_b$2"
  cp $BENCH_OUT/gpu_modes_eagle_$1_b$2.json "$OUT_DIR/json/" 2>/dev/null
}
if wanted eagle; then
  eagle float32 1
  eagle bfloat16 1
  [ $LIMIT = 0 ] && eagle bfloat16 8
fi

# The layers unrolled (per-layer buffers): a step with no loop over layers, which XLA can capture
# as one command buffer where the stacked layout's scan launches one per layer (~47 us each on
# the H100, in lockstep with the device).
if wanted split; then
  step "full depth with its layers unrolled, paired with stacked"
  run full_depth_split.log 90 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers split --versus-stacked \
    --skip-hf "${FULL[@]}" --batches "${BATCHES[@]}" --repeats 3
  cp $BENCH_OUT/full_depth_split_bfloat16.json "$OUT_DIR/json/full_depth_split.json" 2>/dev/null
fi
# The Triton layer (attention="triton": kernels/triton_linear.py's fused launches, q/k/v with the rotation
# and the cache write, o, gate/up and down, the attention kernel, and the fused head) against XLA's layer,
# both with the layers unrolled (173 kernels a bf16 step at batch 1 against 650, compiled for an H100 on a
# CPU: docs/gpu.md), bf16 and fp32 at batch 1 and 8: whether "auto" may take it. Its tokens and bits are
# checked in the interpreter on CPU and on the device by the tests step (tests/test_triton_layer.py).
if wanted triton && [ $LIMIT = 0 ]; then
  for dtype in bfloat16 float32; do
    step "full depth ($dtype) with the Triton layer, paired with the default"
    run "full_depth_triton_$dtype.log" 90 python3 benchmarks/full_depth.py --dtype $dtype --layer-buffers split \
      --versus-triton --skip-hf \
      "${FULL[@]}" --batches "${BATCHES[@]}" --repeats 3
  done
fi
# The matrices as their rows: no product writes its multiply out before summing it (4 bytes a
# weight, ~430 MB a bf16 step on XLA's H100 and H200 cost models) and ~150 fewer kernels a batch-1 step.
if wanted rows; then
  step "full depth with its matrices as rows, paired with stacked"
  run full_depth_rows.log 90 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers rows --versus-stacked \
    --skip-hf "${FULL[@]}" --batches "${BATCHES[@]}" --repeats 3
  cp $BENCH_OUT/full_depth_rows_bfloat16.json "$OUT_DIR/json/full_depth_rows.json" 2>/dev/null
fi

HF=(--hf-device cuda --hf-dtype bfloat16)
[ $LIMIT = 1 ] && HF=(--hf-device cpu)
STATIC=(--hf-static)
[ $LIMIT = 1 ] && STATIC=()  # HF's static cache compiles for minutes on a CPU: not tried there
if wanted hf; then
  step "full depth against HF at batch 1"
  run full_depth_b1.log 120 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers stacked "${FULL[@]}" \
    "${HF[@]}" "${STATIC[@]}" --batches 1
  cp $BENCH_OUT/full_depth_stacked_bfloat16.json "$OUT_DIR/json/full_depth_b1.json" 2>/dev/null
fi

if wanted quantized; then
  step "the GGUF's own blocks, paired with bf16 weights"
  run quantized.log 90 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers stacked --quantization gguf \
    --versus-float --skip-hf "${FULL[@]}" --batches "${BATCHES[@]}" --repeats 3
  cp $BENCH_OUT/full_depth_stacked_bfloat16_gguf.json "$OUT_DIR/json/full_depth_gguf.json" 2>/dev/null
fi

if wanted layerskip; then
  for b in "${BATCHES[@]}"; do
    step "early exit and E:d at batch $b"
    run "layerskip_b$b.log" 60 python3 benchmarks/gpu_profile.py --model smollm2-135m-layerskip --dtype bfloat16 \
      --batch "$b" --parts engine --specs 15:2 --exits softmax:0.9 --repeats 1 "${NEW[@]}" --name "gpu_modes_layerskip_b$b"
    cp $BENCH_OUT/gpu_modes_layerskip_b$b.json "$OUT_DIR/json/" 2>/dev/null
  done
fi

if wanted batches && [ $LIMIT = 0 ]; then
  step "full depth against HF eager at batch 8/32/64"
  run full_depth.log 90 python3 benchmarks/full_depth.py --dtype bfloat16 --layer-buffers stacked "${FULL[@]}" \
    "${HF[@]}" --batches 8 32 64
  cp $BENCH_OUT/full_depth_stacked_bfloat16.json "$OUT_DIR/json/full_depth_b8_64.json" 2>/dev/null
fi

if wanted tests; then
  step "tests on the device"
  # test_triton_layer.py: the Triton layer compiled, its bits compared on the device (batch invariance,
  # bf16 speculation equal to full depth bit for bit)
  run tests.log 150 python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" tests/test_speculative.py tests/test_draft_head.py \
    tests/test_triton_layer.py
  echo "tests: $(tail -1 "$OUT_DIR/tests.log")" | tee -a "$OUT_DIR/steps.log"
  run tests_quantized.log 60 python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" tests/test_quantized.py \
    -k "dequantised_float_model or lossless_modes or kv_fill_run or prompt_activations"
  echo "quantized tests: $(tail -1 "$OUT_DIR/tests_quantized.log")" | tee -a "$OUT_DIR/steps.log"
fi

# Last, in the time left (the steps above come first): the drafting issue's GPU target, the chat
# head on chat questions (MT-bench's first turns, the chat set; never trained on) in float32 at
# batch 1, `draft:4:lookup` and `auto` (on a GPU the adaptive chain of up to 4 with 4 copies),
# each paired with full depth and its tokens checked. GPU_CHECK_SKIP="... tests" runs it sooner.
if wanted chat; then
  step "the chat head (float32) on chat at batch 1"
  run chat_head.log 120 python3 benchmarks/draft_head.py --model smollm2-135m-eagle-chat --batches 1 \
    --specs draft:4:lookup auto --sets mtbench chat --no-hf --repeats 1 "${CHAT[@]}" --name gpu_chat_head &&
    cp $BENCH_OUT/gpu_chat_head.md "$OUT_DIR/"
fi

step "the table"
python3 benchmarks/gpu_table.py "$OUT_DIR/json" | tee "$OUT_DIR/gpu_check.md"
if [ -f "$OUT_DIR/gpu_chat_head.md" ]; then  # the chat head's table (draft_head.py's columns)
  { echo; echo "The chat head on chat (float32, batch 1):"; echo; cat "$OUT_DIR/gpu_chat_head.md"; } | tee -a "$OUT_DIR/gpu_check.md"
fi
step "done (the logs: $OUT_DIR)"
