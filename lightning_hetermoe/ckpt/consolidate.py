"""Offline: a sharded checkpoint as whole tensors, one batch at a time.

:func:`iter_tensors` reads a sharded checkpoint directory (written by ``HeterMoEStrategy``
with ``checkpoint_format="sharded"``) in one process, without a process group, and yields
every tensor whole, in its real shape, holding at most ``batch_bytes`` of them at once.
:func:`consolidate` writes Lightning's single-file checkpoint from it (what
``checkpoint_format="full"`` would have written: the state dict, each optimizer's
``state_dict()`` in Lightning's positional form, and the loop state), which needs the whole
model in this one process; :mod:`.export` streams it into a Hugging Face directory instead.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from ..checkpoint_files import is_sharded_checkpoint
from ..staging import StagedFile, staged
from . import dcp

META_FILE = "meta.pt"
DEFAULT_BATCH_BYTES = 1 << 30
PROGRESS_EVERY_S = 5.0  # the offline commands' line this often while a large checkpoint is read


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not is_sharded_checkpoint(path) or not (path / META_FILE).is_file():
        raise dcp.CheckpointFormatError(f"{path} is not a sharded checkpoint directory (expected .metadata and "
                                        f"{META_FILE} in it)")
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    if "hetermoe" not in meta:
        raise dcp.CheckpointFormatError(f"{path}: {META_FILE} has no 'hetermoe' entry; it was not written by "
                                        f"lightning-hetermoe")
    missing = dcp.missing_files(path)
    if missing:  # before any tensor is read: the whole checkpoint or none of it
        raise dcp.CheckpointFormatError(
            f"{path} is incomplete: its .metadata names {len(missing)} piece file(s) that are not in it "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): every rank writes its part into the "
            "checkpoint's directory, so a rank that wrote elsewhere (a disk of its node's own) or a copy that left "
            "files behind loses them; copy the checkpoint whole, or save it again on a file system every node sees")
    return meta


class ReadProgress:
    """Says, at most every ``every_s`` seconds, how much of a checkpoint's tensors a long
    offline command (a consolidation, an export) has read: a model's checkpoint of hundreds
    of GB takes minutes, silent until it ended."""

    def __init__(self, what: str, total_bytes: int, every_s: float = 5.0, say: Callable[[str], None] | None = None
                 ) -> None:
        self.what, self.total, self.every_s = what, max(total_bytes, 1), every_s
        self.say = say or (lambda text: print(text, flush=True))
        self.done = 0
        self.started = self.last = time.perf_counter()

    def counted(self, items: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """``items`` as they come, each tensor's bytes counted once it is read."""
        for name, t in items:
            self.done += t.numel() * t.element_size()
            now = time.perf_counter()
            if now - self.last >= self.every_s:
                self.last = now
                self.say(f"[hetermoe] {self.what}: {self.done / 1e9:,.2f} of {self.total / 1e9:,.2f} GB read "
                         f"({self.done / self.total:.0%}), {now - self.started:.0f} s")
            yield name, t


def saved_bytes(path: str | os.PathLike, prefix: str = "") -> int:
    """The bytes of the tensors a sharded checkpoint saved under keys starting with ``prefix``."""
    saved = dcp.read_metadata(path).state_dict_metadata
    return sum(math.prod(md.size) * md.properties.dtype.itemsize for k, md in saved.items()
               if k.startswith(prefix) and hasattr(md, "size"))


def iter_tensors(path: str | os.PathLike, prefix: str = "", batch_bytes: int = DEFAULT_BATCH_BYTES
                 ) -> Iterator[tuple[str, Tensor]]:
    """``(key, whole tensor)`` for every saved tensor whose key starts with ``prefix``, flat
    tensors in their saved flat form (the caller knows the shapes: ``meta.pt``)."""
    saved = dcp.read_metadata(path).state_dict_metadata
    keys = [k for k, md in saved.items() if k.startswith(prefix) and hasattr(md, "size")]
    batch: dict[str, Tensor] = {}
    held = 0
    for key in keys:
        md = saved[key]
        t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        batch[key] = t
        held += t.numel() * t.element_size()
        if held >= batch_bytes:
            yield from _read(batch, path)
            batch, held = {}, 0
    if batch:
        yield from _read(batch, path)


