"""Zebra and DistEP: a plan applied to the user's module on this rank, and its steps.

* **Roles and memory.** Attention ranks keep the dense model (embeddings, attention,
  routers, norms, head) and the experts the plan puts on them (Asym-EA); expert ranks keep
  only their experts: their dense parameters become empty tensors before the optimizer is
  built, so they get no gradients and no optimizer state.
* **Start-up.** Rank 0's weights, dense and experts, are broadcast (on the device) before
  anyone slices, so differently seeded ranks start equal (there is no DDP wrapper here).
* **A step.** Every rank gathers the global batch; each attention rank takes its share
  (the plan's ``seqs_per_rank``, scaled when a batch differs), cuts it into ``R``
  micro-batches, and the executor runs this rank's task list. Micro-batch ``j`` weighs
  ``n_j / N`` of the global batch (its real tokens over the batch's, where ragged batches
  were padded to one length: its mean loss is over its real tokens), so summing gradients
  (not averaging them) gives the gradient of the global mean loss: dense gradients are
  summed over every attention rank of every ZP group, expert gradients over the copies of
  the same expert in the other ZP groups. The executor's backward runs inside the step;
  Lightning zeroes gradients between the step and ``backward()``, so the step's gradients
  are kept apart and handed over in ``backward()``.
* **Evaluation.** Validation, test and predict run the forward-only schedule on the same
  shares (a short last batch may differ between ranks: the shapes every step gathers tell
  each rank's row count too). The outputs of each row go back to the rank that loaded it,
  in its order (:mod:`.outputs`; cut back to the rank's own sequence length where ragged
  batches were padded), and logged values are the global batch's on every rank
  (:mod:`.logs`; means over real tokens where padded), so prediction writers,
  ``return_predictions`` and ``trainer.test``'s metrics are DDP's.
* **State.** Checkpoints take dense weights from the first attention rank and every expert
  gathered within a ZP group: they do not depend on the placement.
* **Gradient sync.** Dense gradients are summed over the attention ranks in buckets of at
  most :data:`BUCKET_BYTES` (:func:`dense_buckets`: by layer, last layer first, as a
  backward finishes them, then the parameters outside the blocks), each all-reduced
  asynchronously (in ``sync_grads``, not yet from the backward); a bucket of one parameter
  is reduced in place, the others through one reused buffer, so the sync holds at most one
  bucket beyond the gradients.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, nullcontext
from typing import Any, Callable

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ....model_contract import checkpoints_activations, find_blocks

from ....emulate.meter import uncovered
from ....moe.balance import balance_loss_from_counts, routed_counts
from ....moe.dispatch import keep_mask, weighted_sum
from ....placement import Placement
from ....plan import Plan
from ....profile.memory import GRAD_BUCKET_BYTES
from ....simulate.step import tail_carried
from ....task_order import answers_layered, build_schedule
from ....apportion import apportion, split_microbatches
from ....materialize import Holding, Materializer
from ..base import (ParallelBackend, Simulated, StepFn, TailShape, step_context,
                    zero_missing_grads)
from ...batch import GlobalBatch, gather_global_batch, ignore_index_of, map_batch, split_sizes, take
from ...expert_state import gather_experts, restore_local, slice_experts
from ...grad_norm import squared_norm
from . import outputs, train_outputs
from .cast_copies import recast_saved_weights
from .cuts import BlockCuts
from .exchange import Exchange
from .executor import StepInput, StepOutput, StepRun, ZebraContractError, loss_of
from .expert_tasks import ExpertTasks
from .layout import Layout, ZebraGroups
from .logs import MicrobatchLogs

# Bytes of dense gradients per all-reduce (DDP's default bucket size; the memory model
# prices one such bucket). A module constant a test may lower; each backend reads it when
# built (``ZebraBackend.bucket_bytes``).
BUCKET_BYTES = GRAD_BUCKET_BYTES


def dense_buckets(module: nn.Module, blocks: list[nn.Module], expert_ids: set[int],
                  cap: int) -> list[list[nn.Parameter]]:
    """The dense parameters of ``module`` in all-reduce buckets, the same on every attention
    rank (derived from the module's parameter order alone): the parameters of block
    ``L-1``, then ``L-2``, ... ``0`` (the order a backward finishes them), then the rest
    (embeddings, head, final norm, and any parameter registered in more than one place);
    frozen ones left out (every rank freezes alike: the buckets still match). A bucket holds
    the parameters of one layer and one dtype, at most ``cap`` bytes of them unless a single
    parameter is larger (then it is a bucket of its own)."""
    owner: dict[int, int | None] = {}
    for l, block in enumerate(blocks):
        for p in block.parameters():
            owner[id(p)] = l if owner.get(id(p), l) == l else None
    registered: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        registered[id(p)] = registered.get(id(p), 0) + 1
    for _, p in (np for block in blocks for np in block.named_parameters(remove_duplicate=False)):
        registered[id(p)] -= 1
    groups: list[list[nn.Parameter]] = [[] for _ in range(len(blocks) + 1)]
    for p in module.parameters():
        if id(p) in expert_ids or not p.requires_grad:  # a frozen one has no gradient to sum
            continue
        l = owner.get(id(p))
        inside = l is not None and registered[id(p)] == 0  # registered in its block only
        groups[len(blocks) - 1 - l if inside else len(blocks)].append(p)
    buckets: list[list[nn.Parameter]] = []
    for group in groups:
        size = 0  # bytes in the open bucket (0: none open: a bucket never spans groups)
        for p in group:
            nbytes = p.numel() * p.element_size()
            if size and (size + nbytes > cap or buckets[-1][-1].dtype != p.dtype):
                size = 0
            if not size:
                buckets.append([])
            buckets[-1].append(p)
            size += max(nbytes, 1)
    return buckets


class ZebraDispatcher:
    """Swapped into each MoE layer on attention ranks: hands the rows to the step's rounds
    (or, when a checkpointed block recomputes inside its backward, replays its answer)."""

    def __init__(self, layer: int, backend: "ZebraBackend") -> None:
        self.layer, self.backend = layer, backend

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor | None, experts) -> Tensor:
        keep = keep_mask(indices, keep)  # the rounds read their split sizes on the host either way
        run = self.backend.running
        if run is None:
            raise ZebraContractError("the model ran outside the zebra executor while the strategy owns it; run "
                                     "it through the Trainer (training/validation/test/predict steps)")
        return run.dispatch(self.layer, x, indices, keep)

    def combine(self, slots: Tensor, weights: Tensor) -> Tensor:
        run = self.backend.running
        return run.combine(self.layer, slots, weights) if run is not None else weighted_sum(slots, weights)


class ZebraBalance:
    """The balance loss with expert fractions over the whole step's tokens (see schedule)."""

    def __init__(self, layer: int, backend: "ZebraBackend") -> None:
        self.layer, self.backend = layer, backend

    def __call__(self, probs: Tensor, indices: Tensor, real: Tensor | None = None) -> Tensor:
        run = self.backend.running
        counts = run.balance_counts(self.layer, indices) if run is not None \
            else routed_counts(indices, probs.shape[-1], real)
        return balance_loss_from_counts(probs, counts, real)


class ZebraRealTokens:
    """``MoELayer.real_tokens`` on attention ranks: the padding of the micro-batch in hand."""

    def __init__(self, backend: "ZebraBackend") -> None:
        self.backend = backend

    def __call__(self, num_tokens: int) -> Tensor | None:
        run = self.backend.running
        return run.real_tokens(num_tokens) if run is not None else None


class ZebraBackend(ParallelBackend):
    batch_on_host = True
    runs_bare_forward = False

    def __init__(self, plan: Plan, mode: str, rank: int, *, balance: bool, device: torch.device,
                 clock: Any = None) -> None:
        if mode not in ("zebra", "distep"):
            raise ValueError(f"zebra backend mode {mode!r}: must be zebra or distep")
        self.plan, self.schedule, self.device = plan, mode, device
        self.emulator = clock.emulator if clock is not None else None
        self.layout = Layout.from_plan(plan, rank, plan.placement_for(mode))
        L = self.layout.num_layers
        self._R = (plan.distep_microbatches or 1) if mode == "distep" else plan.num_microbatches
        layered = answers_layered([plan.roles[r] for r in self.layout.members])
        self.train_schedule = build_schedule(mode, L, self._R, balance=balance, layered=layered)
        self.forward_schedule = build_schedule("forward", L, self._R, balance=balance, layered=layered)
        self.groups = ZebraGroups.build(self.layout)
        self._stripped: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._cuts: BlockCuts | None = None
        self.layers: list = []
        self.experts: ExpertTasks | None = None
        self.applied = False
        self.d_model = 0
        self.dtype = torch.float32
        self.last_step: StepOutput | None = None  # the last training step (its trace: what ran, when)
        self.last_eval: StepOutput | None = None  # the last forward-only step
        # names evaluation steps logged on some ranks only (torchmetrics objects: each computes itself)
        self.evaluation_local_names: set[str] = set()
        self.running: StepRun | None = None  # the step in progress
        self.account_memory = False  # record the bytes the executor holds after each task
        self._step_grads: list[tuple[nn.Parameter, Tensor]] = []
        self._blocks: list[nn.Module] = []
        self._recompute_experts = False  # the model checkpoints its blocks: so do the expert rounds
        self.bucket_bytes = BUCKET_BYTES  # the dense gradient sync's bucket size
        self.last_buckets = 0  # buckets the last dense gradient sync issued
        self._train_extras: list[str] | None = None  # see _extra_keys

    @property
    def num_microbatches(self) -> int:
        return self._R

    # -- set-up and restore -------------------------------------------------------------
    def setup(self, module: nn.Module, fitting: bool, materialize: Materializer | None = None) -> None:
        if self.applied:
            return
        blocks = find_blocks(module)
        self.layers = [moe for _, _, moe in blocks]
        self._blocks = [b for _, b, _ in blocks]
        self._recompute_experts = checkpoints_activations(module)
        if len(self.layers) != self.layout.num_layers:
            raise ZebraContractError(f"the plan is for {self.layout.num_layers} MoE layers, the model has "
                                     f"{len(self.layers)}")
        self.d_model = self.layers[0].router.weight.shape[1]
        self.dtype = next(self.layers[0].experts.parameters()).dtype
        mine = [self.layout.mine(l) for l in range(len(self.layers))]
        if materialize is not None:
            # expert ranks never allocate the dense part at all
            self._stripped = materialize(module, Holding(dense=self.layout.is_attention, rows=mine)).stripped
        else:  # rank 0's weights already (the strategy broadcast them before planning)
            for layer, ids in zip(self.layers, mine, strict=True):
                slice_experts(layer, ids)
            if not self.layout.is_attention:
                expert_ids = self._expert_param_ids()
                for name, p in module.named_parameters():
                    if id(p) not in expert_ids:
                        self._stripped[name] = (p.shape, p.dtype)
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.layout.is_attention:
            for l, layer in enumerate(self.layers):
                layer.dispatcher = ZebraDispatcher(l, self)
                layer.balance = ZebraBalance(l, self)
                layer.real_tokens = ZebraRealTokens(self)
            self._cuts = BlockCuts([b for _, b, _ in blocks], self.layers)
        self.experts = ExpertTasks(self.layout, self.layers, self.device, self._recompute_experts)
        self.applied = True

    def restore(self, module: nn.Module, gather: bool) -> None:
        """``gather``: every rank ends with the whole model again, local dispatch."""
        if not self.applied or not gather:
            return
        restore_local(self.layers, self.gather_experts)
        params = dict(module.named_parameters())
        for name, (shape, dtype) in self._stripped.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        expert_ids = self._expert_param_ids()
        for p in module.parameters():
            if id(p) not in expert_ids:
                comm.broadcast(comm.world(), p.data, self.layout.saver, what="zebra.weights")
        self._stripped.clear()
        if self._cuts is not None:
            self._cuts.remove()
            self._cuts = None
        if self.experts is not None:
            self.experts.remove()
        self.applied = False

    def _expert_param_ids(self) -> set[int]:
        return {id(p) for layer in self.layers for p in layer.experts.parameters(recurse=False)}

    def _dense_params(self, module: nn.Module) -> list[nn.Parameter]:
        expert_ids = self._expert_param_ids()
        return [p for p in module.parameters() if id(p) not in expert_ids]

    # -- the batch ----------------------------------------------------------------------
    def shares(self, total: int) -> list[tuple[int, int]]:
        """``(start, count)`` of every attention rank's share, in global rank order."""
        att = self.plan.attention_ranks
        planned = [self.plan.seqs_per_rank[r] for r in att]
        sizes = planned if sum(planned) == total else apportion(total, [max(s, 1) for s in planned])
        return split_sizes(total, sizes)

    def step_input(self, full: GlobalBatch, run: Callable[[Any, int], Any] | None,
                   context: Callable[[], Any] | None, train: bool, accumulate: int = 1) -> StepInput:
        R = self._R
        if not self.layout.is_attention:
            return StepInput([None] * R, [0] * R, [0.0] * R, None, None, train)
        start, count = self.shares(full.size)[self.plan.attention_ranks.index(self.layout.rank)]
        sizes = split_microbatches(count, R)
        pieces = [(start + at, n) for at, n in split_sizes(count, sizes)]
        mbs = [on_device(take(full.batch, at, n), self.device) if n else None for at, n in pieces]
        fractions = [full.fraction(at, n) for at, n in pieces]
        padded = full.padded
        masks = [full.mask(at, n, self.device) if n else None for at, n in pieces] if padded else None
        tokens = [full.tokens(at, n) for at, n in pieces] if padded else None
        return StepInput(mbs, sizes, [f / accumulate for f in fractions], run, context, train, fractions=fractions,
                         masks=masks, tokens=tokens)

    # -- the step -----------------------------------------------------------------------
    def step(self, module: nn.Module, hook: str, default: StepFn, precision: Any, args: tuple,
             kwargs: dict) -> Any:
        train = hook == "training_step"
        context = step_context(precision, hook)
        scaler = getattr(precision, "scaler", None) if train else None
        batch = args[0] if args else kwargs.pop("batch")
        rest, kw = tuple(args[1:]), dict(kwargs)
        # evaluation loaders may deal a short last batch unevenly (Lightning's predict
        # sampler does not pad); training batches hold as many rows on every rank
        full = gather_global_batch(batch, ignore_index_of(module), uneven_rows=not train)
        fn = getattr(module, hook)
        accumulate = module.trainer.accumulate_grad_batches if train else 1
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        # a graph to keep: its weights' 16-bit casts are not kept, where several micro-batches
        # would each keep their own (at R = 1 one is kept, as in one process, and the hooks,
        # a call into Python for every tensor saved, cost 5% of a small model's step on a CPU)
        recast = train and grad and not inference and self._R > 1

        def task_context() -> ExitStack:  # the executor's own thread: the expert rounds it runs
            stack = ExitStack()
            stack.enter_context(context())
            if recast and torch.is_autocast_enabled(self.device.type):  # no cast to keep otherwise
                stack.enter_context(recast_saved_weights())
            return stack

        def fiber_context() -> ExitStack:
            stack = ExitStack()
            stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
            stack.enter_context(task_context())
            return stack

        # The executor's backward runs inside the step, before Lightning's zero_grad: this
        # step's gradients are collected apart and handed over in ``backward()`` (whatever
        # accumulated before stays where it was).
        params = [p for p in module.parameters() if p.requires_grad] if train else []
        # Lightning zeroes gradients right after the first step of an accumulation window:
        # the last window's are dropped now, not kept alive beside this step's
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        fresh = train and isinstance(batch_idx, int) and batch_idx % accumulate == 0
        before = [None if fresh else p.grad for p in params]
        for p in params:
            p.grad = None
        with MicrobatchLogs(module) as logs:
            step = self.step_input(full, lambda mb, j: fn(mb, *rest, **kw), fiber_context, train, accumulate)
            if scaler is not None:  # 16-mixed: each micro-batch's loss scaled, as Lightning's backward would
                step.scale = scaler.scale
            out = self._run(step, task_context=task_context)
            if not train:
                self.last_eval = out
                return self._evaluated(hook, out, step, logs, full)
            logs.replay(step.sizes, step.tokens)
        self._step_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, g in zip(params, before, strict=True):
            p.grad = g
        self.last_step = out
        return self._result(out, step)

    def _run(self, step: StepInput, task_context: Callable[[], Any] | None = None) -> StepOutput:
        schedule = self.train_schedule if step.train else self.forward_schedule
        context = task_context or nullcontext
        exchange = Exchange(self.layout, self.groups, schedule, d_model=self.d_model, device=self.device,
                            wire_dtype=self._wire_dtype(context), emulator=self.emulator)
        tasks = schedule.member_tasks(self.layout.is_attention, self.layout.holds())
        self.running = StepRun(self.layout, schedule, exchange, self.layers, self.experts, step, device=self.device,
                               clock=self.emulator, task_context=context, account=self.account_memory)
        try:
            return self.running.run(tasks)
        finally:
            self.running = None

    def _wire_dtype(self, context: Callable[[], Any]) -> torch.dtype:
        """Rows travel in the dtype the experts compute in: the autocast dtype under mixed
        precision (half the bytes of fp32 weights), else the model's."""
        with context():
            return comm.wire_dtype_of(self.device, self.dtype)

    def _result(self, out: StepOutput, step: StepInput) -> Tensor | dict[str, Tensor]:
        """A training step's value on every rank: the global mean loss, and beside it the
        global mean of each extra scalar the user's step returns (see :mod:`.train_outputs`)."""
        keys = self._extra_keys(out)
        values = torch.zeros(1 + len(keys), dtype=torch.float64, device=self.device)
        for j, result in out.results.items():
            row = [loss_of(result, j).detach()] + train_outputs.extra_values(result, keys, j)
            for i, v in enumerate(row):
                # a tensor added on its device, a number as the add's scalar (no copy to the device)
                values[i] += (v.double().reshape(()) if isinstance(v, Tensor) else v) * step.fractions[j]
        comm.all_reduce(comm.world(), values, what="zebra.loss")
        values = values.float()
        if not keys:
            return values[0]
        return {"loss": values[0], **{k: values[i + 1] for i, k in enumerate(keys)}}

    def _extra_keys(self, out: StepOutput) -> list[str]:
        """The extra scalars of the first attention rank's first training step, learnt
        once (every rank takes part: the expert ranks cannot know them)."""
        if self._train_extras is None:
            first = self.plan.attention_ranks[0]
            mine = None
            if self.layout.rank == first and out.results:
                mine = train_outputs.extras_of(out.results[min(out.results)])
            scalars, left_out = comm.gather_objects(comm.world(), mine, what="zebra.train_outputs")[first]
            if left_out and self.layout.rank == first:
                warnings.warn(f"{self.schedule}: training_step returns {left_out} beside 'loss', which are not "
                               f"scalars: on_train_batch_end receives the global batch's mean loss and the means of "
                               f"{scalars or 'no other value'}, not these")
            self._train_extras = scalars
        return self._train_extras

    def _evaluated(self, hook: str, out: StepOutput, step: StepInput, logs: MicrobatchLogs, full: GlobalBatch) -> Any:
        """An evaluation step's value on every rank, as under DDP: the outputs of the rows
        this rank loaded (see :mod:`.outputs`), its logged values those of the global batch
        (see :mod:`.logs`). One host gather tells every rank what the others returned and
        logged, so all take the same collectives."""
        results = [(step.sizes[j], out.results[j]) for j in sorted(out.results)]
        logged = logs.reduced(step.sizes, step.tokens)
        spec = outputs.describe(hook, results)
        everyone = comm.gather_objects(comm.world(), (spec, [item.portable() for item in logged]),
                                       what="zebra.eval")
        self.evaluation_local_names.update(logs.replay_global(logged, [described for _, described in everyone],
                                                              self.device))
        agreed = outputs.agree(hook, [s for s, _ in everyone])
        if agreed is None:
            return None
        if isinstance(agreed, str):
            if hook == "predict_step":  # a prediction writer would pair the wrong rows with the indices
                raise ZebraContractError(agreed)
            # validation/test outputs only reach on_*_batch_end hooks: what this rank computed
            return self._computed(out)
        spans = dict(zip(self.plan.attention_ranks, self.shares(full.size), strict=True))
        route = outputs.routes(full.counts, spans, self.layout.rank)
        mine = outputs.give_back(agreed, outputs.join(results), route, self.device)
        if full.rank_lengths is None:
            return mine
        return outputs.unpad(mine, full.rank_lengths[self.layout.rank], max(full.rank_lengths))

    @staticmethod
    def _computed(out: StepOutput) -> Any:
        """This rank's outputs in micro-batch order (``None`` on expert ranks)."""
        outs = [out.results[j] for j in sorted(out.results)]
        if not outs:
            return None
        if all(isinstance(o, torch.Tensor) for o in outs) and all(o.dim() > 0 for o in outs):
            return torch.cat(outs)
        return outs[0] if len(outs) == 1 else outs

    def backward(self, closure_loss: Tensor, default: Callable[[Tensor], Tensor], precision: Any,
                 module: nn.Module) -> Tensor:
        # The executor already ran the backward inside the step; Lightning's hooks still run.
        closure_loss = precision.pre_backward(closure_loss, module)
        for p, g in self._step_grads:
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self._step_grads = []
        return precision.post_backward(closure_loss, module)

    # -- gradients ----------------------------------------------------------------------
    def sync_grads(self, module: nn.Module) -> None:
        for layer in self.layers:
            params = [p for p in layer.experts.parameters(recurse=False) if p.requires_grad]
            zero_missing_grads(params)
            if len(self.plan.zp_groups) > 1:
                for p in params:
                    comm.all_reduce(self.groups.replicas, p.grad, what="zebra.grads.replicas")
        if not self.layout.is_attention:
            return
        dense = self._dense_params(module)
        zero_missing_grads(dense)
        if len(self.plan.attention_ranks) > 1 and dense:
            self.sync_dense(module)

    def sync_dense(self, module: nn.Module) -> None:
        """Sum the dense gradients over the attention ranks, bucket by bucket (see
        :func:`dense_buckets`; every attention rank issues the same buckets in the same
        order). A one-parameter bucket is reduced in place and stays in flight until the
        end; the others go through one buffer of the largest such bucket's size, reused:
        the previous bucket is waited (on CUDA: the compute stream ordered after its
        all-reduce) and copied back before the next is copied in. So the sync holds one
        bucket beyond the gradients, whatever a process group keeps referenced after a
        wait (a gloo worker thread, NCCL's watchdog). Public so that the GPU self-check can
        measure it on one attention rank, where ``sync_grads`` has nothing to sum."""
        buckets = dense_buckets(module, self._blocks, self._expert_param_ids(), self.bucket_bytes)
        in_place: list[comm.Pending] = []
        buffered: tuple[comm.Pending, list[nn.Parameter]] | None = None
        need: dict[torch.dtype, int] = {}
        for params in buckets:
            if not _in_place(params):
                dtype = params[0].dtype
                need[dtype] = max(need.get(dtype, 0), sum(p.numel() for p in params))
        buffer: Tensor | None = None
        for params in buckets:
            if _in_place(params):
                with comm.issuing(after=[params[0].grad]):
                    in_place.append(comm.all_reduce(self.groups.dense, params[0].grad, what="zebra.grads.dense",
                                                    async_op=True))
                continue
            if buffered is not None:  # the buffer's last sums go back before it is refilled
                _copy_back(*buffered)
                buffered = None
            dtype = params[0].dtype
            if buffer is None or buffer.dtype != dtype:
                buffer = None
                buffer = torch.empty(need[dtype], dtype=dtype, device=params[0].grad.device)
            at = 0
            for p in params:
                n = p.numel()
                buffer[at:at + n].copy_(p.grad.reshape(-1))
                at += n
            flat = buffer[:at]
            with comm.issuing(after=[flat]):
                buffered = (comm.all_reduce(self.groups.dense, flat, what="zebra.grads.dense", async_op=True), params)
            del flat
        if buffered is not None:
            _copy_back(*buffered)
        for pending in in_place:
            pending.wait()
        self.last_buckets = len(buckets)

    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter], dense_sq: Tensor | None = None) -> Tensor:
        """Every expert once, the dense part once (from the group's first attention rank),
        summed within the ZP group (groups are identical)."""
        counts_dense = self.layout.rank == self.layout.attention_members[0]
        held = {id(p) for p in params}  # the optimizer's own: each is clipped over its own
        grads = [p.grad for layer in self.layers for p in layer.experts.parameters(recurse=False) if id(p) in held]
        if counts_dense:
            expert_ids = self._expert_param_ids()
            grads += [p.grad for p in params if id(p) not in expert_ids]
        sq = squared_norm(grads, self.device)
        if counts_dense and dense_sq is not None:
            sq = sq + dense_sq
        comm.all_reduce(self.groups.zp, sq, what="zebra.clip")
        return sq

    def check_user_collective(self, what: str) -> None:
        if self.running is not None:
            raise ZebraContractError(
                f"{what} inside a training/validation/test/predict step under {self.schedule}: only the attention "
                f"ranks run the step, each micro-batch on a thread of its own, so the expert ranks never join the "
                f"collective and the job would hang. Gather in a hook every rank runs (on_validation_epoch_end, "
                f"on_train_batch_end), or log the value with self.log(..., sync_dist=True)")

    def metrics_group(self, group: Any) -> Any:
        # Logged metrics live on attention ranks only: reduce them there.
        if group is not None:
            return group
        return self.groups.dense.device if self.groups.dense is not None else False

    def metrics_source(self) -> int | None:
        return self.plan.attention_ranks[0]

    def local_evaluation_names(self) -> list[str]:
        return sorted(self.evaluation_local_names)

    # -- experts ------------------------------------------------------------------------
    @property
    def spread(self) -> bool:
        return self.applied

    def placement(self) -> Placement:
        return Placement.from_owners(self.layout.placement, len(self.layout.members))

    def holder_index(self) -> int:
        return self.layout.members.index(self.layout.rank)

    def holder_devices(self) -> list[str]:
        return [self.plan.devices[r] for r in self.layout.members]

    def gather_experts(self, layer: int, local: Tensor, name: str = "") -> Tensor:
        return gather_experts(local, self.layout.by_group_rank(layer), self.groups.zp)

    def adopt_placement(self, placement: Placement) -> None:
        """The exchange layout follows the new placement (and so do the plan the simulator
        and checkpoints read)."""
        self.layout.placement = placement.owners()
        self.plan.placement = [list(r) for r in self.layout.placement]
        self.experts.remove()
        self.experts = ExpertTasks(self.layout, self.layers, self.device, self._recompute_experts)

    @property
    def holds_dense(self) -> bool:
        return self.layout.is_attention

    @property
    def dense_on_every_rank(self) -> bool:
        return len(self.plan.attention_ranks) == self.plan.world_size

    def dense_replicas(self) -> Any:
        return self.groups.dense if self.layout.is_attention and len(self.plan.attention_ranks) > 1 else None

    def stripped_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(shape) for name, (shape, _) in self._stripped.items()}

    def writes_checkpoints(self, rank: int) -> bool:
        # Dense weights live on attention ranks: the first of them writes (its state is complete).
        return rank == self.layout.saver

    # -- timing -------------------------------------------------------------------------
    def busy(self, step_s: float) -> dict[str, float] | None:
        out = self.last_step
        if out is None:
            return None
        by = {"attention": 0.0, "experts": 0.0}
        trace = out.trace
        for task, start, end in trace:
            by["experts" if task.kind.startswith("expert") else "attention"] += end - start
        if self.emulator is not None:  # the modelled transfers (they overlap the padded tasks)
            return {**by, "comm": sum(out.transfer_s.values()),
                    "idle": max(step_s - by["attention"] - by["experts"], 0.0)}
        # measured: the exchange this rank waited on with no task running, so that the four
        # add up to the step (a transfer hidden behind a task is the overlap zebra is for)
        exposed = uncovered([(s, e) for _, s, e in out.transfers], [(s, e) for _, s, e in trace])
        return {**by, "comm": exposed, "idle": max(step_s - by["attention"] - by["experts"] - exposed, 0.0)}

    def tail_shape(self) -> TailShape:
        lay = self.layout
        return TailShape(experts_held=sum(len(lay.mine(l)) for l in range(lay.num_layers)),
                         has_attention=lay.is_attention, replicas=len(self.plan.zp_groups),
                         attention_dp=len(self.plan.attention_ranks),
                         replica_ranks=tuple(ranks[lay.my_group_rank] for ranks in lay.every_group_ranks()),
                         dense_ranks=tuple(self.plan.attention_ranks),
                         carried=tail_carried(self.schedule, self.plan.waves))

    def simulated(self, placement: Placement | None = None) -> Simulated:
        return Simulated(self.schedule, plan=self.plan, placement=placement)

    def describe_rank(self, rank: int) -> str:
        return f"{self.plan.roles[rank]} rank, device {self.plan.devices[rank]}"


def _in_place(params: list[nn.Parameter]) -> bool:
    """A bucket of one parameter is reduced in its own gradient (no copy, no buffer)."""
    return len(params) == 1 and params[0].grad.is_contiguous()


def _copy_back(pending: comm.Pending, params: list[nn.Parameter]) -> None:
    """Wait for a bucket's all-reduce and put its sums back into the gradients."""
    flat = pending.wait()
    at = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[at:at + n].view_as(p.grad))
        at += n


def on_device(batch: Any, device: torch.device) -> Any:
    """A micro-batch of a batch kept on the host on the compute device (pinned, no host
    sync); one already there as it is."""
    return map_batch(batch, lambda t: comm.to_device(t, device) if t.device != device else t)
