"""``python -m reducer``: see reducer.tools.cli."""

import sys

from reducer.tools.cli import main

sys.exit(main())
