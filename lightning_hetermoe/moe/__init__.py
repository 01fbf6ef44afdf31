"""MoE building blocks. Model code: nothing here knows about process groups."""

from .capacity import apply_capacity, expert_capacity
from .dispatch import LocalDispatcher
from ..kernels import grouped_mlp_torch, resolve_backend
from .experts import Experts
from .layer import MoEAux, MoELayer, gate_losses
from .module_experts import ExpertContractError, ModuleExperts
from .routers import (
    GShardRouter,
    NoisyTopKRouter,
    Router,
    RouterOutput,
    SwitchRouter,
    TopKRouter,
    build_router,
    load_balancing_loss,
    router_z_loss,
)

__all__ = [
    "ExpertContractError",
    "Experts",
    "GShardRouter",
    "LocalDispatcher",
    "MoEAux",
    "MoELayer",
    "ModuleExperts",
    "NoisyTopKRouter",
    "Router",
    "RouterOutput",
    "SwitchRouter",
    "TopKRouter",
    "apply_capacity",
    "build_router",
    "expert_capacity",
    "gate_losses",
    "grouped_mlp_torch",
    "load_balancing_loss",
    "resolve_backend",
    "router_z_loss",
]
