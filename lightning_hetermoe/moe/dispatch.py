"""Token dispatch and combine: the one swappable piece between the router and the experts.

A dispatcher takes tokens ``x [T, d]``, the routing choices ``indices [T, k]`` with their
``keep`` mask, and the :class:`~.experts.Experts` module, and returns one output row per
routing choice, ``[T * k, d]`` (zero where a choice was dropped). ``keep`` is ``None`` where
the layer knows without reading the device that every choice is kept (a router that never
declines one, no capacity limit, no padding): then how many rows the experts get is known
on the host, and a dispatcher that needs no split sizes (:class:`LocalDispatcher`) runs
without a host sync. The layer weights and
sums them (:func:`weighted_sum`), or the dispatcher does where it has a ``combine(slots,
weights)`` of its own (the zebra executor's: see its ``combine`` module). :class:`LocalDispatcher`
runs every expert here; a parallel strategy swaps in its own from outside (expert
parallelism's all-to-all, the zebra executor's rounds), built on the sorting helpers below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SortedChoices:
    """Kept routing choices sorted by expert position (stable, so token order is kept)."""

    slot: Tensor  # [S] index into the flattened [T * k] choices
    token: Tensor  # [S] token row of each choice
    counts: Tensor  # [E] kept choices per expert, in ``order``'s expert order (on the host from sort_choices)


def sort_choices(indices: Tensor, keep: Tensor, expert_position: Tensor) -> SortedChoices:
    """Group kept choices by ``expert_position[expert]`` (the order experts are laid out in).

    One host sync: the kept choices per position, copied to the host once (``counts`` comes
    back there). The sort takes that many rows, and the experts read their segment bounds
    from the host copy (the torch path's ``tolist`` then reads host memory; the kernels get
    it from pinned memory), so nothing else in the call waits for the device: the design's
    one sync per (layer, micro-batch)."""
    position = expert_position[indices.reshape(-1)].view_as(indices)
    counts = position_counts(position, keep, expert_position.numel()).cpu()
    return sort_by_position(position, keep, expert_position.numel(), kept=int(counts.sum()), counts=counts)


def sort_every_choice(indices: Tensor, expert_position: Tensor) -> SortedChoices:
    """:func:`sort_choices` when every choice is kept: their number is ``indices.numel()``,
    so nothing is read back from the device (``counts`` stays there)."""
    position = expert_position[indices.reshape(-1)].view_as(indices)
    every = torch.ones_like(position, dtype=torch.bool)
    counts = position_counts(position, every, expert_position.numel())
    return sort_by_position(position, every, expert_position.numel(), kept=position.numel(), counts=counts)


def sort_for_experts_here(indices: Tensor, keep: Tensor | None, num_experts: int, experts,
                          device: torch.device, dtype: torch.dtype) -> SortedChoices:
    """The choices sorted for ``experts``, all ``num_experts`` of them run on ``device`` on
    rows of ``dtype``: without a host sync where every choice is kept (``keep`` ``None``) and
    the experts take their counts on the device (the kernels); else :func:`sort_choices`'s
    one read, whose host counts the torch loop needs anyway."""
    positions = torch.arange(num_experts, device=device)
    if keep is None and experts.counts_on_device(device, dtype):
        return sort_every_choice(indices, positions)
    return sort_choices(indices, keep_mask(indices, keep), positions)


def keep_mask(indices: Tensor, keep: Tensor | None) -> Tensor:
    """``keep``, or every choice kept where it is ``None`` (see the module docstring)."""
    return torch.ones_like(indices, dtype=torch.bool) if keep is None else keep


def position_counts(position: Tensor, keep: Tensor, num_positions: int) -> Tensor:
    """Kept choices per slot position, long ``[num_positions]``, on the device without a host
    sync (scatter_add over the known number of positions, not bincount)."""
    return torch.zeros(num_positions, dtype=torch.long, device=position.device).scatter_add_(
        0, position.reshape(-1), keep.reshape(-1).long())


def sort_by_position(position: Tensor, keep: Tensor, num_positions: int, kept: int, counts: Tensor
                     ) -> SortedChoices:
    """Group kept choices by their own slot position ``position [T, k]`` (stable: token order kept).

    ``kept``: how many choices are kept, which the caller read on the host (the dispatch's
    one sync) or knew there: every choice is sorted with the dropped ones last and the first
    ``kept`` taken, with no further sync. ``counts``: the caller's :func:`position_counts`."""
    k = position.shape[1]
    flat, live = position.reshape(-1), keep.reshape(-1)
    slot = torch.argsort(torch.where(live, flat, num_positions), stable=True)[:kept]
    return SortedChoices(slot=slot, token=torch.div(slot, k, rounding_mode="floor"), counts=counts)


