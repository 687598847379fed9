"""What each row of x costs in the library's float32 few-row products (a verify pass scores d + 1
rows): a layer of SmolLM2-135M's five products over 30 layers and its LM head, the weights in
DRAM, two threads, at 1-8 rows, each against one row. Compiles benchmarks/matmul_rows.cc, which
includes eejax/kernels/cpu_matmul.cc, with the library's flags. To compare two versions of the
loops, run it in each checkout (`git worktree add /tmp/before HEAD~1`) one after the other.

    python benchmarks/matmul_rows.py [--repeats 6]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_kernel_benchmark  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="alternating runs of every row count, best kept")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return run_kernel_benchmark("matmul_rows", [str(args.repeats)], kernel="cpu_matmul.cc")


if __name__ == "__main__":
    sys.exit(main())
