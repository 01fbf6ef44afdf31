"""The Lightning strategy: process groups, expert placement, gradient sync, launchers."""

from ..placement import contiguous_placement
from .hetermoe import MODES, HeterMoEStrategy
from .registry import register_strategies

__all__ = ["HeterMoEStrategy", "MODES", "contiguous_placement", "register_strategies"]
