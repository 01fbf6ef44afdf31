"""Who does what: roles, ZP groups, micro-batches and expert placement (incl. Asym-EA)."""

from .asym_ea import AsymEAInput, AsymEAResult, assign_experts, forward_makespan, placement_from_counts
from .cluster_view import ClusterView, as_cluster
from .plan import ROLES, Plan, ZPGroup
from .planner import largest_batch, make_plan, predict

__all__ = [
    "Plan",
    "ZPGroup",
    "ROLES",
    "make_plan",
    "largest_batch",
    "predict",
    "as_cluster",
    "ClusterView",
    "AsymEAInput",
    "AsymEAResult",
    "assign_experts",
    "forward_makespan",
    "placement_from_counts",
]
