"""Data-centric expert training (HEXA-MoE): experts sharded over every rank by memory,
gathered to the tokens per layer, gradients reduce-scattered."""

from .backend import DataCentricBackend
from .shards import Shard, shard_ranges

__all__ = ["DataCentricBackend", "Shard", "shard_ranges"]
