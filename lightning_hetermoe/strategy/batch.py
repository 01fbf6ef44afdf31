"""The global batch of a step, and each rank's share of it.

Every rank loads its own ``b`` samples (rank ``r`` of ``W`` takes positions ``r, r+W, ...``
of the epoch's order, see :mod:`lightning_hetermoe.model.sampling`), exactly as under DDP.
Modes that split the batch by something other than rank count (zebra's attention ranks,
EP with speed-proportional shares) all-gather those pieces back into the global batch, in
global order, and cut it into the shares the plan gives. Token batches are small next to
activations, so every rank loading and gathering them costs little, and the global batch
stays the same set of samples in every mode and on every world size.

A batch is a tensor, or a tuple/list/dict of tensors whose first dimension is the batch
(the model contract).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor


def map_batch(batch: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_batch(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_batch(v, fn) for k, v in batch.items()}
    raise TypeError(f"a batch must be a tensor or a tuple/list/dict of tensors, got {type(batch).__name__}")


def batch_size(batch: Any) -> int:
    sizes = set()
    map_batch(batch, lambda t: sizes.add(int(t.shape[0])) or t)
    if len(sizes) != 1:
        raise ValueError(f"the tensors of a batch disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def sequence_length(batch: Any) -> int:
    """Tokens per sequence: the second dimension of the batch's first tensor (``[batch, seq]``)."""
    first: list[Tensor] = []
    map_batch(batch, lambda t: first.append(t) or t)
    if not first or first[0].dim() < 2:
        raise ValueError("the batch's first tensor must be [batch, seq_len, ...] to plan by sequence length")
    return int(first[0].shape[1])


def gather_global_batch(batch: Any, group: dist.ProcessGroup | None = None) -> Any:
    """All ranks' batches as one, in global sample order (rank ``r``'s ``i``-th sample is
    global sample ``i * W + r``)."""
    world = dist.get_world_size(group)

    def gather(t: Tensor) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        stacked = torch.stack(parts, 1)  # [b, W, ...]
        return stacked.reshape((-1,) + tuple(t.shape[1:]))

    return map_batch(batch, gather)


def take(batch: Any, start: int, count: int) -> Any:
    return map_batch(batch, lambda t: t.narrow(0, start, count))


def split_sizes(batch_len: int, sizes: list[int]) -> list[tuple[int, int]]:
    """``(start, count)`` of consecutive shares; ``sizes`` must add up to ``batch_len``."""
    if sum(sizes) != batch_len:
        raise ValueError(f"shares {sizes} do not add up to the batch of {batch_len}")
    out, start = [], 0
    for n in sizes:
        out.append((start, n))
        start += n
    return out
