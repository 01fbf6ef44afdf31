"""Token dispatch and combine: the one swappable piece between the router and the experts.

A dispatcher takes tokens ``x [T, d]``, the routing choices ``indices [T, k]`` with their
``keep`` mask, and the :class:`~.experts.Experts` module, and returns one output row per
routing choice, ``[T * k, d]`` (zero where a choice was dropped). The layer weights and
sums them. :class:`LocalDispatcher` runs every expert here; :class:`AllToAllDispatcher`
sends rows to the rank that owns each expert with ``all_to_all_single`` (uneven splits,
autograd through the exchange) and brings the results back. The zebra executor will
split these two halves apart and drive them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class SortedChoices:
    """Kept routing choices sorted by expert position (stable, so token order is kept)."""

    slot: Tensor  # [S] index into the flattened [T * k] choices
    token: Tensor  # [S] token row of each choice
    counts: Tensor  # [E] kept choices per expert, in ``order``'s expert order


def sort_choices(indices: Tensor, keep: Tensor, expert_position: Tensor) -> SortedChoices:
    """Group kept choices by ``expert_position[expert]`` (the order experts are laid out in)."""
    return sort_by_position(expert_position[indices.reshape(-1)].view_as(indices), keep, expert_position.numel())


def sort_by_position(position: Tensor, keep: Tensor, num_positions: int) -> SortedChoices:
    """Group kept choices by their own slot position ``position [T, k]`` (stable: token order kept)."""
    k = position.shape[1]
    live = keep.reshape(-1).nonzero().squeeze(-1)
    pos = position.reshape(-1).index_select(0, live)
    order = torch.argsort(pos, stable=True)
    slot = live.index_select(0, order)
    counts = torch.bincount(pos, minlength=num_positions)
    return SortedChoices(slot=slot, token=torch.div(slot, k, rounding_mode="floor"), counts=counts)


def split_over_copies(indices: Tensor, keep: Tensor, copy_position: Tensor, num_copies: Tensor) -> Tensor:
    """Each choice's slot position when experts have copies: the kept choices of expert ``e``
    (in token order) are cut into ``num_copies[e]`` even runs, one per copy
    (``copy_position[e, c]`` is copy ``c``'s position). Which copy serves a token does not
    change the result: the copies hold the same weights."""
    flat = indices.reshape(-1)
    live = keep.reshape(-1).long()
    E = num_copies.numel()
    onehot = torch.nn.functional.one_hot(flat, E) * live.unsqueeze(-1)
    rank_in_expert = (onehot.cumsum(0) - 1).gather(1, flat.unsqueeze(-1)).squeeze(-1).clamp(min=0)
    count = onehot.sum(0).index_select(0, flat).clamp(min=1)
    copy = torch.div(rank_in_expert * num_copies.index_select(0, flat), count, rounding_mode="floor")
    return copy_position[flat, copy].view_as(indices)


def scatter_to_slots(rows: Tensor, slot: Tensor, num_slots: int) -> Tensor:
    out = rows.new_zeros(num_slots, rows.shape[-1])
    return out.index_copy(0, slot, rows)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, send_splits: list[int], recv_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


class LocalDispatcher:
    """Every expert lives here: no communication."""

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor, experts) -> Tensor:
        positions = torch.arange(experts.num_local_experts, device=x.device)
        sc = sort_choices(indices, keep, positions)
        out = experts(x, sc.token, sc.counts)
        return scatter_to_slots(out, sc.slot, indices.numel())


class AllToAllDispatcher:
    """Expert parallelism over ``group``: ``placement[r]`` lists the global expert ids held by
    group rank ``r`` (the local ``Experts`` rows, in that order). Placements may be uneven
    (e.g. 6 experts over 4 ranks as 2+2+1+1), ranks may hold no expert at all, and an
    expert may have copies on several ranks (its tokens split evenly over them)."""

    def __init__(self, group: dist.ProcessGroup | None, placement: list[list[int]]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.set_placement(placement)

    def set_placement(self, placement: list[list[int]]) -> None:
        """Adopt a new placement in place (after a migration): whatever wraps this
        dispatcher (the emulated clock wraps ``exchange``) stays installed."""
        if len(placement) != self.size:
            raise ValueError(f"placement has {len(placement)} entries for an expert-parallel group of {self.size}")
        flat = [e for p in placement for e in p]
        num_experts = len(set(flat))
        if sorted(set(flat)) != list(range(num_experts)) or any(len(set(p)) != len(p) for p in placement):
            raise ValueError(f"placement {placement} must hold every expert 0..{num_experts - 1}, "
                             f"each at most once per rank")
        self.placement = [list(p) for p in placement]
        self.copies: list[list[int]] = [[] for _ in range(num_experts)]  # positions of each expert's copies
        for pos, e in enumerate(flat):
            self.copies[e].append(pos)
        self.num_positions = len(flat)
        most = max(len(c) for c in self.copies)
        self._copy_position = torch.tensor([c + [c[0]] * (most - len(c)) for c in self.copies], dtype=torch.long)
        self._num_copies = torch.tensor([len(c) for c in self.copies], dtype=torch.long)
        self.replicated = most > 1
        self.experts_per_rank = [len(p) for p in self.placement]

    def exchange(self, x: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        """Differentiable uneven all-to-all; backward runs the reverse exchange."""
        return _AllToAll.apply(x, send_splits, recv_splits, self.group)

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor, experts) -> Tensor:
        mine = self.experts_per_rank[self.rank]
        if experts.num_local_experts != mine:
            raise RuntimeError(f"rank {self.rank} holds {experts.num_local_experts} experts, placement says {mine}")
        if self.replicated:
            position = split_over_copies(indices, keep, self._copy_position.to(x.device), self._num_copies.to(x.device))
            sc = sort_by_position(position, keep, self.num_positions)
        else:  # one copy each: an expert's position is its only copy's
            sc = sort_choices(indices, keep, self._copy_position[:, 0].to(x.device))
        # Per-expert counts go first so every rank can size its receive buffers.
        recv_counts = sc.counts.new_empty(self.size * mine)
        dist.all_to_all_single(recv_counts, sc.counts, [mine] * self.size, self.experts_per_rank, group=self.group)
        recv_counts = recv_counts.view(self.size, mine)
        send_splits = [int(c.sum()) for c in sc.counts.split(self.experts_per_rank)]
        recv_splits = recv_counts.sum(1).tolist()

        received = self.exchange(x.index_select(0, sc.token), send_splits, recv_splits)
        # Received rows are ordered (source rank, local expert); the experts want them by expert.
        local_expert = torch.arange(mine, device=x.device).repeat(self.size)
        row_expert = torch.repeat_interleave(local_expert, recv_counts.reshape(-1))
        by_expert = torch.argsort(row_expert, stable=True)
        out = experts(received, by_expert, recv_counts.sum(0))
        if out.shape[0] == 0 and received.requires_grad:
            # Nothing arrived here, so no expert ran on ``received``: tie it to the output
            # anyway, or this rank would skip the backward of the dispatch all-to-all that
            # its peers run, and the collectives would fall out of step.
            out = out + received.sum() * 0
        out = scatter_to_slots(out, by_expert, received.shape[0])
        back = self.exchange(out, recv_splits, send_splits)
        return scatter_to_slots(back, sc.slot, indices.numel())
