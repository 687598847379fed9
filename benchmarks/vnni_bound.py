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

from benchmarks.common import run_kernel_benchmark  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.kernels import cpu_matmul  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per row count, median kept (default 9)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if not cpu_matmul.panel_products():
        print("vnni_bound.py: this CPU has no AVX-512 VNNI, which the tiled loop needs", file=sys.stderr)
        return 1
    return run_kernel_benchmark("vnni_bound", [str(args.repeats)])


if __name__ == "__main__":
    sys.exit(main())
