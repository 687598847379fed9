"""int16 products by 4-bit weights in 16-row tiles, measured before they are built into the library
(benchmarks/tiled_products.cc says how they work): one loop for every number of rows of x, with
the bits of the library's prefill GEMM, timed against the library's own loops on the same weights
(SmolLM2-135M's 30 layers of Q4_1 matrices, 65 MB, each matrix its own memory) in paired rounds,
the order alternating, on one and two threads; where the CPU has AMX and Linux grants it, the same
sums by AMX tiles too. Prints the bits checked, then median times and ratios. Compiles the .cc,
which includes eejax/kernels/cpu_quantized.cc, with the library's flags; needs AVX-512 VNNI.

    python benchmarks/tiled_products.py [--rounds 9]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import vnni_kernel_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(vnni_kernel_main("tiled_products", __doc__, "--rounds", 9, "paired rounds per row count (default 9)"))
