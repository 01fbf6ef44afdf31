"""Expert parallelism (``ep``, and ``ep_balanced`` with speed-proportional batch shares).

DDP holds the dense part; the experts of every MoE layer are sliced over an
expert-parallel (EP) group and reached through all-to-all. Ranks form ``world / ep_size``
EP groups of consecutive ranks; rank ``i`` of every EP group holds the same experts, so
ranks with equal ``i`` form a replica group. Everything is applied from outside the model:
slice experts, swap dispatchers, reduce expert gradients, gather expert tensors for
placement-independent state.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ....model_contract import moe_layers
from ....moe.balance import GlobalBalance
from ....placement import Placement
from ...expert_state import gather_experts, slice_experts
from ....materialize import Holding, Materializer
from ..base import DenseDDPBackend, Simulated, StepFn, TailShape, GlobalBalanceCounts
from .dispatch import AllToAllDispatcher
from .grads import expert_grad_sq_norm, reduce_expert_grads
from .groups import ExpertParallelGroups


class ExpertParallelBackend(DenseDDPBackend):
    """``ep_size`` ranks per EP group; ``balanced``: each rank's share of the global batch
    in proportion to its device's speed (the clock's cost model); ``replica_dispatch``:
    which copy of a replicated expert serves a token (:mod:`lightning_hetermoe.copy_routing`)."""

    def __init__(self, ep_size: int | None, balanced: bool, clock: Any, rank: int, world_size: int,
                 device: torch.device, measure_busy: bool = False, replica_dispatch: str = "local_first") -> None:
        self.replica_dispatch = replica_dispatch
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
    def setup(self, module: nn.Module, fitting: bool, materialize: Materializer | None = None) -> None:
        if self.groups is None:
            self.groups = ExpertParallelGroups.build(self.ep_size)
        if not self._sharded:
            self._layers = [layer for _, layer in moe_layers(module)]
            held = Placement.contiguous(len(self._layers), self._layers[0].num_experts, self.ep_size) \
                if self._layers else None
            rows = [held.experts_of(self.groups.ep_rank, l) for l in range(len(self._layers))]
            if materialize is not None:
                materialize(module, Holding(dense=True, rows=rows))
            else:  # rank 0's values already (the strategy broadcast them before planning)
                for layer, mine in zip(self._layers, rows, strict=True):
                    slice_experts(layer, mine)
            for l, layer in enumerate(self._layers):
                layer.dispatcher = AllToAllDispatcher(self.groups.ep_group, held.layer(l), self.replica_dispatch,
                                                      self._nodes())
                layer.dispatcher.guard = functools.partial(self.guard_outside_step, self.groups.ep_group, l)
                layer.balance = GlobalBalance(GlobalBalanceCounts())
                layer.real_tokens = self.real_tokens
            self._sharded = bool(self._layers)
            self._report(held)
        if fitting and self._emulation is None:
            self._emulation = self.clock.install(module, self.device, self.measure_busy)
        self._shares = None  # computed from the first global batch

    def _nodes(self, ranks: list[int] | None = None) -> list[int] | None:
        """Each EP group rank's node (local-first dispatch), where the run names a topology:
        this rank's group's, or ``ranks``'."""
        if self.clock.cluster is None and self.clock.topology is None:
            return None
        node_of = self.clock.links().node_of
        return [node_of[r] for r in (ranks if ranks is not None else self.groups.ep_group.ranks)]

    def copy_routing(self) -> tuple[str, list[float], list[int] | None] | None:
        # A route is per EP group (a source's share for each copy, by EP rank), and one
        # placement serves every group: with several, routes are built only where the
        # groups are alike (the same devices, batch shares and node pattern, rank by rank),
        # so that what balances one balances each.
        shares = [float(s) for s in (self.shares or [1] * self.world_size)]
        groups = [list(range(g, g + self.ep_size)) for g in range(0, self.world_size, self.ep_size)]
        names = [d.name for d in self.clock.devices] or ["cpu"] * self.world_size

        def kind(ranks: list[int]) -> tuple:
            nodes = self._nodes(ranks)
            pattern = None if nodes is None else tuple(nodes.index(n) for n in nodes)
            return tuple(names[r] for r in ranks), tuple(shares[r] for r in ranks), pattern

        if any(kind(g) != kind(groups[0]) for g in groups[1:]):
            return None
        return self.replica_dispatch, shares[: self.ep_size], self._nodes()

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
        return default(*self.step_args(module, hook, args, speed=self.balanced), **kwargs)

    def sync_grads(self, module: nn.Module) -> None:
        self.sum_dense_grads(module)
        if self._sharded:
            reduce_expert_grads(module, self.groups)

    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter], dense_sq: Tensor | None = None) -> Tensor:
        dense_sq = self.dense_grad_sq_norm(params, dense_sq)
        if not self._sharded:
            return dense_sq
        return dense_sq + expert_grad_sq_norm(module, self.groups, self.device, {id(p) for p in params})

    # -- experts ------------------------------------------------------------------------
    def placement(self) -> Placement | None:
        if not self._sharded:
            return None
        routes = [layer.dispatcher.routes for layer in self._layers]
        return Placement([layer.dispatcher.placement for layer in self._layers],
                         routes if any(r is not None for r in routes) else None)

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
            layer.dispatcher.set_placement(placement.layer(l), placement.layer_routes(l))

    # -- timing -------------------------------------------------------------------------
    def tail_shape(self) -> TailShape:
        held = sum(layer.experts.num_local_experts for layer in self._layers)
        me = self.rank % self.ep_size
        return TailShape(experts_held=held, has_attention=True, replicas=self.world_size // self.ep_size,
                         attention_dp=self.world_size, dense_ranks=tuple(range(self.world_size)),
                         replica_ranks=tuple(r for r in range(self.world_size) if r % self.ep_size == me))

    def simulated(self, placement: Placement | None = None) -> Simulated:
        return Simulated(self.schedule, ep_size=self.ep_size, placement=placement,
                         replica_dispatch=self.replica_dispatch)
