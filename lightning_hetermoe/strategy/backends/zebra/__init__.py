"""Zebra and DistEP: the plan applied to processes, micro-batch fibers, the bipartite exchange."""

from .backend import ZebraBackend

__all__ = ["ZebraBackend"]
