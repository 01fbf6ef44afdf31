"""``python -m lightning_hetermoe.selfcheck``."""

from ..process_exit import exit_now
from .command import main

# the table and the JSON are out: end without the interpreter's finalization (seconds)
exit_now(main())
