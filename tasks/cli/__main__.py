"""`python -m tasks.cli ...`: the same as `specdec ...`."""

import sys

from . import main

sys.exit(main())
