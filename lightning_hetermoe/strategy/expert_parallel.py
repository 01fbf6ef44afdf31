"""Expert parallelism applied from outside the model: slice experts, swap dispatchers,
reduce expert gradients, and gather/slice expert tensors for placement-independent state.

Ranks form ``world / ep_size`` expert-parallel (EP) groups of consecutive ranks; rank ``i``
of every EP group holds the same experts, so ranks with equal ``i`` form a replica group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..contract import moe_layers
from ..moe import AllToAllDispatcher, LocalDispatcher
from ..moe.balance import GlobalBalance, LocalBalance
from ..placement import contiguous_placement


@dataclass
class ExpertParallelGroups:
    ep_size: int
    ep_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None
    ep_rank: int
    world_size: int

    @classmethod
    def build(cls, ep_size: int) -> "ExpertParallelGroups":
        world, rank = dist.get_world_size(), dist.get_rank()
        if ep_size < 1 or world % ep_size:
            raise ValueError(f"expert_parallel_size={ep_size} is invalid: must divide the world size {world}")
        ep_group = replica_group = None
        # Every rank must create every group, in the same order.
        for d in range(world // ep_size):
            ranks = list(range(d * ep_size, (d + 1) * ep_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                ep_group = g
        for i in range(ep_size):
            ranks = list(range(i, world, ep_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                replica_group = g
        return cls(ep_size, ep_group, replica_group, rank % ep_size, world)


def expert_param_names(module: nn.Module) -> list[str]:
    names = []
    for prefix, layer in moe_layers(module):
        for pname, _ in layer.experts.named_parameters(recurse=False):
            names.append(f"{prefix}.experts.{pname}" if prefix else f"experts.{pname}")
    return names


def allreduce_counts(group: dist.ProcessGroup | None):
    """Sum routing counts over ``group`` (the data-parallel ranks): the global ``f`` of the
    balance loss (see :mod:`lightning_hetermoe.moe.balance`)."""

    def reduce(counts: Tensor) -> Tensor:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        return counts

    return reduce


def broadcast_experts(module: nn.Module, src: int = 0) -> None:
    """Rank ``src``'s full expert weights on every rank, before anyone slices its own.

    DDP broadcasts the dense weights at wrap time; the experts are outside DDP, so without
    this each rank would start from its own random experts."""
    for _, layer in moe_layers(module):
        for p in layer.experts.parameters(recurse=False):
            dist.broadcast(p.data, src=src)


def slice_experts(layer, mine: list[int]) -> None:
    """Keep rows ``mine`` (global expert ids, in that order) of every expert tensor."""
    ex = layer.experts
    idx = torch.tensor(mine, dtype=torch.long)
    for pname, p in list(ex.named_parameters(recurse=False)):
        setattr(ex, pname, nn.Parameter(p.detach()[idx.to(p.device)].clone(), requires_grad=p.requires_grad))
    ex.expert_ids = idx.to(ex.expert_ids.device)


def shard_experts(module: nn.Module, groups: ExpertParallelGroups) -> dict[str, list[list[int]]]:
    """Keep only this rank's experts in every MoE layer and route through all-to-all; the
    balance loss takes its counts over all ranks (every rank holds a different share of the
    batch).

    Returns the placement per layer (layer name -> experts per EP rank)."""
    broadcast_experts(module)
    placements = {}
    for name, layer in moe_layers(module):
        placement = contiguous_placement(layer.num_experts, groups.ep_size)
        slice_experts(layer, placement[groups.ep_rank])
        layer.dispatcher = AllToAllDispatcher(groups.ep_group, placement)
        layer.balance = GlobalBalance(allreduce_counts(None))
        placements[name] = placement
    return placements


def unshard_experts(module: nn.Module, groups: ExpertParallelGroups) -> None:
    """Inverse of :func:`shard_experts`: every rank ends with all experts, local dispatch."""
    for _, layer in moe_layers(module):
        placement = layer.dispatcher.placement
        ex = layer.experts
        for pname, p in list(ex.named_parameters(recurse=False)):
            full = gather_experts(p.detach(), placement, groups.ep_group)
            setattr(ex, pname, nn.Parameter(full, requires_grad=p.requires_grad))
        ex.expert_ids = torch.arange(layer.num_experts, device=ex.expert_ids.device)
        layer.dispatcher = LocalDispatcher()
        layer.balance = LocalBalance()


def gather_experts(local: Tensor, placement: list[list[int]], group: dist.ProcessGroup | None) -> Tensor:
    """All-gather per-rank expert slices (uneven first dims) into the full ``[E, ...]`` tensor."""
    sizes = [len(p) for p in placement]
    most = max(sizes)
    padded = local.new_zeros((most,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded.contiguous(), group=group)
    full = local.new_empty((len({e for p in placement for e in p}),) + tuple(local.shape[1:]))
    for chunk, experts in zip(chunks, placement):
        if experts:
            full[torch.tensor(experts, device=local.device)] = chunk[: len(experts)]
    return full


def sum_copies(layer, grads: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Copies of one expert on several ranks each saw part of its tokens: every copy gets
    the sum, so the copies stay identical under any optimizer."""
    disp = layer.dispatcher
    shared = [e for e, c in enumerate(getattr(disp, "copies", [])) if len(c) > 1]
    if not shared:
        return
    where = {e: i for i, e in enumerate(shared)}
    ids = layer.experts.expert_ids.tolist()
    for g in grads:
        buf = g.new_zeros((len(shared),) + tuple(g.shape[1:]))
        for slot, e in enumerate(ids):
            if e in where:
                buf[where[e]] += g[slot]
        dist.all_reduce(buf, group=group)
        for slot, e in enumerate(ids):
            if e in where:
                g[slot] = buf[where[e]]


def reduce_expert_grads(module: nn.Module, groups: ExpertParallelGroups) -> None:
    """Expert gradient = sum over every copy of the same expert / world size.

    The all-to-all backward already summed the contributions of every rank in the EP group
    onto the copy that served them; copies of one expert in the group (rebalancing) and
    replicas in other EP groups are summed next; dividing by the world size matches DDP's
    averaging of the non-expert gradients, so the result equals the gradient of the global
    mean loss."""
    replicas = groups.world_size // groups.ep_size
    for _, layer in moe_layers(module):
        params = list(layer.experts.parameters(recurse=False))
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        sum_copies(layer, [p.grad for p in params], groups.ep_group)
        for p in params:
            if replicas > 1:
                dist.all_reduce(p.grad, group=groups.replica_group)
            p.grad.div_(groups.world_size)


def expert_grad_sq_norm(module: nn.Module, groups: ExpertParallelGroups) -> Tensor:
    """Squared norm of all expert gradients of the model, each expert counted once (a copy
    of an expert on ``n`` ranks counts ``1/n`` on each)."""
    local = torch.zeros((), dtype=torch.float64)
    for _, layer in moe_layers(module):
        copies = getattr(layer.dispatcher, "copies", None)
        ids = layer.experts.expert_ids.tolist()
        weight = torch.tensor([1.0 / len(copies[e]) if copies else 1.0 for e in ids], dtype=torch.float64)
        for p in layer.experts.parameters(recurse=False):
            if p.grad is not None and p.numel():
                per_slot = p.grad.detach().double().square().reshape(p.shape[0], -1).sum(1)
                local = local.to(p.grad.device) + (per_slot * weight.to(p.grad.device)).sum()
    dist.all_reduce(local, group=groups.ep_group)
    return local
