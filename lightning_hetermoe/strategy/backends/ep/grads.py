"""Expert gradients under expert parallelism: copies summed, replicas summed; and the
experts' half of the global clipping norm."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ....comm import Group
from ....model_contract import moe_layers
from ...grad_norm import squared_row_norms
from ..base import zero_missing_grads
from .groups import ExpertParallelGroups


def sum_copies(layer, grads: list[Tensor], group: Group) -> None:
    """Copies of one expert on several ranks each saw part of its tokens: every copy gets
    the sum, so the copies stay identical under any optimizer."""
    disp = layer.dispatcher
    shared = [e for e, c in enumerate(getattr(disp, "copies", [])) if len(c) > 1]
    if not shared:
        return
    where = {e: i for i, e in enumerate(shared)}
    ids = disp.placement[disp.rank]
    for g in grads:
        buf = g.new_zeros((len(shared),) + tuple(g.shape[1:]))
        for slot, e in enumerate(ids):
            if e in where:
                buf[where[e]] += g[slot]
        comm.all_reduce(group, buf, what="ep.grads.copies")
        for slot, e in enumerate(ids):
            if e in where:
                g[slot] = buf[where[e]]


def reduce_expert_grads(module: nn.Module, groups: ExpertParallelGroups) -> None:
    """Expert gradient = sum over every copy of the same expert.

    Each rank backpropagated its share of the global mean loss (see
    ``ExpertParallelBackend.backward``); the all-to-all backward already summed the
    contributions of every rank in the EP group onto the copy that served them; copies of
    one expert in the group (rebalancing) and replicas in other EP groups are summed next,
    so the result is the gradient of the global mean loss."""
    replicas = groups.world_size // groups.ep_size
    for _, layer in moe_layers(module):
        # a frozen expert tensor (frozen on every rank alike) has no gradient to sum
        params = [p for p in layer.experts.parameters(recurse=False) if p.requires_grad]
        zero_missing_grads(params)
        sum_copies(layer, [p.grad for p in params], groups.ep_group)
        if replicas > 1:
            for p in params:
                comm.all_reduce(groups.replica_group, p.grad, what="ep.grads.replicas")


def expert_grad_sq_norm(module: nn.Module, groups: ExpertParallelGroups, device: torch.device,
                        held: set[int] | None = None) -> Tensor:
    """Squared norm of all expert gradients of the model, each expert counted once (a copy
    of an expert on ``n`` ranks counts ``1/n`` on each); ``held``: only the expert tensors
    of these ids (an optimizer's: manual optimization clips each optimizer over its own)."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for _, layer in moe_layers(module):
        disp = layer.dispatcher
        ids = disp.placement[disp.rank]
        weight = comm.to_device(torch.tensor([1.0 / len(disp.copies[e]) for e in ids], dtype=torch.float64,
                                             device="cpu"), device)
        for p in layer.experts.parameters(recurse=False):
            if p.grad is not None and p.numel() and (held is None or id(p) in held):
                local = local + (squared_row_norms(p.grad) * weight).sum()
    comm.all_reduce(groups.ep_group, local, what="ep.clip")
    return local
