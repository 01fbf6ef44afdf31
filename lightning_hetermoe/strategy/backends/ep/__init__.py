"""Expert parallelism: DDP for the dense part, experts sliced over an EP group and reached
through all-to-all (``ep``; ``ep_balanced`` with speed-proportional batch shares)."""

from .backend import ExpertParallelBackend
from .groups import ExpertParallelGroups

__all__ = ["ExpertParallelBackend", "ExpertParallelGroups"]
