#!/usr/bin/env bash
# Runs COMMAND where eejax can compile its programs for a GPU without one
# (`eejax.kernels.gpu_targets`): jax's CUDA plugin, of the installed jax's version, and jax-triton
# (the Triton kernels' lowering, given the target's compute capability) importable from
# .cache/gpu-compiler/jax-VERSION (installed there on first use: ~130 MB from the package index,
# no CUDA libraries), its check for CUDA libraries skipped, JAX on the CPU, and no persistent
# compilation cache (it would store executables of a compile-only device, which no process can load).
#
#   scripts/gpu_compiler.sh python benchmarks/gpu_kernels.py
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$(command -v python)}"
version="$("$python" -c 'import jax; print(jax.__version__)')"
dir="$root/.cache/gpu-compiler/jax-$version"
if [ ! -f "$dir/.installed-with-jax-triton" ]; then
  rm -rf "$dir"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$dir" \
    "jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version" "jax-triton==0.3.1" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  [ -d "$dir/jax_plugins" ] || { echo "gpu_compiler.sh: installing jax's CUDA plugin $version failed" >&2; exit 1; }
  touch "$dir/.installed-with-jax-triton"
fi
export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
export JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu JAX_ENABLE_COMPILATION_CACHE=false
exec "$@"
