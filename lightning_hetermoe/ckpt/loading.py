"""One call for any checkpoint the strategy writes: a single file or a sharded directory.

:func:`load_checkpoint` reads either kind in this one process (no process group, no GPU): a
sharded directory is put together in memory the way ``python -m lightning_hetermoe.ckpt
consolidate`` writes it (:func:`~.consolidate.whole_checkpoint`), so what comes back is
what Lightning's single file holds. Given a LightningModule class it returns the module,
built from the checkpoint's hyper-parameters with its weights loaded, exactly as
``Class.load_from_checkpoint(file)`` does (that is the call it makes).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from ..checkpoint_files import NOT_TORCH_SAVE, is_sharded_checkpoint, is_torch_save_file
from ..staging import unfinished_note
from . import dcp
from .consolidate import read_meta, whole_checkpoint


def load_checkpoint(path: str | os.PathLike, model_class: type | None = None, map_location: Any = None,
                    strict: bool | None = None, **kwargs: Any) -> Any:
    """The checkpoint at ``path`` (a file or a sharded directory): its dict, or with
    ``model_class`` (a LightningModule class) the module it holds; ``map_location``,
    ``strict`` and ``kwargs`` (hyper-parameters to override) as in Lightning's
    ``load_from_checkpoint``. Needs the whole model in this process."""
    path = Path(path)
    if not path.exists():
        raise dcp.CheckpointFormatError(f"load_checkpoint path={str(path)!r}: no such file or directory"
                                        f"{unfinished_note(path)}")
    sharded = is_sharded_checkpoint(path)
    if path.is_dir() and not sharded:
        raise dcp.CheckpointFormatError(f"load_checkpoint path={str(path)!r} is a directory but not a sharded "
                                        f"checkpoint (no .metadata in it): pass a checkpoint file or the directory "
                                        f"HeterMoEStrategy saved")
    if model_class is None:
        return whole_checkpoint(path) if sharded else read_checkpoint_file(path, map_location=map_location or "cpu")
    source: Any = path
    if not sharded:  # a glance (memory-mapped: nothing read yet) that it is a checkpoint at all
        glance = read_checkpoint_file(path, map_location="cpu", mmap=True)
        if not isinstance(glance, dict) or not isinstance(glance.get("state_dict"), dict):
            raise dcp.CheckpointFormatError(f"load_checkpoint path={str(path)!r} is not a Lightning checkpoint (it "
                                            f"holds no state_dict)")
        del glance
    if sharded:  # Lightning reads a file or a file-like object: the whole checkpoint, serialised in memory
        source = io.BytesIO()
        torch.save(whole_checkpoint(path), source)
        source.seek(0)
    try:
        return model_class.load_from_checkpoint(source, map_location=map_location, strict=strict, **kwargs)
    except (RuntimeError, TypeError, KeyError) as err:
        # another model's checkpoint: missing or unexpected keys, other shapes, other hyper-parameters
        why = " ".join(str(err).split()) or type(err).__name__
        raise dcp.CheckpointFormatError(f"load_checkpoint path={str(path)!r} does not hold a {model_class.__name__} "
                                        f"(model_class): {why[:500]}") from None


def checkpoint_state(path: str | os.PathLike, argument: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint at ``path`` (a file or a sharded directory) as Lightning's dict,
    without reading its tensors: a sharded directory's ``meta.pt`` (its loops, callbacks and
    hyper-parameters), a file memory-mapped (its tensors stay on disk until touched). For
    what a run needs to know of a checkpoint before the strategy lays the model out."""
    if is_sharded_checkpoint(path):
        return read_meta(path)
    return read_checkpoint_file(path, argument, map_location="cpu", mmap=True)


def read_checkpoint_file(path: str | os.PathLike, argument: str = "load_checkpoint path", **kwargs: Any) -> Any:
    """``torch.load`` of a checkpoint file; a file that is none (a JSON, a truncated save)
    is a :class:`~.dcp.CheckpointFormatError` naming the ``argument`` that gave the path,
    whatever torch says (memory-mapped, torch names only the format it wanted: a file that
    is no zip archive, as every ``torch.save`` since torch 1.6 writes, is said to be so)."""
    if kwargs.get("mmap") and not is_torch_save_file(path):
        raise dcp.CheckpointFormatError(f"{argument}={str(path)!r} is not a checkpoint: {NOT_TORCH_SAVE}")
    try:
        return torch.load(path, weights_only=False, **kwargs)
    except Exception as err:
        raise dcp.CheckpointFormatError(f"{argument}={str(path)!r} is not a checkpoint torch can "
                                        f"read: {' '.join(str(err).split())[:300]}") from None


def check_same_model(saved: dict[str, Any], model: dict[str, Any], strict: bool, what: str) -> None:
    """The checkpoint's tensors (``saved``: name -> whole shape) are the model's (``model``),
    before anything is read into it: one sentence naming ``what`` (the argument that gave the
    checkpoint) and the first mismatches. ``strict=False`` (the module's ``strict_loading``)
    lets names be missing on either side, never shapes differ."""
    def listed(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = []
    if strict:
        lacks = sorted(set(model) - set(saved))
        extra = sorted(set(saved) - set(model))
        if lacks:
            problems.append(f"it lacks {len(lacks)} tensor(s) the model has ({listed(lacks)})")
        if extra:
            problems.append(f"it holds {len(extra)} the model has not ({listed(extra)})")
    differ = [f"{n}: saved {list(saved[n])}, model {list(model[n])}" for n in sorted(set(saved) & set(model))
              if tuple(saved[n]) != tuple(model[n])]
    if differ:
        problems.append(f"{len(differ)} differ in shape ({listed(differ)})")
    if problems:
        raise dcp.CheckpointFormatError(f"{what} is a checkpoint of another model: " + "; ".join(problems))
