"""What a checkpoint path holds, told without torch: the main job checks its resume path
before torch loads, and the checkpoint tools before they read one."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

# what a file that is no checkpoint lacks: every torch.save since torch 1.6 writes a zip archive
NOT_TORCH_SAVE = "not the zip archive torch.save writes"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A directory torch.distributed.checkpoint wrote (its ``.metadata`` in it)."""
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file()


def is_torch_save_file(path: str | os.PathLike) -> bool:
    return zipfile.is_zipfile(path)
