"""Expert parallelism's token dispatcher: rows to the ranks that hold their experts and back.

Swapped into each :class:`~lightning_hetermoe.moe.MoELayer` from outside (the model never
sees a process group). Per layer and forward, one host sync: the kept rows per expert are
copied to the host once, exchanged over the group's host side (gloo), and every split size
comes from there; the rows themselves go over the device side with an all-to-all whose
backward runs the reverse exchange. A group of one (``expert_parallel_size=1``: each rank
holds every expert) dispatches as a single device does: no sync, no exchange.

Copies of an expert are served local first (:mod:`lightning_hetermoe.copy_routing`): this
rank's choices for an expert it holds stay here, else go to the copies on its node, else
to every copy, in even runs; or by the placement's route for that expert, in runs of the
route's shares. Each rank applies the rule to its own choices from tables built when the
placement is adopted: no sync beyond the one above, and receivers learn what came from
the count exchange.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

import lightning_hetermoe.comm as comm
from ....comm import Group
from ....copy_routing import holders_of, source_split
from ....moe.dispatch import (SHARE_UNITS, LocalDispatcher, keep_mask, position_counts, scatter_to_slots,
                              sort_by_position, split_over_copies)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, send_splits: list[int], recv_splits: list[int], group: Group) -> Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(group, out, x.contiguous(), recv_splits, send_splits, what="ep.rows")
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


class AllToAllDispatcher:
    """Expert parallelism over ``group``: ``placement[r]`` lists the global expert ids held by
    group rank ``r`` (the local ``Experts`` rows, in that order). Placements may be uneven
    (e.g. 6 experts over 4 ranks as 2+2+1+1), ranks may hold no expert at all, and an
    expert may have copies on several ranks, which serve tokens by ``rule``
    (``local_first`` or ``even``; ``nodes[r]``: group rank ``r``'s node, for local first)."""

    def __init__(self, group: Group, placement: list[list[int]], rule: str = "local_first",
                 nodes: list[int] | None = None) -> None:
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.rule, self.nodes = rule, nodes
        # called before the layer's first collective (the backend's check that a forward
        # outside a step runs on every rank); None: none
        self.guard: Callable[[], None] | None = None
        self.set_placement(placement)

    def set_placement(self, placement: list[list[int]], routes: list | None = None) -> None:
        """Adopt a new placement in place (after a migration): whatever wraps this
        dispatcher (the emulated clock wraps ``exchange``) stays installed. ``routes``: the
        layer's per-expert routes (:class:`~lightning_hetermoe.placement.Placement`), or ``None``."""
        if len(placement) != self.size:
            raise ValueError(f"placement has {len(placement)} entries for an expert-parallel group of {self.size}")
        flat = [e for p in placement for e in p]
        num_experts = len(set(flat))
        if sorted(set(flat)) != list(range(num_experts)) or any(len(set(p)) != len(p) for p in placement):
            raise ValueError(f"placement {placement} must hold every expert 0..{num_experts - 1}, "
                             f"each at most once per rank")
        self.placement = [list(p) for p in placement]
        self.routes = routes
        slot: dict[tuple[int, int], int] = {}  # (rank, expert) -> position, rank-major
        for h, p in enumerate(placement):
            for e in p:
                slot[h, e] = len(slot)
        have = holders_of(placement, num_experts)
        # slot positions (rank-major order) of each expert's copies; the copies serving this
        # rank's choices, each with the share of them it takes
        self.copies = [[slot[h, e] for h in hs] for e, hs in enumerate(have)]
        serving = [source_split(hs, self.rank, self.nodes, self.rule, routes[e] if routes is not None else None)
                   for e, hs in enumerate(have)]
        self.num_positions = len(flat)
        most = max(len(c) for c in serving)
        position, start = [], []
        for e, split in enumerate(serving):
            at = [slot[h, e] for h, _ in split]
            cum = [0.0]
            for _, f in split[:-1]:
                cum.append(cum[-1] + f)
            units = [round(c * SHARE_UNITS) if i else 0 for i, c in enumerate(cum)]
            position.append(at + [at[0]] * (most - len(at)))
            start.append(units + [SHARE_UNITS] * (most - len(at)))
        self._copy_position = torch.tensor(position, dtype=torch.long, device="cpu")
        self._copy_start = torch.tensor(start, dtype=torch.long, device="cpu")
        self._on_device: dict[torch.device, tuple[Tensor, Tensor]] = {}  # copied once per device, not per call
        self.replicated = most > 1  # some expert's choices split over several copies here
        self.experts_per_rank = [len(p) for p in self.placement]
        # A group of one holding every expert in order is a single device: its layer
        # dispatches as one (no count read on the host, no exchange with itself)
        self.alone = LocalDispatcher() if self.size == 1 and self.placement[0] == list(range(num_experts)) else None

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (comm.to_device(self._copy_position, device),
                                       comm.to_device(self._copy_start, device))
        return self._on_device[device]

    def exchange(self, x: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        """Differentiable uneven all-to-all; backward runs the reverse exchange."""
        return _AllToAll.apply(x, send_splits, recv_splits, self.group)

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor | None, experts) -> Tensor:
        if self.guard is not None:
            self.guard()
        if self.alone is not None:
            return self.alone(x, indices, keep, experts)
        keep = keep_mask(indices, keep)  # the split sizes are read on the host either way
        mine = self.experts_per_rank[self.rank]
        if experts.num_local_experts != mine:
            raise RuntimeError(f"rank {self.rank} holds {experts.num_local_experts} experts, placement says {mine}")
        copy_position, copy_start = self._tables(x.device)
        if self.replicated:
            position = split_over_copies(indices, keep, copy_position, copy_start)
        else:  # one copy each: an expert's position is its only copy's
            position = copy_position[:, 0][indices.reshape(-1)].view_as(indices)
        on_device = position_counts(position, keep, self.num_positions)
        # The layer's one host sync: every split size, and the sort's length, come from these.
        counts = on_device.cpu()
        sc = sort_by_position(position, keep, self.num_positions, kept=int(counts.sum()), counts=on_device)
        recv_counts = torch.empty(self.size * mine, dtype=torch.long, device="cpu")
        comm.host_all_to_all(self.group, recv_counts, counts, [mine] * self.size, self.experts_per_rank,
                             what="ep.counts")
        recv_counts = recv_counts.view(self.size, mine)
        send_splits = [int(c.sum()) for c in counts.split(self.experts_per_rank)]
        recv_splits = recv_counts.sum(1).tolist()

        rows = x.index_select(0, sc.token)
        # in the dtype the experts compute in (under autocast the MoE input is still fp32)
        received = self.exchange(rows.to(comm.wire_dtype(rows)), send_splits, recv_splits)
        # Received rows are ordered (source rank, local expert); the experts want them by expert.
        row_expert = torch.repeat_interleave(torch.arange(mine, device="cpu").repeat(self.size), recv_counts.reshape(-1))
        by_expert = comm.to_device(torch.argsort(row_expert, stable=True), x.device)
        out = experts(received, by_expert, recv_counts.sum(0))
        if out.shape[0] == 0 and received.requires_grad:
            # Nothing arrived here, so no expert ran on ``received``: tie it to the output
            # anyway, or this rank would skip the backward of the dispatch all-to-all that
            # its peers run, and the collectives would fall out of step.
            out = out + received.sum() * 0
        out = scatter_to_slots(out, by_expert, received.shape[0])
        back = self.exchange(out, recv_splits, send_splits)
        return scatter_to_slots(back, sc.slot, indices.numel())
