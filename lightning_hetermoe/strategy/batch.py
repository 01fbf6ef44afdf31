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

from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

import lightning_hetermoe.comm as comm


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor], *, strict: bool = False) -> Any:
    """``fn`` applied to every tensor in tuples (named or not), lists, dicts and dataclasses.

    Other leaves pass through unchanged, or raise with ``strict`` (a batch is tensors only:
    a non-tensor leaf could not be gathered or split, see the model contract)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn, strict=strict) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn, strict=strict) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn, strict=strict) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, strict=strict)
                               for f in fields(obj) if f.init})
    if strict:
        raise TypeError(f"a batch must be a tensor or a tuple/list/dict of tensors, got {type(obj).__name__}")
    return obj


def tensors(obj: Any, *, strict: bool = False) -> list[Tensor]:
    """Every tensor of ``obj``, in the order :func:`map_tensors` visits them."""
    found: list[Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t, strict=strict)
    return found


def map_batch(batch: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    return map_tensors(batch, fn, strict=True)


def batch_size(batch: Any) -> int:
    sizes = {int(t.shape[0]) for t in tensors(batch, strict=True)}
    if len(sizes) != 1:
        raise ValueError(f"the tensors of a batch disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def sequence_length(batch: Any) -> int:
    """Tokens per sequence: the second dimension of the batch's first tensor (``[batch, seq]``)."""
    first = tensors(batch, strict=True)
    if not first or first[0].dim() < 2:
        raise ValueError("the batch's first tensor must be [batch, seq_len, ...] to plan by sequence length")
    return int(first[0].shape[1])


def rank_counts(batch: Any) -> list[int]:
    """Rows each rank loaded this step, in rank order (host metadata: read from the batch's
    shape, no device sync). They differ in a short last batch that Lightning's predict
    sampler deals without padding."""
    world = comm.world()
    mine = torch.tensor([batch_size(batch)], dtype=torch.int64, device="cpu")
    parts = [torch.empty_like(mine) for _ in range(world.size)]
    comm.host_all_gather(world, parts, mine, what="batch.counts")
    return [int(p) for p in parts]


def global_order(counts: list[int]) -> list[tuple[int, int]]:
    """``(rank, i)`` of each sample of the global batch, in global order, where rank ``r``
    loaded ``counts[r]`` rows: rank ``r``'s ``i``-th sample is global sample ``i * W + r``
    when every rank loaded as many; in a short last batch the ranks holding an ``i``-th
    sample close up, in rank order (as a sampler that deals ``r, r + W, ...`` left them)."""
    return [(r, i) for i in range(max(counts, default=0)) for r, n in enumerate(counts) if i < n]


def gather_global_batch(batch: Any, counts: list[int] | None = None) -> Any:
    """All ranks' batches as one, in global sample order (see :func:`global_order`). The
    batch is on the device (Lightning moved it there). ``counts``: rows per rank where they
    may differ (:func:`rank_counts`); ``None``: every rank loaded as many."""
    world = comm.world()
    uneven = counts is not None and len(set(counts)) > 1
    most = max(counts) if uneven else 0
    # where each sample of the global order sits among the padded rows ([most, W] row-major)
    keep = comm.to_device(torch.tensor([i * world.size + r for r, i in global_order(counts)], dtype=torch.long,
                                       device="cpu")) if uneven else None

    def gather(t: Tensor) -> Tensor:
        if uneven:  # all_gather needs one shape: pad to the longest rank's rows, drop them after
            t = torch.cat([t, t.new_zeros((most - t.shape[0],) + tuple(t.shape[1:]))])
        parts = [torch.empty_like(t) for _ in range(world.size)]
        comm.all_gather(world, parts, t.contiguous(), what="batch.gather")
        stacked = torch.stack(parts, 1)  # [b, W, ...]
        flat = stacked.reshape((-1,) + tuple(t.shape[1:]))
        return flat.index_select(0, keep) if uneven else flat

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


def weighted_share(full: Any, sizes: list[int], rank: int) -> tuple[Any, float]:
    """Rank ``rank``'s consecutive share of the global batch ``full`` (``sizes`` per rank),
    and the weight of its mean loss: DDP averages over ranks, so with unequal shares each
    rank's mean must count by its size (``count * world / total``)."""
    total = batch_size(full)
    start, count = split_sizes(total, sizes)[rank]
    return take(full, start, count), count * len(sizes) / total