def _read(batch: dict[str, Tensor], path: str | os.PathLike) -> Iterator[tuple[str, Tensor]]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(batch, path, local=True)  # one process, whatever else runs
    yield from batch.items()


def whole(flat: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A saved tensor in its real shape (module and per-element optimizer tensors are stored flat)."""
    if tuple(flat.shape) == tuple(shape):
        return flat
    if flat.numel() != math.prod(shape):
        raise dcp.CheckpointFormatError(f"a saved tensor of {flat.numel()} elements cannot have shape {list(shape)}")
    return flat.view(shape)


def state_dict_of(path: str | os.PathLike, meta: dict[str, Any] | None = None,
                  batch_bytes: int = DEFAULT_BATCH_BYTES, of: str = "state_dict") -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the LightningModule's state dict, whole; ``of="current_model_state"``:
    the trained weights a checkpoint saved with Lightning's weight averaging keeps beside the
    average (its ``state_dict``)."""
    meta = meta or read_meta(path)
    shapes = meta["hetermoe"]["shapes"]
    for key, flat in iter_tensors(path, f"{of}.", batch_bytes):
        name = key[len(of) + 1:]
        yield name, whole(flat, shapes[name])


def consolidate(path: str | os.PathLike, out: str | os.PathLike, batch_bytes: int = DEFAULT_BATCH_BYTES,
                progress_every_s: float | None = None, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the sharded checkpoint ``path`` as one Lightning checkpoint file ``out``; returns it.
    ``out`` appears whole or not at all (:mod:`~lightning_hetermoe.staging`): a file already
    there stays as it was if this fails or is stopped. ``progress_every_s``: say how much is
    read that often (``say``: print), and when the file is being written."""
    with staged(StagedFile, out) as tmp:
        meta = read_meta(path)  # a directory that is no checkpoint is said as such, before its size is asked
        progress = None
        if progress_every_s is not None:
            progress = ReadProgress("consolidate", saved_bytes(path), progress_every_s, say)
        checkpoint = whole_checkpoint(path, batch_bytes, progress, meta)
        if progress is not None:
            progress.say(f"[hetermoe] consolidate: read in {time.perf_counter() - progress.started:.0f} s; "
                         f"writing {out}")
        torch.save(checkpoint, tmp)
    return checkpoint


def whole_checkpoint(path: str | os.PathLike, batch_bytes: int = DEFAULT_BATCH_BYTES,
                     progress: ReadProgress | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sharded checkpoint ``path`` as the dict a single checkpoint file holds (in memory);
    ``meta``: its :func:`read_meta`, where the caller has read it already."""
    meta = meta or read_meta(path)
    info = meta["hetermoe"]
    shapes = info["shapes"]
    counted = progress.counted if progress is not None else (lambda items: items)
    checkpoint = {k: v for k, v in meta.items() if k != "hetermoe"}
    checkpoint["state_dict"] = dict(counted(state_dict_of(path, meta, batch_bytes)))
    if "averaging_state" in meta:
        checkpoint["current_model_state"] = dict(counted(state_dict_of(path, meta, batch_bytes,
                                                                       of="current_model_state")))
    if "optimizers" in info:  # absent: saved with weights only, as Lightning's file leaves the key out
        tensors = dict(counted(iter_tensors(path, "optimizer_states.", batch_bytes))) if info["optimizers"] else {}
        checkpoint["optimizer_states"] = [_optimizer_state(i, opt, tensors, shapes)
                                          for i, opt in enumerate(info["optimizers"])]
    return checkpoint


def _optimizer_state(i: int, opt: dict[str, Any], tensors: dict[str, Tensor], shapes: dict[str, Any]
                     ) -> dict[str, Any]:
    """``torch.optim.Optimizer.state_dict()`` of optimizer ``i``: slots numbered by parameter
    position across groups, as Lightning's full checkpoints hold them."""
    prefix = f"optimizer_states.{i}."
    by_param: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith(prefix):
            name, field = key[len(prefix):].rsplit(".", 1)  # state keys hold no dot
            by_param.setdefault(name, {})[field] = t if t.dim() == 0 else whole(t, shapes[name])
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in opt["param_groups"]:
        positions = []
        for name in group["params"]:
            slot = {**by_param.get(name, {}), **opt["scalars"].get(name, {})} if name is not None else {}
            if slot:
                state[index] = slot
            positions.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": positions})
    return {"state": state, "param_groups": groups}
