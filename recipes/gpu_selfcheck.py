"""Check the GPU rules of lightning-hetermoe on this machine: one table, exit 1 on any failure.

    python recipes/gpu_selfcheck.py                       # on a GPU
    python recipes/gpu_selfcheck.py --device cpu --quick  # what CI runs

The same as ``python -m lightning_hetermoe.selfcheck`` (see that module for the checks).
"""

import sys

from lightning_hetermoe.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
