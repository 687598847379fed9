"""`python -m eejax.cli` runs the `eejax` command."""

import sys

from eejax.cli import main

sys.exit(main())
