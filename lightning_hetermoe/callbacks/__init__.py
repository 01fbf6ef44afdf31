"""Callbacks: what a run measures about itself, and what it does about it."""

from .gradient_norm import GradNormMonitor
from .load_monitor import ExpertLoadMonitor
from .rebalancer import ExpertRebalancer
from .run_summary import RunSummary

__all__ = ["ExpertLoadMonitor", "ExpertRebalancer", "GradNormMonitor", "RunSummary"]
