"""Saved state at any size: sharded checkpoints on torch.distributed.checkpoint in flat
pieces that reshard onto any layout, the offline tool that turns one into a single file
(``python -m lightning_hetermoe.ckpt consolidate``; a Hugging Face directory is
``python -m lightning_hetermoe.convert to-hf``'s), and the one call that loads either kind
in Python (:func:`load_checkpoint`)."""

from ..checkpoint_files import is_sharded_checkpoint
from .dcp import CheckpointFormatError, load, read_metadata, save
from .loading import load_checkpoint
from .pieces import Pieces

__all__ = ["CheckpointFormatError", "Pieces", "is_sharded_checkpoint", "load", "load_checkpoint", "read_metadata",
           "save"]
