"""Saved state at any size: sharded checkpoints on torch.distributed.checkpoint in flat
pieces that reshard onto any layout, and the offline tools that turn one into a single file
or a Hugging Face directory (``python -m lightning_hetermoe.ckpt``), and the one call that
loads either kind in Python (:func:`load_checkpoint`)."""

from .dcp import CheckpointFormatError, is_sharded_checkpoint, load, read_metadata, save
from .loading import load_checkpoint
from .pieces import Pieces

__all__ = ["CheckpointFormatError", "Pieces", "is_sharded_checkpoint", "load", "load_checkpoint", "read_metadata",
           "save"]
