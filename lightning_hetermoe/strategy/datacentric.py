"""Data-centric expert training (HEXA-MoE, ``mode="datacentric"``): the experts go to the tokens.

* **Experts sharded over every rank.** Each stacked expert parameter (``[E, ...]``) of
  every MoE layer is flattened and cut into one contiguous range per rank, the ranges in
  proportion to the ranks' device memory (:func:`shard_ranges`). The optimizer sees the
  ranges: its state is sharded with them.
* **Gathered per layer, ahead of use.** When a layer's experts are about to run, the
  layer's full tensors are all-gathered (the next layer's gather was issued when this one
  began, so it overlaps this layer's compute), used, and dropped: the expert computation is
  a checkpointed region, so autograd keeps the ranges, never the full weights, and the
  backward gathers the layer again. At most two layers' full experts are alive at once.
* **Gradients reduce-scattered.** The backward of a gather sums the full-weight gradient
  over the ranks and each keeps its range (divided by the world size, as DDP averages the
  dense gradients).
* **Tokens never leave their rank**: no all-to-all. Dense parameters are data-parallel
  (DDP); each rank takes a share of the global batch in proportion to its device's speed,
  its loss weighted by ``share * world / total``, so the update equals one process on the
  global batch.

Why hand-written gathers and not FSDP2's ``fully_shard``: FSDP2 shards each parameter in
equal ``Shard(0)`` pieces (the pieces here follow memory), turns the parameters into
DTensors (every path of the pack that touches expert tensors, the checkpoint gathering,
the optimizer-state slicing on resume, the clipping norm, the agreed overflow check of
the loss scaler, would need a DTensor variant) and would wrap modules inside a strategy
that is already Lightning's DDP. The gathers here are two collectives per layer on
padded equal chunks (``all_gather_into_tensor``, ``reduce_scatter_tensor``: both on
NCCL and on gloo), on a process group of their own, in the same order on every rank.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import lightning_hetermoe.comm as comm
from ..comm import Group, Pending
from ..contract import moe_layers
from ..moe.balance import GlobalBalance
from ..moe.dispatch import scatter_to_slots, sort_choices
from ..simulate.schedules import apportion
from .backend import DenseDDPBackend, Simulated, StepFn, TailShape
from .batch import batch_size, gather_global_batch, weighted_share
from .expert_parallel import global_balance_counts


@dataclass(frozen=True)
class Shard:
    """Where one expert parameter's elements live: rank ``r`` holds the flat range
    ``[starts[r], starts[r] + sizes[r])``; collectives move padded chunks of ``chunk``."""

    shape: tuple[int, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def chunk(self) -> int:
        return max(max(self.sizes), 1)

    def padded(self, part: Tensor, rank: int) -> Tensor:
        out = part.new_zeros(self.chunk)
        out[: self.sizes[rank]] = part
        return out

    def unpad(self, gathered: Tensor) -> Tensor:
        """The full tensor from ``world`` padded chunks laid end to end."""
        pieces = [gathered[r * self.chunk: r * self.chunk + n] for r, n in enumerate(self.sizes)]
        return torch.cat(pieces).view(self.shape)

    def spread(self, full: Tensor) -> Tensor:
        """``full`` laid out as ``world`` padded chunks (what a reduce-scatter takes)."""
        flat = full.reshape(-1)
        out = flat.new_zeros(len(self.sizes) * self.chunk)
        for r, (s, n) in enumerate(zip(self.starts, self.sizes)):
            out[r * self.chunk: r * self.chunk + n] = flat[s: s + n]
        return out

    def part(self, full: Tensor, rank: int) -> Tensor:
        return full.reshape(-1)[self.starts[rank]: self.starts[rank] + self.sizes[rank]].clone()


def shard_ranges(shape: tuple[int, ...], weights: list[float]) -> Shard:
    """Contiguous ranges of a flattened tensor of ``shape``, in proportion to ``weights``."""
    sizes = apportion(math.prod(shape), weights)
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return Shard(tuple(shape), tuple(starts), tuple(sizes))


class _Gathered(torch.autograd.Function):
    """Forward: the full tensor (already gathered, or gathered now). Backward: the full
    gradient reduce-scattered onto this rank's range, averaged over the world."""

    @staticmethod
    def forward(ctx, part: Tensor, full: Tensor, shard: Shard, disp: "DataCentricDispatcher") -> Tensor:
        ctx.shard, ctx.disp = shard, disp
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.disp.reduce_scatter(ctx.shard, grad), None, None, None


