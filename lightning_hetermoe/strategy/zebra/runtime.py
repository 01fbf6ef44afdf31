"""A plan, applied to the user's module on this rank, and one step of it.

* **Roles and memory.** Attention ranks keep the dense model (embeddings, attention,
  routers, norms, head) and the experts the plan puts on them (Asym-EA); expert ranks keep
  only their experts: their dense parameters become empty tensors before the optimizer is
  built, so they get no gradients and no optimizer state.
* **Start-up.** Rank 0's weights, dense and experts, are broadcast before anyone slices, so
  differently seeded ranks start equal (DDP would do it for dense weights; there is no DDP
  here).
* **A step.** The global batch is cut into each attention rank's share (the plan's
  ``seqs_per_rank``, scaled when a batch differs), each share into ``R`` micro-batches, and
  :class:`~.executor.StepRun` runs this rank's list. Micro-batch ``j`` weighs
  ``n_j / N`` of the global batch, so summing gradients (not averaging them) gives the
  gradient of the global mean loss:
  dense gradients are summed over every attention rank of every ZP group, expert gradients
  over the copies of the same expert in the other ZP groups.
* **State.** Checkpoints take dense weights from the first attention rank and every
  expert gathered within a ZP group: they do not depend on the placement.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...contract import find_blocks
from ...moe import LocalDispatcher
from ...moe.balance import LocalBalance, balance_loss_from_counts, routed_counts
from ...plan import Plan
from ...schedule import Schedule, build_schedule
from ...simulate.schedules import apportion, split_microbatches
from ..batch import split_sizes, take
from ..expert_parallel import gather_experts, slice_experts
from . import fibers
from .comm import Exchange
from .cuts import BlockCuts
from .executor import ExpertTasks, StepInput, StepOutput, StepRun, ZebraContractError
from .layout import Layout, ZebraGroups


class ZebraDispatcher:
    """Swapped into each MoE layer on attention ranks: hands the rows to the step's rounds."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor, experts) -> Tensor:
        fiber = fibers.current()
        if fiber is None:
            raise ZebraContractError("the model ran outside the zebra executor while the strategy owns it; run "
                                     "it through the Trainer (training/validation/test/predict steps)")
        return fiber.step.dispatch(self.layer, x, indices, keep)


