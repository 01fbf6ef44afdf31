"""``python -m lightning_hetermoe.selfcheck``."""

import sys

from .command import main

sys.exit(main())
