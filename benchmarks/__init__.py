"""eejax's benchmarks (each a script: `python benchmarks/NAME.py --help`).

They time each layer layout's own programs: the split layout that "auto" picks on a CPU compiles
before its first step here, rather than in the background while stacked steps run
(`eejax.Model.compiles_split_later`; benchmarks/first_generate.py measures that mode)."""

import os

os.environ.setdefault("EEJAX_BACKGROUND_COMPILE", "off")
