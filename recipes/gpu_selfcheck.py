"""Check the GPU rules of lightning-hetermoe on this machine: one table, exit 1 on any failure.

    python recipes/gpu_selfcheck.py                       # on a GPU
    python recipes/gpu_selfcheck.py --device cpu --quick  # what CI runs

The same as ``python -m lightning_hetermoe.selfcheck`` (see that module for the checks).
"""

from lightning_hetermoe.selfcheck import main
from lightning_hetermoe.process_exit import exit_now

if __name__ == "__main__":
    exit_now(main())  # the table is out: no finalization to wait for
