"""A bench setting as typed: "full" (full depth, the peer of every other setting; also "none" / "off"), "exit=SPEC"
(early exit, e.g. exit=softmax:0.9), or a speculation spec, bare or as "spec=SPEC"
("draft:4:lookup", "15:2", "auto"). Parsed before anything loads, so a typo fails at once."""

from __future__ import annotations

import dataclasses

from eejax.errors import EejaxError
from eejax.options import ExitConfig, SpecConfig, is_auto, is_off

FULL = "full"


@dataclasses.dataclass(frozen=True)
class Setting:
    """`name`: as typed; `exit` / `spec`: `generate`'s keywords (None: not asked). `lossless`:
    the setting claims full depth's greedy tokens (every speculation does; early exit does not)."""

    name: str
    exit: str | None = None
    spec: str | None = None

    @property
    def lossless(self) -> bool:
        return self.exit is None

    @property
    def is_full(self) -> bool:
        return self.exit is None and self.spec is None

    def generate_options(self) -> dict:
        """`eejax.generate`'s keywords for this setting."""
        return {"exit": self.exit, "spec": self.spec}


def parse_setting(text: str) -> Setting:
    """The `Setting` of `text` (see the module docstring); an EejaxError names a bad one."""
    name = text.strip()
    key, eq, value = name.partition("=")
    if not eq:
        key, value = "spec", name
    key, value = key.strip().lower(), value.strip()
    if key not in ("exit", "spec"):
        raise EejaxError(f"bench setting {text!r}: expected full, exit=SPEC, spec=SPEC or a speculation spec")
    if value.lower() == FULL or (key == "spec" and is_off(value)):  # exit=none: the exit loop at full depth
        return Setting(FULL)
    try:
        if key == "exit":
            ExitConfig.parse(value)
            return Setting(name, exit=value)
        if not is_auto(value):
            SpecConfig.parse(value)
        return Setting(name, spec=value)
    except EejaxError as e:
        raise EejaxError(f"bench setting {text!r}: {e}") from None
