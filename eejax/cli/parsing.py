"""argparse for eejax's commands: one-line usage errors, repeated list options that accumulate,
and repeated single-valued options that are refused (nothing a user typed is silently dropped)."""

from __future__ import annotations

import argparse
import sys


class ExtendAction(argparse.Action):
    """A list option (nargs "+" or "*") that may be given several times: the values accumulate
    (`--prompt A --prompt B C` is [A, B, C]); the default applies only when it is never given."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        current = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, current + list(values))


class StoreOnceAction(argparse._StoreAction):
    """The default action (one value): a second occurrence is a usage error naming the option,
    instead of silently replacing the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = parser.__dict__.setdefault("_given_options", set())
        if option_string is not None and self.dest in given:
            parser.error(f"{'/'.join(self.option_strings)} given twice; give it once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class RenamedOption(StoreOnceAction):
    """An option's old name: it still works, with a line on stderr naming the new one (which
    shares its dest, so giving both is refused as giving one twice)."""

    def __init__(self, *args, new_name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.new_name = new_name

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new_name}", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line (`eejax generate: error: ...`) and exit status 2. Options given
    twice are refused (`StoreOnceAction`, the default action) unless declared `action="extend"`
    (`ExtendAction`: list options accumulate)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnceAction)
        self.register("action", "store", StoreOnceAction)
        self.register("action", "extend", ExtendAction)

    def parse_known_args(self, args=None, namespace=None):
        self._given_options = set()
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
