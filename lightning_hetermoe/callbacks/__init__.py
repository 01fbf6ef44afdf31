"""Callbacks: what a run measures about itself."""

from .run_summary import RunSummary

__all__ = ["RunSummary"]
