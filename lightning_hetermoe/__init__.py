"""lightning-hetermoe: HeterMoE zebra parallelism as a PyTorch Lightning strategy.

Importing this package registers ``Trainer(strategy="hetermoe")`` (and ``"hetermoe_spawn"``).
"""

from .cluster import ClusterConfig, LinkConfig
from .config import DataConfig, ModelConfig, MoEConfig, OptimConfig, from_cfg
from .model import ByteCorpusDataModule, MoELanguageModel, MoETransformer
from .moe import MoELayer
from .strategy import HeterMoEStrategy, register_strategies

register_strategies()

__all__ = [
    "ByteCorpusDataModule",
    "ClusterConfig",
    "DataConfig",
    "HeterMoEStrategy",
    "LinkConfig",
    "ModelConfig",
    "MoEConfig",
    "MoELanguageModel",
    "MoELayer",
    "MoETransformer",
    "OptimConfig",
    "from_cfg",
]
