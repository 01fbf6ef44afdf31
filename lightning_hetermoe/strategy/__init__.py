"""The Lightning strategy: argument checks, backend choice, one backend per parallelism
(single device, expert parallel, zebra/DistEP), the run's clock, expert state, launchers."""

from ..placement import Placement, contiguous_placement
from .arguments import MODES
from .hetermoe import HeterMoEStrategy

__all__ = ["HeterMoEStrategy", "MODES", "Placement", "contiguous_placement"]
