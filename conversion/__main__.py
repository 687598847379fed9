import sys

from conversion.cli import main

sys.exit(main())
