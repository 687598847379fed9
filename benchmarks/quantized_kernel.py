"""The quantized kernel's products of one SmolLM2-135M decode step, timed alone on one thread and on
two (each half of every matrix's rows, no barriers: the most two cores can do): 30
layers of Q4_1 matrices and the Q8_0 head (97 MB, each matrix its own memory), for 1, 2, 5, 8 and
16 rows of x (a decode step, a `draft:4` verify pass, a batch; float32 for 1 and 5), with float32,
int16 and int8 activations, looped as the library loops them. No XLA and no thread pool: what the
loops cost per block of 32 weights and row of x, against which a decode step's products (two
threads, `decode_profile.py`) and the read bound (bytes / bandwidth) compare. Last, int16's floor
on this core: its multiply-adds alone, on registers. Compiles benchmarks/quantized_kernel.cc,
which includes eejax/kernels/cpu_quantized.cc itself, with the library's flags.

    python benchmarks/quantized_kernel.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from eejax.kernels import cpu_matmul  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> int:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print("quantized_kernel.py: no C++ compiler (set $CXX, or install g++)", file=sys.stderr)
        return 1
    source = cpu_matmul.SOURCE.with_name("cpu_quantized.cc")
    flags = [f for f in cpu_matmul._flags() if f not in ("-shared", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "quantized_kernel"
        command = [compiler, *flags, "-I", jax.ffi.include_dir(), f'-DKERNEL_SOURCE="{source}"']
        subprocess.run([*command, str(HERE / "quantized_kernel.cc"), "-o", str(binary)], check=True)
        return subprocess.run([str(binary)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
