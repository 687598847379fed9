"""How close the library's tiled loop runs to the core's multiply-add bound at several rows of x
(a verify pass's positions, a batch's rows): this core's peak rate of `vpdpbusd`, then the loop's
time over 65 MB of Q4_1 blocks at 1-8 rows of int16 and of int8 x, one thread, and the marginal
time of a row against its multiply-adds at the peak (int16 x: 16 per tile-block, int8: 8).
Compiles benchmarks/vnni_bound.cc, which includes eejax/kernels/cpu_quantized.cc, with the
library's flags; needs AVX-512 VNNI.

    python benchmarks/vnni_bound.py [--repeats 9]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import vnni_kernel_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(
        vnni_kernel_main("vnni_bound", __doc__, "--repeats", 9, "timed runs per row count, median kept (default 9)")
    )
