"""What devices exist: per-rank device specs from a cluster config or from detection."""

from .config import ClusterConfig, LinkConfig

__all__ = ["ClusterConfig", "LinkConfig"]
