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

from benchmarks.common import run_kernel_benchmark  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.kernels import cpu_matmul  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds per row count (default 9)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not cpu_matmul.panel_products():
        print("tiled_products.py: this CPU has no AVX-512 VNNI, which the tiled loop needs", file=sys.stderr)
        return 1
    return run_kernel_benchmark("tiled_products", [str(args.rounds)])


if __name__ == "__main__":
    sys.exit(main())
