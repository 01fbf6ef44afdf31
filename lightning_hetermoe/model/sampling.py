"""One global sample order per epoch, whatever the world size, resumable mid-epoch.

Epoch ``e``'s order is ``randperm(n)`` seeded with ``seed + e`` (or ``0..n-1``), cut to a
multiple of the replica count. Replica ``r`` of ``W`` takes positions ``r, r + W, ...``,
so step ``t``'s global batch (all replicas together, ``b`` each) is positions
``[t*b*W, (t+1)*b*W)`` of that order: the same set of samples on 1, 2 or 4 processes.

The loader's state is the epoch and the number of *global* samples the training loop has
consumed in it, so a checkpoint taken mid-epoch resumes at the next unseen sample even on
another world size (keep ``b * W`` fixed to keep the global batches).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from ..configs import DataConfig


def replica() -> tuple[int, int]:
    """``(world, rank)`` of the process group, ``(1, 0)`` outside one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class GlobalOrderSampler(DistributedSampler):
    """A :class:`DistributedSampler` (so Lightning keeps it) whose order and resume point
    are global. ``num_replicas=1, rank=0`` is the single-process order; ``num_replicas=None``
    (and ``rank=None``) follows the process group, read again whenever the sampler is
    iterated, measured or saved: a loader built before the group starts (``trainer.fit(model,
    dm.train_dataloader())``, the loader made in the script) still deals each rank its share
    once the run has begun, where it would otherwise deal every rank the whole order."""

    def __init__(self, dataset: Dataset, *, num_replicas: int | None = 1, rank: int | None = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True) -> None:
        self._follows_group = num_replicas is None
        if self._follows_group:
            num_replicas, rank = replica()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start = 0  # global position to resume from, this epoch only

    def follow_group(self) -> None:
        """Take the process group's size and rank where this sampler follows it and they changed."""
        if not self._follows_group:
            return
        world, rank = replica()
        if (world, rank) != (self.num_replicas, self.rank):
            epoch, start = self.epoch, self.start
            DistributedSampler.__init__(self, self.dataset, num_replicas=world, rank=rank, shuffle=self.shuffle,
                                        seed=self.seed, drop_last=self.drop_last)
            self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        self.follow_group()
        return super().__len__()

    def order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.drop_last:
            return order[: self.total_size]
        return (order + order[: self.total_size - n])[: self.total_size]  # pad as DistributedSampler does

    def __iter__(self) -> Iterator[int]:
        self.follow_group()
        order = self.order()
        start = self.start - self.start % self.num_replicas  # whole rounds of replicas only
        return iter(order[start + self.rank :: self.num_replicas])

    # ``__len__`` stays the full epoch's length (DistributedSampler's): Lightning reads it
    # once, after restoring a mid-epoch state, as the length of every epoch, and counts the
    # batches it already ran in the resumed epoch itself.

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)


class ResumableLoader(DataLoader):
    """A DataLoader over a :class:`GlobalOrderSampler` with ``state_dict``/``load_state_dict``.

    ``consumed_batches()`` says how many batches of this epoch the training loop has used;
    the datamodule wires it to Lightning's progress counter, because Lightning fetches a
    batch ahead and the loader's own count would be one too many at a mid-epoch save."""

    def __init__(self, *args: Any, consumed_batches: Callable[[], int] | None = None, **kwargs: Any) -> None:
        sampler = kwargs.get("sampler")
        if isinstance(sampler, SequentialSampler):
            # Lightning's ``overfit_batches`` rebuilds the loader with a SequentialSampler
            # (shuffling off): the global order unshuffled, so that every world size still
            # trains on the same global batches as one process
            kwargs["sampler"] = GlobalOrderSampler(sampler.data_source, num_replicas=None, rank=None, shuffle=False,
                                                   drop_last=kwargs.get("drop_last", True))
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, GlobalOrderSampler):
            raise TypeError(f"ResumableLoader needs a GlobalOrderSampler (or a SequentialSampler, taken as its "
                            f"unshuffled order), got sampler={type(self.sampler).__name__}")
        self._consumed_batches = consumed_batches

    def state_dict(self) -> dict[str, int]:
        s: GlobalOrderSampler = self.sampler  # type: ignore[assignment]
        s.follow_group()
        done = self._consumed_batches() if self._consumed_batches is not None else 0
        start = s.start - s.start % s.num_replicas
        return {"epoch": s.epoch, "position": start + done * self.batch_size * s.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        s: GlobalOrderSampler = self.sampler  # type: ignore[assignment]
        s.set_epoch(int(state["epoch"]))
        s.start = int(state["position"])


class GlobalOrderDataModule(L.LightningDataModule):
    """Loaders in one global order per epoch, resumable mid-epoch (see :mod:`.sampling`).
    Subclasses build ``train_set`` and ``val_set`` in ``setup``."""

    train_set: Dataset
    val_set: Dataset

    def __init__(self, cfg: DataConfig | dict | None = None) -> None:
        super().__init__()
        from ..configs import from_cfg

        self.cfg = from_cfg(DataConfig, cfg or {})

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=self.cfg.shuffle, drop_last=True,
                            consumed_batches=self._consumed_train_batches)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, drop_last=True)

    def _consumed_train_batches(self) -> int:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def _loader(self, dataset: Dataset, shuffle: bool, drop_last: bool, consumed_batches=None) -> DataLoader:
        """One global order per epoch (see :mod:`.sampling`): rank r of W takes every W-th
        sample of it, so a global batch does not depend on the world size, in any epoch,
        and a mid-epoch checkpoint resumes at the next unseen sample."""
        sampler = GlobalOrderSampler(dataset, num_replicas=None, rank=None, shuffle=shuffle, seed=self.cfg.seed,
                                     drop_last=drop_last)
        return ResumableLoader(dataset, batch_size=self.cfg.batch_size, sampler=sampler,
                               num_workers=self.cfg.num_workers, drop_last=drop_last,
                               consumed_batches=consumed_batches)
