"""``python -m reducer``: see reducer.cli."""

import sys

from reducer.cli import main

sys.exit(main())
