"""The `eejax` command: `eejax convert`, `generate`, `bench`, `calibrate`, `exit-vocab`, `train-exits`,
`train-layerskip`, `train-draft`, `serve`, `models`; each command group lives in its own module here and adds
its parser with `add_parsers`."""

from __future__ import annotations

import argparse
import sys

from eejax.cli import bench, convert, draft, exits, generate, layerskip, serve, train
from eejax.cli.args import run_guarded
from eejax.cli.parsing import OneLineErrorParser
from eejax.compile_cache import enable_compile_cache

__all__ = ["build_parser", "main", "run_guarded"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="eejax",
        description="Fast early-exit language model inference in JAX.",
        epilog="Run `eejax COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineErrorParser)
    # in the order `eejax --help` lists them
    for module in (convert, generate, bench, exits, train, layerskip, draft, serve):
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compile_cache()  # a second run of a command loads its programs instead of compiling them
    return run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
