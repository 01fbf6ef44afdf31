"""Expert parallelism (``ep``, and ``ep_balanced`` with speed-proportional batch shares).

DDP holds the dense part; the experts of every MoE layer are sliced over an
expert-parallel (EP) group and reached through all-to-all. Ranks form ``world / ep_size``
EP groups of consecutive ranks; rank ``i`` of every EP group holds the same experts, so
ranks with equal ``i`` form a replica group. Everything is applied from outside the model:
slice experts, swap dispatchers, reduce expert gradients, gather expert tensors for
placement-independent state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_hetermoe.comm as comm
from ..comm import Group
from ..contract import moe_layers

from ..moe.balance import GlobalBalance
from ..placement import Placement
from .backend import DenseDDPBackend, Simulated, StepFn, TailShape
from .batch import batch_size, gather_global_batch, weighted_share
from .ep_dispatch import AllToAllDispatcher
from .expert_state import gather_experts, slice_experts


@dataclass
class ExpertParallelGroups:
    ep_size: int
    ep_group: Group  # this rank's EP group: rows (device), split counts (host)
    replica_group: Group  # the ranks holding the same experts in the other EP groups
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
            g = comm.new_group(f"ep{d}", range(d * ep_size, (d + 1) * ep_size), host=True)
            ep_group = g if g.member else ep_group
        for i in range(ep_size):
            g = comm.new_group(f"ep_replicas{i}", range(i, world, ep_size))
            replica_group = g if g.member else replica_group
        return cls(ep_size, ep_group, replica_group, rank % ep_size, world)


def global_balance_counts(counts: Tensor) -> Tensor:
    """Routing counts summed over every data-parallel rank: the global ``f`` of the balance
    loss (see :mod:`lightning_hetermoe.moe.balance`); on the device, where the loss uses them."""
    counts = counts.clone()
    comm.all_reduce(comm.world(), counts, what="ep.balance")
    return counts


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
                comm.all_reduce(groups.replica_group, p.grad, what="ep.grads.replicas")
            p.grad.div_(groups.world_size)


def expert_grad_sq_norm(module: nn.Module, groups: ExpertParallelGroups, device: torch.device) -> Tensor:
    """Squared norm of all expert gradients of the model, each expert counted once (a copy
    of an expert on ``n`` ranks counts ``1/n`` on each)."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for _, layer in moe_layers(module):
        disp = layer.dispatcher
        ids = disp.placement[disp.rank]
        weight = comm.to_device(torch.tensor([1.0 / len(disp.copies[e]) for e in ids], dtype=torch.float64,
                                             device="cpu"), device)
        for p in layer.experts.parameters(recurse=False):
            if p.grad is not None and p.numel():
                per_slot = p.grad.detach().double().square().reshape(p.shape[0], -1).sum(1)
                local = local + (per_slot * weight).sum()
    comm.all_reduce(groups.ep_group, local, what="ep.clip")
    return local


