"""docs/cli.md, generated from the `eejax` command's own parsers, so that the page lists every
command and flag that `--help` does (tests/test_docs.py fails when the page is stale).

    python -m eejax.cli.reference > docs/cli.md
"""

from __future__ import annotations

import argparse

PREAMBLE = """# The command line

This page is generated from the commands' parsers (`python -m eejax.cli.reference > docs/cli.md`;
a test fails when it is stale): `eejax COMMAND --help` prints the same. Also `python -m eejax.cli`.

What every command shares:

- Bad input prints one line, `eejax: error: ...`, and exits with status 2; nothing is left half
  written.
- List options accumulate when repeated (`--prompt A --prompt B C` is three prompts); any other
  option given twice is refused. A value that means "off" (`none`, `off`, `0` where the help says
  so) is accepted as off.
- Compiled programs are kept in JAX's persistent compilation cache (`$EEJAX_COMPILE_CACHE`,
  default `~/.cache/eejax/jax-compile`; `off` for none), so the next run on the machine reads
  them instead of compiling (`eejax serve --warmup 256` is ready ~3.5x sooner:
  [results](results/cpu-2026-11.md)).
- `generate`, `bench` and `serve` load the model as `--quantization auto` says: on a CPU a known
  GGUF model's own blocks with int16 activations (every lossless `--spec` gives its full depth's
  tokens on them); on a GPU, with a mesh and for a checkpoint directory the weights as stored.
  `--quantization none` is the dequantised float32 model. The training commands, `exit-vocab`
  and `calibrate` load float32 weights.
- The six sampling flags are `SamplingParams`' fields, with the same names in `generate`,
  `Engine`, `Engine.submit`, the HTTP request and `--warmup-for`; on `serve` they are the
  requests' default, which a request's own fields override. The penalties act on the logits
  before temperature, top-k and top-p, in every decoding mode; speculation stays lossless with
  them. SmolLM2's greedy text loops; `--repetition-penalty 1.3` is the usual cure.
"""


def option_line(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """One option as a list item: its flags and value, then its help."""
    invocation = formatter._format_action_invocation(action)
    if not action.option_strings and action.choices is None:
        invocation = action.metavar or action.dest
    text = " ".join((action.help or "").split())
    return f"- `{invocation}`: {text}" if text else f"- `{invocation}`"


def command_section(name: str, parser: argparse.ArgumentParser) -> str:
    """A command's section: what it does, its usage, and each option."""
    formatter = parser.formatter_class(prog=parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    usage = "\n".join("    " + line for line in formatter.format_help().strip("\n").splitlines())
    raw = parser.formatter_class is argparse.RawDescriptionHelpFormatter
    description = parser.description or ""
    if raw:
        first, _, rest = description.partition("\n\n")
        description = " ".join(first.split()) + (
            "\n\n" + "\n".join("    " + l for l in rest.splitlines()) if rest else ""
        )
    else:
        description = " ".join(description.split())
    actions = [
        a for a in parser._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]
    options = "\n".join(option_line(formatter, a) for a in actions)
    parts = [f"## eejax {name}", description, usage, options] if description else [f"## eejax {name}", usage, options]
    return "\n\n".join(parts)


def render(parser: argparse.ArgumentParser) -> str:
    """docs/cli.md for `parser` (`eejax.cli.build_parser()`): the preamble, then every command in
    the order `eejax --help` lists them."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sections = [command_section(name, p) for name, p in sub.choices.items()]
    return PREAMBLE + "\n" + "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    from eejax.cli import build_parser

    print(render(build_parser()), end="")
