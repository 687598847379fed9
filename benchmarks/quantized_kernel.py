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
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_kernel_benchmark  # noqa: E402


def main() -> int:
    return run_kernel_benchmark("quantized_kernel", [])


if __name__ == "__main__":
    sys.exit(main())