class ExpertParallelBackend(DenseDDPBackend):
    """``ep_size`` ranks per EP group; ``balanced``: each rank's share of the global batch
    in proportion to its device's speed (the clock's cost model)."""

    def __init__(self, ep_size: int | None, balanced: bool, clock: Any, rank: int, world_size: int,
                 device: torch.device, measure_busy: bool = False) -> None:
        self.ep_size = ep_size or world_size
        self.balanced = balanced
        self.schedule = "ep_balanced" if balanced else "ep"
        self.clock, self.rank, self.world_size, self.device = clock, rank, world_size, device
        self.measure_busy = measure_busy
        self.groups: ExpertParallelGroups | None = None
        self._sharded = False
        self._layers: list = []
        self._emulation: Any = None
        self._shares: list[int] | None = None
        self._loss_weight = 1.0

    # -- set-up and restore -------------------------------------------------------------
    def setup(self, module: nn.Module, fitting: bool) -> None:
        if self.groups is None:
            self.groups = ExpertParallelGroups.build(self.ep_size)
        if not fitting:
            # no gradients to reduce: every rank holds the whole model, rank 0's weights
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(comm.world(), t.data, 0, what="ep.weights")
            return
        self._layers = [layer for _, layer in moe_layers(module)]
        # DDP broadcasts the dense weights at wrap time; the experts stay outside DDP, so
        # rank 0's experts go everywhere before anyone slices its own.
        for layer in self._layers:
            for p in layer.experts.parameters(recurse=False):
                comm.broadcast(comm.world(), p.data, 0, what="ep.weights")
        held = Placement.contiguous(len(self._layers), self._layers[0].num_experts, self.ep_size) \
            if self._layers else None
        for l, layer in enumerate(self._layers):
            slice_experts(layer, held.experts_of(self.groups.ep_rank, l))
            layer.dispatcher = AllToAllDispatcher(self.groups.ep_group, held.layer(l))
            layer.balance = GlobalBalance(global_balance_counts)
        self._sharded = bool(self._layers)
        self._report(held)
        self._emulation = self.clock.install(module, self.device, self.measure_busy)
        self._shares = None  # computed from the first global batch

    def _report(self, held: Placement | None) -> None:
        if self.rank != 0 or held is None:
            return
        sizes = [len(p) for p in held.held[0]]
        uneven = " (uneven split)" if len(set(sizes)) > 1 else ""
        # rank_zero_info reaches plain scripts too (Lightning's logger prints INFO), not only Hydra runs
        rank_zero_info(f"hetermoe[{self.schedule}]: {held.num_layers} MoE layers, experts per EP rank {sizes}{uneven}, "
                       f"{self.world_size // self.ep_size} replica(s)")

    # -- the step -----------------------------------------------------------------------
    def step(self, module: nn.Module, hook: str, default: StepFn, precision: Any, args: tuple,
             kwargs: dict) -> Any:
        if self.balanced and hook == "training_step" and args:
            args = (self._speed_share(args[0]),) + tuple(args[1:])
        return default(*args, **kwargs)

    def _speed_share(self, batch: Any) -> Any:
        """This rank's speed-proportional share of the global batch."""
        full = gather_global_batch(batch)
        total = batch_size(full)
        if self._shares is None or sum(self._shares) != total:
            self._shares = self.clock.speed_shares(total)
        mine, self._loss_weight = weighted_share(full, self._shares, self.rank)
        return mine

    @property
    def shares(self) -> list[int] | None:
        """Sequences per rank of the last step (``ep_balanced``)."""
        return None if self._shares is None else list(self._shares)

    def sync_grads(self, module: nn.Module) -> None:
        if self._sharded:
            reduce_expert_grads(module, self.groups)

    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter]) -> Tensor:
        expert_ids = {id(p) for layer in self._layers for p in layer.experts.parameters()}
        dense_sq = sum((p.grad.detach().double().square().sum() for p in params if id(p) not in expert_ids),
                       torch.zeros((), dtype=torch.float64, device=self.device))
        if not self._sharded:
            return dense_sq
        return dense_sq + expert_grad_sq_norm(module, self.groups, self.device)

    # -- experts ------------------------------------------------------------------------
    def placement(self) -> Placement | None:
        if not self._sharded:
            return None
        return Placement([layer.dispatcher.placement for layer in self._layers])

    def holder_index(self) -> int:
        return self.groups.ep_rank

    def holder_devices(self) -> list[str]:
        names = [d.name for d in self.clock.devices] or ["cpu"] * self.world_size
        return names[: self.ep_size]

    def gather_experts(self, layer: int, local: Tensor, name: str = "") -> Tensor:
        return gather_experts(local, self._layers[layer].dispatcher.placement, self.groups.ep_group)

    def adopt_placement(self, placement: Placement) -> None:
        for l, layer in enumerate(self._layers):
            # in place: a new dispatcher would drop the emulated clock's exchange wrapper
            layer.dispatcher.set_placement(placement.layer(l))

    # -- timing -------------------------------------------------------------------------
    def tail_shape(self) -> TailShape:
        held = sum(layer.experts.num_local_experts for layer in self._layers)
        return TailShape(experts_held=held, has_attention=True, replicas=self.world_size // self.ep_size,
                         attention_dp=self.world_size)

    def simulated(self, placement: Placement | None = None) -> Simulated:
        return Simulated(self.schedule, ep_size=self.ep_size, placement=placement)

    def describe_rank(self, rank: int) -> str:
        names = [d.name for d in self.clock.devices]
        return f"{self.schedule} rank, device {names[rank] if rank < len(names) else '?'}"
