"""lightning-hetermoe: HeterMoE zebra parallelism as a PyTorch Lightning strategy.

Importing this package registers ``Trainer(strategy="hetermoe")`` (and ``"hetermoe_spawn"``).
Data flows cluster -> profile -> plan -> strategy -> callbacks; kernels sit under the MoE layer.
"""

from .callbacks import ExpertLoadMonitor, ExpertRebalancer, GradNormMonitor, RunSummary
from .ckpt import load_checkpoint
from .cluster import ClusterConfig, DeviceSpec, LinkConfig, get_device, register_device, resolve_cluster
from .configs import DataConfig, ModelConfig, MoEConfig, OptimConfig, from_cfg
from .convert import HFMoELanguageModel, from_hf, to_hetermoe, to_hf
from .emulate import apply_emulation
from .model import ByteCorpusDataModule, MoELanguageModel, MoETransformer, TokenizedDataModule, build_datamodule
from .moe import MoEAux, MoELayer, ModuleExperts, Router, RouterOutput, gate_losses
from .plan import Plan, make_plan
from .profile import CostModel, Profile
from .routing_record import RoutingRecord
from .measure import profile_cluster
from .simulate import simulate_plan
from .strategy import HeterMoEStrategy, register_strategies

register_strategies()

__all__ = [
    "ByteCorpusDataModule",
    "TokenizedDataModule",
    "build_datamodule",
    "ClusterConfig",
    "CostModel",
    "DataConfig",
    "DeviceSpec",
    "ExpertLoadMonitor",
    "ExpertRebalancer",
    "GradNormMonitor",
    "HFMoELanguageModel",
    "HeterMoEStrategy",
    "LinkConfig",
    "ModelConfig",
    "MoEConfig",
    "MoELanguageModel",
    "MoEAux",
    "MoELayer",
    "MoETransformer",
    "ModuleExperts",
    "OptimConfig",
    "Plan",
    "Profile",
    "Router",
    "RouterOutput",
    "RoutingRecord",
    "RunSummary",
    "apply_emulation",
    "from_cfg",
    "from_hf",
    "gate_losses",
    "get_device",
    "load_checkpoint",
    "make_plan",
    "profile_cluster",
    "register_device",
    "resolve_cluster",
    "simulate_plan",
    "to_hetermoe",
    "to_hf",
]