class DataCentricDispatcher:
    """The layer's experts, run here on full weights gathered for the call; no tokens move.

    ``weights`` and ``reduce_scatter`` are the layer's two collectives, as methods so
    that the emulated clock can wrap them (as it wraps an all-to-all dispatcher's
    ``exchange``); ``issued_at`` says when the layer's forward gather was issued."""

    def __init__(self, layer: int, backend: "DataCentricBackend") -> None:
        self.layer, self.backend = layer, backend

    @property
    def issued_at(self) -> float | None:
        return self.backend.issued_at.get(self.layer)

    @property
    def move_fraction(self) -> float:
        """What each rank moves per gather, as a fraction of the layer: ``W - 1`` chunks
        padded to the largest range."""
        shards = self.backend.shards[self.layer].values()
        total = sum(math.prod(s.shape) for s in shards)
        return sum((len(s.sizes) - 1) * s.chunk for s in shards) / total if total else 0.0

    def weights(self, names: list[str], parts: tuple[Tensor, ...]) -> list[Tensor]:
        return self.backend.full_weights(self.layer, names, parts, self)

    def reduce_scatter(self, shard: Shard, grad: Tensor) -> Tensor:
        return self.backend.reduce_scatter(shard, grad)

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor, experts) -> Tensor:
        E = self.backend.num_experts[self.layer]
        sc = sort_choices(indices, keep, torch.arange(E, device=x.device))  # every expert runs here
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        parts = [p for _, p in experts.named_parameters(recurse=False)]

        def run(x: Tensor, *parts: Tensor) -> Tensor:
            fulls = self.weights(names, parts)
            return functional_call(experts, dict(zip(names, fulls)), (x, sc.token, sc.counts))

        self.backend.prefetch(self.layer)  # no-op when the previous layer already issued it
        if torch.is_grad_enabled():
            # checkpointed: autograd keeps x and the ranges, and the backward gathers again;
            # recomputed to the end (no early stop), so the experts' recompute is one whole task
            with set_checkpoint_early_stop(False):
                out = checkpoint(run, x, *parts, use_reentrant=False)
        else:
            out = run(x, *parts)
        return scatter_to_slots(out, sc.slot, indices.numel())