def one_hot(index: Tensor, num_classes: int) -> Tensor:
    """``F.one_hot(index, num_classes)`` without its range check, which reads the index's
    min and max on the host on every device CUDA's exemption does not cover (a scatter into
    the known number of classes reads nothing there)."""
    out = torch.zeros(index.shape + (num_classes,), dtype=torch.long, device=index.device)
    return out.scatter_(-1, index.unsqueeze(-1), 1)


SHARE_UNITS = 720720  # a copy's share of a source's choices, in these units: lcm(1..16), so even runs are exact


def split_over_copies(indices: Tensor, keep: Tensor, copy_position: Tensor, copy_start: Tensor) -> Tensor:
    """Each choice's slot position when experts have copies: the kept choices of expert ``e``
    (in token order) are cut into runs, one per copy: copy ``c`` (at position
    ``copy_position[e, c]``) takes the choices from ``copy_start[e, c] / SHARE_UNITS`` of them
    on (``copy_start[e, 0]`` is 0; a column past the expert's copies is ``SHARE_UNITS``).
    Integer arithmetic: the cut of ``n`` choices into ``C`` even runs is exactly choice
    ``i`` to copy ``floor(i C / n)``. Which copy serves a token does not change the result:
    the copies hold the same weights."""
    flat = indices.reshape(-1)
    live = keep.reshape(-1).long()
    E = copy_start.shape[0]
    onehot = one_hot(flat, E) * live.unsqueeze(-1)
    rank_in_expert = (onehot.cumsum(0) - 1).gather(1, flat.unsqueeze(-1)).squeeze(-1).clamp(min=0)
    count = onehot.sum(0).index_select(0, flat)
    starts = copy_start.index_select(0, flat)  # [S, C]
    # column 0 starts at 0: every choice passes it, so ``copy`` is never negative
    copy = ((rank_in_expert * SHARE_UNITS).unsqueeze(-1) >= starts * count.unsqueeze(-1)).sum(-1) - 1
    return copy_position[flat, copy].view_as(indices)


def scatter_to_slots(rows: Tensor, slot: Tensor, num_slots: int) -> Tensor:
    out = rows.new_zeros(num_slots, rows.shape[-1])
    return out.index_copy(0, slot, rows)


def weighted_sum(slots: Tensor, weights: Tensor) -> Tensor:
    """Each token's output: its ``k`` choices' rows (``slots [T * k, d]``) weighed by the
    router (``weights [T, k]``) and summed, ``[T, d]``."""
    T, k = weights.shape
    return (slots.view(T, k, slots.shape[-1]) * weights.unsqueeze(-1)).sum(1)


class LocalDispatcher:
    """Every expert lives here: no communication. No host sync where every choice is kept
    (``keep`` ``None``) and the experts take their counts on the device (the kernels), else
    one, the kept counts (:func:`sort_choices`)."""

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor | None, experts) -> Tensor:
        sc = sort_for_experts_here(indices, keep, experts.num_local_experts, experts, x.device, x.dtype)
        out = experts(x, sc.token, sc.counts)
        return scatter_to_slots(out, sc.slot, indices.numel())