class ZebraBalance:
    """The balance loss with expert fractions over the whole step's tokens (see schedule)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, probs: Tensor, indices: Tensor) -> Tensor:
        fiber = fibers.current()
        counts = fiber.step.balance_counts(self.layer, indices) if fiber is not None else \
            routed_counts(indices, probs.shape[-1])
        return balance_loss_from_counts(probs, counts)


class ZebraRuntime:
    def __init__(self, plan: Plan, mode: str, rank: int, *, balance: bool, device: torch.device,
                 clock: Any = None, timeout_s: float = 1800.0) -> None:
        if mode not in ("zebra", "distep"):
            raise ValueError(f"zebra runtime mode {mode!r}: must be zebra or distep")
        self.plan, self.mode, self.device, self.clock, self.timeout_s = plan, mode, device, clock, timeout_s
        self.layout = Layout.from_plan(plan, rank, plan.placement_for(mode))
        L = self.layout.num_layers
        self.num_microbatches = (plan.distep_microbatches or 1) if mode == "distep" else plan.num_microbatches
        self.schedule = build_schedule(mode, L, self.num_microbatches, balance=balance)
        self.forward_schedule = build_schedule("forward", L, self.num_microbatches, balance=balance)
        self.groups = ZebraGroups.build(self.layout)
        self._stripped: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._cuts: BlockCuts | None = None
        self.layers: list = []
        self.experts: ExpertTasks | None = None
        self.applied = False
        self.d_model = 0
        self.dtype = torch.float32
        self.last: StepOutput | None = None

    # -- module layout ------------------------------------------------------------------
    def apply(self, module: nn.Module) -> None:
        if self.applied:
            return
        blocks = find_blocks(module)
        self.layers = [moe for _, _, moe in blocks]
        if len(self.layers) != self.layout.num_layers:
            raise ZebraContractError(f"the plan is for {self.layout.num_layers} MoE layers, the model has "
                                     f"{len(self.layers)}")
        self.d_model = self.layers[0].router.weight.shape[1]
        self.dtype = self.layers[0].experts.w_up.dtype
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)  # rank 0's weights everywhere, before anyone slices
        expert_ids = self._expert_param_ids()
        for l, layer in enumerate(self.layers):
            slice_experts(layer, self.layout.mine(l))
        expert_ids = self._expert_param_ids()
        if not self.layout.is_attention:
            for name, p in module.named_parameters():
                if id(p) not in expert_ids:
                    self._stripped[name] = (p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        else:
            for l, layer in enumerate(self.layers):
                layer.dispatcher = ZebraDispatcher(l)
                layer.balance = ZebraBalance(l)
            self._cuts = BlockCuts([b for _, b, _ in blocks])
        self.experts = ExpertTasks(self.layout, self.layers, self.device)
        self.applied = True

    def restore(self, module: nn.Module) -> None:
        """Every rank ends with the whole model again, local dispatch (after a fit)."""
        if not self.applied:
            return
        for l, layer in enumerate(self.layers):
            ex = layer.experts
            for pname, p in list(ex.named_parameters(recurse=False)):
                full = self.gather_layer(l, p.detach())
                setattr(ex, pname, nn.Parameter(full, requires_grad=p.requires_grad))
            ex.expert_ids = torch.arange(layer.num_experts, device=ex.expert_ids.device)
            layer.dispatcher = LocalDispatcher()
            layer.balance = LocalBalance()
        params = dict(module.named_parameters())
        for name, (shape, dtype) in self._stripped.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        expert_ids = self._expert_param_ids()
        for p in module.parameters():
            if id(p) not in expert_ids:
                dist.broadcast(p.data, src=self.layout.saver)
        self._stripped.clear()
        if self._cuts is not None:
            self._cuts.remove()
            self._cuts = None
        self.applied = False

    def set_layer_placement(self, layer: int, per_member: list[list[int]]) -> None:
        """Layer ``layer``'s experts now live as ``per_member`` says (member order; no copies)."""
        row = [0] * self.layout.num_experts
        for m, held in enumerate(per_member):
            for e in held:
                row[e] = m
        self.layout.placement[layer] = row

    def placement_changed(self) -> None:
        """After a move: the exchange layout follows the new placement (and so does the plan
        the simulator and checkpoints read)."""
        self.plan.placement = [list(r) for r in self.layout.placement]
        self.experts = ExpertTasks(self.layout, self.layers, self.device)

    def _expert_param_ids(self) -> set[int]:
        return {id(p) for layer in self.layers for p in layer.experts.parameters(recurse=False)}

    def dense_params(self, module: nn.Module) -> list[nn.Parameter]:
        expert_ids = self._expert_param_ids()
        return [p for p in module.parameters() if id(p) not in expert_ids]

    def gather_layer(self, layer: int, local: Tensor) -> Tensor:
        """Full ``[E, ...]`` expert tensor of ``layer`` from this ZP group's slices."""
        return gather_experts(local, self.layout.by_group_rank(layer), self.groups.zp)

    # -- the batch ----------------------------------------------------------------------
    def shares(self, total: int) -> list[tuple[int, int]]:
        """``(start, count)`` of every attention rank's share, in global rank order."""
        att = self.plan.attention_ranks
        planned = [self.plan.seqs_per_rank[r] for r in att]
        sizes = planned if sum(planned) == total else apportion(total, [max(s, 1) for s in planned])
        return split_sizes(total, sizes)

    def step_input(self, global_batch: Any, total: int, run: Callable[[Any, int], Any] | None,
                   context: Callable[[], Any] | None, train: bool, accumulate: int = 1) -> StepInput:
        R = self.num_microbatches
        if not self.layout.is_attention:
            return StepInput([None] * R, [0] * R, [0.0] * R, None, None, train)
        start, count = self.shares(total)[self.plan.attention_ranks.index(self.layout.rank)]
        sizes = split_microbatches(count, R)
        mbs, weights, at = [], [], start
        for n in sizes:
            mbs.append(take(global_batch, at, n) if n else None)
            weights.append(n / total / accumulate)
            at += n
        return StepInput(mbs, sizes, weights, run, context, train)

    def run_step(self, step: StepInput, task_context: Callable[[], Any] | None = None) -> StepOutput:
        schedule: Schedule = self.schedule if step.train else self.forward_schedule
        exchange = Exchange(self.layout, self.groups, schedule, d_model=self.d_model, dtype=self.dtype,
                            device=self.device, emulator=self.clock, timeout_s=self.timeout_s)
        tasks = schedule.member_tasks(self.layout.is_attention, self.layout.holds())
        run = StepRun(self.layout, schedule, exchange, self.layers, self.experts, step, clock=self.clock,
                      d_model=self.d_model, task_context=task_context or nullcontext)
        self.last = run.run(tasks)
        self.last.transfer_s = exchange.transfer_s
        return self.last

    # -- gradients ----------------------------------------------------------------------
    def sync_grads(self, module: nn.Module) -> None:
        for layer in self.layers:
            for p in layer.experts.parameters(recurse=False):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if len(self.plan.zp_groups) > 1:
                    dist.all_reduce(p.grad, group=self.groups.replicas)
        if not self.layout.is_attention:
            return
        dense = self.dense_params(module)
        for p in dense:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if len(self.plan.attention_ranks) > 1 and dense:
            flat = torch.cat([p.grad.reshape(-1) for p in dense])
            dist.all_reduce(flat, group=self.groups.dense)
            at = 0
            for p in dense:
                n = p.numel()
                p.grad.copy_(flat[at:at + n].view_as(p.grad))
                at += n

    def grad_sq_norm(self, module: nn.Module) -> Tensor:
        """Squared global norm: every expert once, the dense part once (from the group's
        first attention rank), summed within the ZP group (groups are identical)."""
        sq = torch.zeros((), dtype=torch.float64)
        for layer in self.layers:
            for p in layer.experts.parameters(recurse=False):
                if p.grad is not None:
                    sq = sq + p.grad.detach().double().square().sum().cpu()
        if self.layout.rank == self.layout.attention_members[0]:
            for p in self.dense_params(module):
                if p.grad is not None:
                    sq = sq + p.grad.detach().double().square().sum().cpu()
        dist.all_reduce(sq, group=self.groups.zp)
        return sq