class DataCentricBackend(DenseDDPBackend):
    schedule = "datacentric"

    def __init__(self, clock: Any, rank: int, world_size: int, device: torch.device) -> None:
        self.clock, self.rank, self.world_size, self.device = clock, rank, world_size, device
        self.group: Group | None = None
        self._layers: list = []
        self.shards: list[dict[str, Shard]] = []
        self.num_experts: list[int] = []
        self._sharded = False
        self._prefetched: dict[int, list[tuple[Pending, Shard]]] = {}
        self.issued_at: dict[int, float] = {}  # when each layer's last gather was issued
        self._shares: list[int] | None = None
        self._loss_weight = 1.0
        self._emulation: Any = None
        # accounting of full expert weights alive (what the memory test reads)
        self.alive_bytes = 0
        self.peak_alive_bytes = 0
        self.layer_bytes: list[int] = []

    # -- set-up and restore -------------------------------------------------------------
    def setup(self, module: nn.Module, fitting: bool) -> None:
        if self.group is None:
            self.group = comm.new_group("datacentric", range(self.world_size))
        if not fitting:
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(comm.world(), t.data, 0, what="datacentric.weights")
            return
        self._layers = [layer for _, layer in moe_layers(module)]
        weights = [d.memory_gb for d in self.clock.devices] if len(self.clock.devices) == self.world_size \
            else [1.0] * self.world_size
        self.shards, self.num_experts, self.layer_bytes = [], [], []
        for l, layer in enumerate(self._layers):
            shards = {}
            nbytes = 0
            for name, p in list(layer.experts.named_parameters(recurse=False)):
                comm.broadcast(comm.world(), p.data, 0, what="datacentric.weights")
                shard = shard_ranges(tuple(p.shape), weights)
                shards[name] = shard
                nbytes += p.numel() * p.element_size()
                setattr(layer.experts, name, nn.Parameter(shard.part(p.data, self.rank),
                                                          requires_grad=p.requires_grad))
            self.shards.append(shards)
            self.num_experts.append(layer.num_experts)
            self.layer_bytes.append(nbytes)
            layer.dispatcher = DataCentricDispatcher(l, self)
            layer.balance = GlobalBalance(global_balance_counts)
        self._sharded = bool(self._layers)
        self._emulation = self.clock.install(module, self.device, False)
        self._shares = None

    # -- gathers ------------------------------------------------------------------------
    def _issue(self, layer: int, names: list[str], parts: list[Tensor]) -> list[tuple[Pending, Shard]]:
        self.issued_at[layer] = time.perf_counter()
        issued = []
        for name, part in zip(names, parts):
            shard = self.shards[layer][name]
            out = part.new_empty(self.world_size * shard.chunk)
            # a layer's full weights count from the moment they are in flight (the padding not)
            # until they are unpadded (the communication library may hold its buffer a moment longer)
            self._grow(math.prod(shard.shape) * out.element_size())
            with comm.issuing(after=[part]):
                pending = comm.all_gather_into(self.group, out, shard.padded(part.detach(), self.rank),
                                               what=f"datacentric.gather.{layer}", async_op=True)
            issued.append((pending, shard))
        return issued

    def prefetch(self, layer: int) -> None:
        """Issue layer ``layer``'s gathers now (every rank reaches this at the same point)."""
        if layer >= len(self._layers) or layer in self._prefetched:
            return
        experts = self._layers[layer].experts
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        self._prefetched[layer] = self._issue(layer, names, [p for _, p in experts.named_parameters(recurse=False)])

    def full_weights(self, layer: int, names: list[str], parts: tuple[Tensor, ...], disp: DataCentricDispatcher
                     ) -> list[Tensor]:
        """Layer ``layer``'s full expert tensors, each differentiable into its range."""
        issued = self._prefetched.pop(layer, None)
        if issued is None or torch._C._current_graph_task_id() != -1:
            if issued is not None:  # a stale prefetch (recompute inside a backward): finish it, gather afresh
                for pending, _ in issued:
                    pending.wait()
            issued = self._issue(layer, names, list(parts))
        fulls = [self._unpad(issued, part, disp) for part in parts]  # each padded buffer dropped once unpadded
        if torch._C._current_graph_task_id() == -1:
            self.prefetch(layer + 1)  # overlaps this layer's compute
        return fulls

    def _unpad(self, issued: list[tuple[Pending, Shard]], part: Tensor, disp: DataCentricDispatcher) -> Tensor:
        pending, shard = issued.pop(0)
        full = _Gathered.apply(part, shard.unpad(pending.wait()), shard, disp)
        n = full.numel() * full.element_size()
        self._grow(n)  # the full tensor, alive until the computation lets go of it
        weakref.finalize(full, self._freed, n)
        self._freed(n)  # the buffer it came in
        return full

    def _grow(self, n: int) -> None:
        self.alive_bytes += n
        self.peak_alive_bytes = max(self.peak_alive_bytes, self.alive_bytes)

    def _freed(self, n: int) -> None:
        self.alive_bytes -= n

    def reduce_scatter(self, shard: Shard, grad: Tensor) -> Tensor:
        out = grad.new_empty(shard.chunk)
        comm.reduce_scatter(self.group, out, shard.spread(grad.contiguous()), what="datacentric.grads")
        return out[: shard.sizes[self.rank]].div_(self.world_size)

    # -- the step -----------------------------------------------------------------------
    def step(self, module: nn.Module, hook: str, default: StepFn, precision: Any, args: tuple,
             kwargs: dict) -> Any:
        if hook == "training_step" and args:
            args = (self._share(args[0]),) + tuple(args[1:])
        try:
            return default(*args, **kwargs)
        finally:
            self._finish_prefetch()

    def _finish_prefetch(self) -> None:
        for issued in self._prefetched.values():
            for pending, _ in issued:
                pending.wait()
        self._prefetched.clear()

    def _share(self, batch: Any) -> Any:
        """This rank's speed-proportional share of the global batch."""
        full = gather_global_batch(batch)
        total = batch_size(full)
        if self._shares is None or sum(self._shares) != total:
            self._shares = self.clock.speed_shares(total) if len(self.clock.devices) == self.world_size \
                else apportion(total, [1.0] * self.world_size)
        mine, self._loss_weight = weighted_share(full, self._shares, self.rank)
        return mine

    @property
    def shares(self) -> list[int] | None:
        return None if self._shares is None else list(self._shares)

    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter]) -> Tensor:
        expert_ids = {id(p) for layer in self._layers for p in layer.experts.parameters()}
        dense = sum((p.grad.detach().double().square().sum() for p in params if id(p) not in expert_ids),
                    torch.zeros((), dtype=torch.float64, device=self.device))
        experts = sum((p.grad.detach().double().square().sum() for layer in self._layers
                       for p in layer.experts.parameters() if p.grad is not None),
                      torch.zeros((), dtype=torch.float64, device=self.device))
        comm.all_reduce(self.group, experts, what="datacentric.clip")  # the ranges partition every expert
        return dense + experts

    # -- experts ------------------------------------------------------------------------
    def gather_experts(self, layer: int, local: Tensor, name: str = "") -> Tensor:
        shard = self.shards[layer][name]
        out = local.new_empty(self.world_size * shard.chunk)
        comm.all_gather_into(self.group, out, shard.padded(local.detach().reshape(-1), self.rank),
                             what="datacentric.checkpoint")
        return shard.unpad(out)

    def local_part(self, layer: int, name: str, full: Tensor, local: Tensor) -> Tensor | None:
        shard = self.shards[layer][name]
        return shard.part(full, self.rank) if tuple(full.shape) == shard.shape else None

    # -- timing -------------------------------------------------------------------------
    def tail_shape(self) -> TailShape:
        return TailShape(experts_held=sum(self.num_experts) // max(self.world_size, 1), has_attention=True,
                         replicas=1, attention_dp=self.world_size)

    def simulated(self, placement=None) -> Simulated:
        return Simulated("datacentric", ep_size=self.world_size)

    def describe_rank(self, rank: int) -> str:
        names = [d.name for d in self.clock.devices]
        return f"datacentric rank, device {names[rank] if rank < len(names) else '?'}"
