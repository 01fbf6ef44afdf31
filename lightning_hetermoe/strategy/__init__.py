"""The Lightning strategy: argument checks, backend choice, one backend per parallelism
(single device, expert parallel, zebra/DistEP), the run's clock, expert state, launchers.

Its names load on first use, as the package's do: ``strategy.arguments`` (the config's
checks) imports neither Lightning nor torch."""

from ..lazy_names import lazy_names

_HOME = {"HeterMoEStrategy": ".hetermoe", "MODES": ".arguments", "Placement": "..placement",
         "contiguous_placement": "..placement"}
__all__ = list(_HOME)
__getattr__, __dir__ = lazy_names(__name__, _HOME)
