"""Data-centric expert training (HEXA-MoE, ``mode="datacentric"``): the experts go to the tokens.

* **Experts sharded over every rank.** Each stacked expert parameter (``[E, ...]``) of
  every MoE layer is flattened and cut into one contiguous range per rank, the ranges in
  proportion to the ranks' device memory (:func:`shard_ranges`). The optimizer sees the
  ranges: its state is sharded with them.
* **Gathered per layer, ahead of use.** When a layer's experts are about to run, the
  layer's full tensors are all-gathered (the next layer's gather was issued when this one
  began, so it overlaps this layer's compute), used, and dropped: the expert computation is
  a checkpointed region, so autograd keeps the ranges, never the full weights, and the
  backward gathers the layer again, issued ahead too: the layer below's gather leaves once
  this layer's gradients are reduce-scattered, so it overlaps this layer's attention
  backward and the layer's own recompute. Where the blocks are checkpointed too, the
  backward runs a layer's experts twice (the block's recompute, then the experts' own):
  the layer gathered for the first is kept for the second, not gathered twice. At most two
  layers' full experts are alive at once.
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
from typing import Any

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ....backward import inside_backward
from ....comm import Group, Pending
from ....model_contract import moe_layers
from ....moe.balance import GlobalBalance
from ....ckpt.pieces import Pieces
from ....materialize import Holding, Materializer
from ...grad_norm import squared_norm
from ..base import DenseDDPBackend, Simulated, StepFn, TailShape, GlobalBalanceCounts
from .dispatcher import DataCentricDispatcher
from .gather import Gathered
from .shards import Shard, covering_rows, shard_ranges


class DataCentricBackend(DenseDDPBackend):
    schedule = "datacentric"

    def __init__(self, clock: Any, rank: int, world_size: int, device: torch.device) -> None:
        self.clock, self.rank, self.world_size, self.device = clock, rank, world_size, device
        self.group: Group | None = None
        self._layers: list = []
        self._layer_names: list[str] = []
        self.shards: list[dict[str, Shard]] = []
        self.num_experts: list[int] = []
        self._sharded = False
        self._prefetched: dict[int, list[tuple[Pending, Shard]]] = {}
        self._ahead_in_backward: set[int] = set()  # the layers whose gather a backward issued ahead
        self._scattered: dict[int, int] = {}  # each layer's tensors reduce-scattered in this backward
        self._wire: dict[int, list[torch.dtype]] = {}  # each layer's tensors' dtypes on the wire, last forward
        # the layer a backward gathered for a block's recompute, kept for its experts' own
        self._held: tuple[int, list[Tensor]] | None = None
        self.issued_at: dict[int, float] = {}  # when each layer's last gather was issued
        self._shares: list[int] | None = None
        self._loss_weight = 1.0
        self._emulation: Any = None
        # accounting of full expert weights alive (what the memory test reads)
        self.alive_bytes = 0
        self.peak_alive_bytes = 0
        self.layer_bytes: list[int] = []

    # -- set-up and restore -------------------------------------------------------------
    def setup(self, module: nn.Module, fitting: bool, materialize: Materializer | None = None) -> None:
        if self.group is None:
            # the world's members: the gathers, the reduce-scatters and DDP's all-reduces are
            # issued in program order by one thread at a time, so one communicator serves them
            self.group = comm.new_group("datacentric", range(self.world_size), reuse=True)
        if not self._sharded:
            self._lay_out(module, materialize)
        if fitting and self._emulation is None:
            self._emulation = self.clock.install(module, self.device, False)
        self._shares = None

    def _lay_out(self, module: nn.Module, materialize: Materializer | None) -> None:
        named = list(moe_layers(module))
        self._layers = [layer for _, layer in named]
        self._layer_names = [name for name, _ in named]
        weights = [d.memory_gb for d in self.clock.devices] if len(self.clock.devices) == self.world_size \
            else [1.0] * self.world_size
        self.shards = [{name: shard_ranges(tuple(p.shape), weights)
                        for name, p in layer.experts.named_parameters(recurse=False)} for layer in self._layers]
        if materialize is not None:
            # the expert rows this rank's ranges touch (whole rows: each expert has its own
            # generator), cut down to the ranges below
            spans = [covering_rows(shards.values(), self.rank) for shards in self.shards]
            materialize(module, Holding(dense=True, rows=[list(range(a, b)) for a, b in spans]))
        else:  # rank 0's weights already (the strategy broadcast them before planning)
            spans = [(0, layer.num_experts) for layer in self._layers]
        self.num_experts, self.layer_bytes = [], []
        for layer, shards, (first, _) in zip(self._layers, self.shards, spans, strict=True):
            nbytes = 0
            for name, p in list(layer.experts.named_parameters(recurse=False)):
                shard = shards[name]
                nbytes += math.prod(shard.shape) * p.element_size()
                setattr(layer.experts, name, nn.Parameter(shard.part(p.data, self.rank, first_row=first),
                                                          requires_grad=p.requires_grad))
            layer.experts.expert_ids = torch.arange(layer.num_experts, device=layer.experts.expert_ids.device)
            self.num_experts.append(layer.num_experts)
            self.layer_bytes.append(nbytes)
            layer.dispatcher = DataCentricDispatcher(len(self.num_experts) - 1, self)
            layer.balance = GlobalBalance(GlobalBalanceCounts())
            layer.real_tokens = self.real_tokens
        self._sharded = bool(self._layers)

    def piece_shapes(self) -> dict[str, tuple[int, ...]]:
        if not self._sharded:
            return {}
        return {f"{layer}.experts.{name}": tuple(shard.shape) for layer, shards in zip(self._layer_names, self.shards,
                                                                                     strict=True)
                for name, shard in shards.items()}

    # -- gathers ------------------------------------------------------------------------
    def _issue(self, layer: int, names: list[str], parts: list[Tensor],
               wire: list[torch.dtype] | None = None) -> list[tuple[Pending, Shard]]:
        """``wire``: each tensor's dtype on the wire (default: as the autocast state in force
        says, recorded for :meth:`scattered`'s gathers, which leave from autograd's backward,
        where autocast is off)."""
        self.issued_at[layer] = time.perf_counter()
        if wire is None:
            wire = [comm.wire_dtype(part) for part in parts]
            self._wire[layer] = wire
        issued = []
        for name, part, dtype in zip(names, parts, wire, strict=True):
            shard = self.shards[layer][name]
            # in the dtype the experts compute in; the gradients come back in fp32 (Gathered)
            part = part.detach().to(dtype)
            out = part.new_empty(self.world_size * shard.chunk)
            # a layer's full weights count from the moment they are in flight (the padding not)
            # until they are unpadded (the communication library may hold its buffer a moment longer)
            self._grow(math.prod(shard.shape) * out.element_size())
            with comm.issuing(after=[part]):
                pending = comm.all_gather_into(self.group, out, shard.padded(part, self.rank),
                                               what=f"datacentric.gather.{layer}", async_op=True)
            issued.append((pending, shard))
        return issued

    def prefetch(self, layer: int, wire: list[torch.dtype] | None = None) -> None:
        """Issue layer ``layer``'s gathers now (every rank reaches this at the same point)."""
        if layer >= len(self._layers) or layer in self._prefetched:
            return
        experts = self._layers[layer].experts
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        self._prefetched[layer] = self._issue(layer, names, [p for _, p in experts.named_parameters(recurse=False)],
                                              wire)

    def full_weights(self, layer: int, names: list[str], parts: tuple[Tensor, ...], disp: DataCentricDispatcher
                     ) -> list[Tensor]:
        """Layer ``layer``'s full expert tensors, each differentiable into its range.
        ``disp.gathered`` says afterwards whether they came over the wire for this call."""
        backward = inside_backward()
        held, self._held = self._held, None  # a kept layer serves its next use at most, then goes
        if backward and held is not None and held[0] == layer:
            disp.gathered = disp.ahead = False
            kept = [full.detach() for full in held[1]]
            # the first use's tensors go here, and with them their count (one storage, one
            # count): the second use's are counted from now on
            held = None
            return [self._alive(Gathered.apply(part, full, self.shards[layer][name], disp))
                    for name, part, full in zip(names, parts, kept, strict=True)]
        disp.gathered = True
        issued = self._prefetched.pop(layer, None)
        ahead_in_backward = layer in self._ahead_in_backward
        self._ahead_in_backward.discard(layer)
        if issued is not None and backward and not ahead_in_backward:
            # a forward's gather issued ahead and not used there: finish it, gather afresh
            for pending, _ in issued:
                pending.wait()
            issued = None
        disp.ahead = issued is not None
        if issued is None:
            issued = self._issue(layer, names, list(parts))
        fulls = [self._unpad(issued, part, disp) for part in parts]  # each padded buffer dropped once unpadded
        if not backward:
            self.prefetch(layer + 1)  # overlaps this layer's compute
        elif disp.in_block_recompute:
            # a checkpointed block's recompute: its experts' own recompute comes next, on the
            # same weights (kept as they are: counted alive until that use takes them over)
            self._held = (layer, fulls)
        return fulls

    def _unpad(self, issued: list[tuple[Pending, Shard]], part: Tensor, disp: DataCentricDispatcher) -> Tensor:
        pending, shard = issued.pop(0)
        full = self._alive(Gathered.apply(part, shard.unpad(pending.wait()), shard, disp))
        self._freed(full.numel() * full.element_size())  # the buffer it came in
        return full

    def _alive(self, full: Tensor) -> Tensor:
        """``full`` counted alive until the computation lets go of it."""
        n = full.numel() * full.element_size()
        self._grow(n)
        weakref.finalize(full, self._freed, n)
        return full

    def _grow(self, n: int) -> None:
        self.alive_bytes += n
        self.peak_alive_bytes = max(self.peak_alive_bytes, self.alive_bytes)

    def _freed(self, n: int) -> None:
        self.alive_bytes -= n

    def reduce_scatter(self, shard: Shard, grad: Tensor) -> Tensor:
        out = grad.new_empty(shard.chunk)
        comm.reduce_scatter(self.group, out, shard.spread(grad.contiguous()), what="datacentric.grads")
        # each rank backpropagated its share of the global mean loss (see backward): the sum
        return out[: shard.sizes[self.rank]]

    def scattered(self, layer: int) -> None:
        """One of ``layer``'s tensors was reduce-scattered; after the last, the layer below's
        gather leaves (every rank reaches this point in the same order), to arrive behind
        this layer's attention backward and the layer below's recompute."""
        self._scattered[layer] = self._scattered.get(layer, 0) + 1
        if self._scattered[layer] < len(self.shards[layer]):
            return
        del self._scattered[layer]
        if inside_backward() and layer > 0 and layer - 1 not in self._prefetched:
            # at the width the step's forward gathered it (autocast is off in autograd's backward)
            self.prefetch(layer - 1, self._wire.get(layer - 1))
            self._ahead_in_backward.add(layer - 1)

    def sync_grads(self, module: nn.Module) -> None:
        self.sum_dense_grads(module)

    # -- the step -----------------------------------------------------------------------
    def step(self, module: nn.Module, hook: str, default: StepFn, precision: Any, args: tuple,
             kwargs: dict) -> Any:
        args = self.step_args(module, hook, args, speed=True)
        try:
            return default(*args, **kwargs)
        finally:
            self._finish_prefetch()

    def _finish_prefetch(self) -> None:
        self._held = None
        self._ahead_in_backward.clear()
        self._scattered.clear()
        for issued in self._prefetched.values():
            for pending, _ in issued:
                pending.wait()
        self._prefetched.clear()

    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter], dense_sq: Tensor | None = None) -> Tensor:
        dense = self.dense_grad_sq_norm(params, dense_sq)
        held = {id(p) for p in params}  # an optimizer's own (manual optimization clips each over its own)
        experts = squared_norm((p.grad for layer in self._layers for p in layer.experts.parameters() if id(p) in held),
                               self.device)
        comm.all_reduce(self.group, experts, what="datacentric.clip")  # the ranges partition every expert
        return dense + experts

    # -- experts ------------------------------------------------------------------------
    def gather_experts(self, layer: int, local: Tensor, name: str = "") -> Tensor:
        shard = self.shards[layer][name]
        out = local.new_empty(self.world_size * shard.chunk)
        comm.all_gather_into(self.group, out, shard.padded(local.detach().reshape(-1), self.rank),
                             what="datacentric.checkpoint")
        return shard.unpad(out)

    def expert_pieces(self, layer: int, name: str, local: Tensor) -> Pieces:
        if not self._sharded:
            return Pieces.whole(local)
        shard = self.shards[layer][name]
        return Pieces.of_range(local, shard.starts[self.rank], shard.shape)

    def local_part(self, layer: int, name: str, full: Tensor, local: Tensor) -> Tensor | None:
        shard = self.shards[layer][name]
        return shard.part(full, self.rank) if tuple(full.shape) == shard.shape else None

    # -- timing -------------------------------------------------------------------------
    def tail_shape(self) -> TailShape:
        return TailShape(experts_held=sum(self.num_experts) // max(self.world_size, 1), has_attention=True,
                         replicas=1, attention_dp=self.world_size, dense_ranks=tuple(range(self.world_size)))

    def simulated(self, placement=None) -> Simulated:
        return Simulated("datacentric", ep_size=self.world_size)
