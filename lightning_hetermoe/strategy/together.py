"""Loaders without a length stop together: each batch is taken only once every rank has one.

Every step of the strategy is a collective over all ranks (zebra's rounds, ep's all-to-all,
data-centric's gathers, the gradient sync). A loader with a length is checked before the
first step (``HeterMoEStrategy._check_equal_batches``); a stream's length is known only
when it ends, and a rank whose stream ended first would leave its peers waiting in a
collective for ever (as under DDP), or pair their next collectives with its own. So each
``next`` on such a loader is agreed on: one host all-reduce of "I have a batch" (a CPU
integer over the host group, no device work), and where any rank has none, every rank
stops there; the batches the others still held are not run, and rank 0 says so once per
pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from .. import comm

_CLASSES: dict[type, type] = {}


def stop_together(loader: object, group: comm.Group | None, stage: str) -> object:
    """``loader`` as it is where it has a length (or one rank runs: ``group`` None); else one whose
    iterators stop on every rank at the first batch some rank does not have. A DataLoader
    keeps its class's behaviour (a subclass made here: Lightning still sees a DataLoader, its
    workers and their seeding unchanged); any other iterable is wrapped."""
    if group is None or group.size < 2 or sized_len(loader) is not None:
        return loader
    if isinstance(loader, DataLoader):
        cls = type(loader)
        if not getattr(cls, "_hetermoe_stops_together", False):
            loader.__class__ = _together_class(cls)
        loader._hetermoe_together = (group, stage)
        return loader
    return _TogetherIterable(loader, group, stage)


def _together_class(cls: type) -> type:
    """``cls`` with an ``__iter__`` whose passes stop together (one subclass per class, made
    once; single inheritance, so an instance's class can be swapped for it)."""
    if cls not in _CLASSES:
        def __iter__(self) -> Iterator[Any]:
            group, stage = self._hetermoe_together
            return _Together(cls.__iter__(self), group, stage)

        _CLASSES[cls] = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                    "__qualname__": cls.__qualname__, "_hetermoe_stops_together": True})
    return _CLASSES[cls]


class _TogetherIterable:
    """Any iterable without a length, its iterators stopping together."""

    def __init__(self, iterable: object, group: comm.Group, stage: str) -> None:
        self.iterable, self.group, self.stage = iterable, group, stage

    def __iter__(self) -> Iterator[Any]:
        return _Together(iter(self.iterable), self.group, self.stage)

    def __getattr__(self, name: str) -> Any:  # what Lightning reads of the loader (dataset, batch_size, ...)
        return getattr(self.__dict__["iterable"], name)


class _Together:
    """One pass of a loader: a batch only where every rank has one."""

    def __init__(self, inner: Iterator[Any], group: comm.Group, stage: str) -> None:
        self.inner, self.group, self.stage = inner, group, stage
        self.taken = 0
        self.ended = False

    def __iter__(self) -> _Together:
        return self

    def __next__(self) -> Any:
        if self.ended:
            raise StopIteration
        try:
            batch, have = next(self.inner), 1
        except StopIteration:
            batch, have = None, 0
        count = torch.tensor([have], dtype=torch.int64, device="cpu")  # host traffic
        comm.host_all_reduce(self.group, count, what="strategy.loader_has_batch")
        ranks_with = int(count.item())  # a CPU tensor: no device sync
        if ranks_with == self.group.size:
            self.taken += 1
            return batch
        self.ended = True
        if ranks_with and self.group.rank == 0:
            rank_zero_warn(
                f"{self.stage}: the ranks' loaders (no length: streams) ended unevenly: {self.group.size - ranks_with} "
                f"of {self.group.size} ranks had no batch after {self.taken}, so every rank stopped there and the "
                f"batches the other ranks still held were not run (every step is a collective over all ranks). "
                f"Give each rank a stream of as many batches to run them all.")
        raise StopIteration
