"""Saved state at any size: sharded checkpoints on torch.distributed.checkpoint in flat
pieces that reshard onto any layout, and the offline tools that turn one into a single file
or a Hugging Face directory (``python -m lightning_hetermoe.ckpt``)."""

from .dcp import CheckpointFormatError, is_sharded_checkpoint, load, read_metadata, save
from .pieces import Pieces

__all__ = ["CheckpointFormatError", "Pieces", "is_sharded_checkpoint", "load", "read_metadata", "save"]
