"""One step of a zebra (or DistEP, or forward-only) schedule on one rank.

:class:`StepRun` walks this rank's task list from the :class:`~lightning_hetermoe.task_order.Schedule`:

* ``attn_fwd (l, j)``: resume micro-batch ``j``'s fiber (start it when ``l = 0``); it runs the
  user's step until the dispatch of layer ``l`` and parks there.
* ``head (j)``: resume the fiber to the end of the user's step (the loss), then
  ``(w_j * loss).backward()`` down to the block-output leaves of the last layer, and send the
  gradient of the last layer's expert answer (only the combine lies in between).
* ``attn_bwd (l, j)``: with the gradient of the dispatched rows back, one
  ``torch.autograd.backward`` over block ``l``'s graph, then across the cut to block
  ``l - 1`` and out again with the gradient of that block's expert answer.
* ``expert_fwd / expert_bwd (l, j)``: the experts this rank holds, on what the round
  brought (:class:`~.expert_tasks.ExpertTasks`).

This thread is the only one that issues collectives (fibers run only while it waits for
them, and they never communicate): what a task sends is issued when its compute is done
(on CUDA the communication stream waits for that compute), what a task needs is waited
for before its clock starts. Under emulation, what a task sends leaves at the task's
*modelled* end: the task issues it before its padding and stamps that moment in the
round's headers, so the real cost of issuing on a CPU stays inside the task's modelled
time, as a GPU's host launches run ahead of its kernels. Records are dropped as soon as
no later task needs them.

Under activation checkpointing a block's forward runs again inside its backward, on
autograd's thread, outside any fiber. The executor names the (layer, micro-batch) whose
backward is running (:attr:`StepRun.replaying`), and the dispatcher and balance loss
replay what that forward saw (the same answer, the same global counts) instead of
communicating again.

``StepOutput.work`` lists the tasks as the work itself reported them (hooks on the blocks,
on the experts and on the gradients of their inputs), so an executor that ran tasks out of
order shows it there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

import lightning_hetermoe.comm as comm
from ....emulate.meter import StepStamps, Stopwatch
from ....moe.balance import routed_counts
from ....moe.dispatch import position_counts, scatter_to_slots, sort_by_position, weighted_sum
from ....task_order import Round, Schedule, Task
from ...batch import batch_size, flat_mask, sequence_length
from . import fibers
from .combine import AnswerCombine
from .exchange import Exchange
from .expert_tasks import ExpertTasks
from .layout import Layout
from .records import BlockRecord, tensor_bytes


class ZebraContractError(RuntimeError):
    """The model did something the zebra executor cannot schedule (see the model contract)."""


@dataclass
class StepInput:
    """What one rank computes in a step."""

    microbatches: list[Any]  # this rank's micro-batches (None where empty)
    sizes: list[int]  # sequences per micro-batch
    weights: list[float]  # loss weight of each micro-batch (its share of the global batch, over accumulation)
    run: Callable[[Any, int], Any] | None  # the user's step on one micro-batch, in a fiber
    context: Callable[[], Any] | None  # torch state for the fiber (grad mode, autocast)
    train: bool = True
    scale: Callable[[Tensor], Tensor] | None = None  # the loss scaler (16-mixed)
    fractions: list[float] = field(default_factory=list)  # each micro-batch's share of the global batch's loss
    masks: list[Tensor | None] | None = None  # [n, seq] real tokens per micro-batch, where rows were padded
    tokens: list[int] | None = None  # real tokens per micro-batch, where rows were padded


@dataclass
class StepOutput:
    results: dict[int, Any] = field(default_factory=dict)  # mb -> what the user's step returned
    stamps: StepStamps | None = None  # the tasks' and the transfers' stamps, read on demand
    work: list[Task] = field(default_factory=list)  # tasks in the order the work itself reported them
    overruns: int = 0  # tasks whose real compute exceeded their modelled time
    tasks: int = 0
    transfer_s: dict[tuple[str, Round], float] = field(default_factory=dict)  # modelled seconds per transfer
    held_bytes: list[int] = field(default_factory=list)  # after each task and at the end, when accounted

    @property
    def trace(self) -> list[tuple[Task, float, float]]:
        """``(task, start, end)`` in seconds from the executor's start (device time on CUDA)."""
        return self.stamps.read()[0] if self.stamps is not None else []

    @property
    def transfers(self) -> list[tuple[tuple[str, Round], float, float]]:
        """Measured runs: ``((channel, round), start, end)`` of every device transfer, from its
        issue to its completion, on the trace's clock."""
        return self.stamps.read()[1] if self.stamps is not None else []


class WorkLog:
    """Tasks as the model's own hooks report them, each once, in the order they happened."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self._seen: set[Task] = set()

    def note(self, kind: str, layer: int, mb: int) -> None:
        task = Task(kind, layer, mb)
        if task not in self._seen:
            self._seen.add(task)
            self.tasks.append(task)


class StepRun:
    def __init__(self, layout: Layout, schedule: Schedule, exchange: Exchange, layers: list, experts: ExpertTasks,
                 step: StepInput, *, device: torch.device, clock: Any = None, task_context: Callable[[], Any],
                 account: bool = False) -> None:
        self.layout, self.schedule, self.exchange = layout, schedule, exchange
        self.layers, self.experts, self.step = layers, experts, step
        self.device, self.clock, self.task_context, self.account = device, clock, task_context, account
        self.L, self.E = schedule.num_layers, layout.num_experts
        self.records: dict[tuple[int, int], BlockRecord] = {}
        self.fibers: dict[int, fibers.Fiber] = {}
        self.routed: dict[tuple[int, int], Tensor] = {}  # (layer, balance group) -> routing counts (host)
        self.global_counts: dict[tuple[int, int], Tensor] = {}  # the same summed over attention ranks (device)
        self.tokens = [0] * schedule.num_microbatches
        self.work = WorkLog()
        self.replaying: tuple[int, int, BlockRecord] | None = None  # (layer, mb, record) being recomputed
        self.out = StepOutput()
        self._outbox: list[Callable[[float | None], None]] = []
        self._last_of_group = {g: mbs[-1] for g, mbs in enumerate(schedule.balance_groups)}
        self._watch = Stopwatch(device)
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    # -- used from inside the model (fiber threads, or recompute) ---------------------------
    def record(self, layer: int, mb: int) -> BlockRecord:
        return self.records.setdefault((layer, mb), BlockRecord())

    def dispatch(self, layer: int, x: Tensor, indices: Tensor, keep: Tensor) -> Tensor:
        fiber = fibers.current()
        if fiber is None:
            if self.replaying is None or self.replaying[0] != layer:
                raise ZebraContractError("the model ran outside the zebra executor while the strategy owns it; run "
                                         "it through the Trainer (training/validation/test/predict steps)")
        table = self.experts.position[layer]
        position = table[indices.reshape(-1)].view_as(indices)
        counts = position_counts(position, keep, table.numel())
        if fiber is None:  # recompute inside the block's backward: the same answer as its forward
            # its rows are the kept choices: the forward's host count, with no sync again
            answer = self.replaying[2].answer
            sc = sort_by_position(position, keep, table.numel(), kept=answer.shape[0], counts=counts)
            x.index_select(0, sc.token)  # as the forward did: checkpointing counts the tensors it saves
            return scatter_to_slots(answer.detach().to(x.dtype), sc.slot, indices.numel())
        # the round's one host sync: kept rows per expert position (and the balance loss's
        # routing counts) in one copy; the sort then takes that many rows, with no other sync
        host = self._host_counts(layer, fiber.mb, indices, counts)
        sc = sort_by_position(position, keep, table.numel(), kept=int(host[: self.E].sum()), counts=counts)
        answer = self._dispatch(layer, fiber, x.index_select(0, sc.token), host)
        if torch.is_grad_enabled():
            self.record(layer, fiber.mb).slot = sc.slot
        # no graph here: the layer's combine (below) differentiates into the answer
        return scatter_to_slots(answer.detach().to(x.dtype), sc.slot, indices.numel())

    def combine(self, layer: int, slots: Tensor, weights: Tensor) -> Tensor:
        """The MoE layer's output from the answer :meth:`dispatch` scattered to ``slots``,
        differentiable into the answer leaf and the weights by :class:`AnswerCombine` (whose
        backward reads nothing a checkpoint drops: see its module)."""
        fiber = fibers.current()
        rec = self.records.get((layer, fiber.mb)) if fiber is not None else \
            self.replaying[2] if self.replaying is not None and self.replaying[0] == layer else None
        if rec is None or rec.answer is None or rec.slot is None or not torch.is_grad_enabled():
            return weighted_sum(slots, weights)
        return AnswerCombine.apply(rec.answer, weights, slots, rec.slot)

    def _host_counts(self, layer: int, mb: int, indices: Tensor, counts: Tensor) -> Tensor:
        g = self.schedule.balance_group(mb)
        real = self._real_of(mb, indices.shape[0])
        parts = [counts] if g is None else [counts, routed_counts(indices, self.E, real)]
        return torch.cat(parts).cpu()

    def _dispatch(self, layer: int, fiber: fibers.Fiber, sent: Tensor, host: Tensor) -> Tensor:
        mb = fiber.mb
        rec = self.record(layer, mb)
        if rec.dispatched:
            raise ZebraContractError(f"the MoE layer {layer} ran twice on micro-batch {mb}")
        if fiber.expect != layer:
            raise ZebraContractError(f"micro-batch {mb} reached MoE layer {layer} where the schedule expected layer "
                                     f"{fiber.expect}: the model must call its MoE blocks once each, in order")
        rec.dispatched = True
        g = self.schedule.balance_group(mb)
        expert_counts = torch.zeros(self.E, dtype=torch.long, device="cpu")
        expert_counts[self.experts.ids_by_position[layer]] = host[: self.E]
        if g is not None:
            acc = self.routed.get((layer, g))
            self.routed[(layer, g)] = host[self.E:] if acc is None else acc + host[self.E:]
        if torch.is_grad_enabled():
            rec.sent = sent
        rows = sent.detach()
        self._outbox.append(lambda at: self.exchange.emit(Round("fwd", layer, mb), rows, expert_counts, at))
        # autocast's cast cache is per thread: each micro-batch's fiber would keep its own
        # low-precision copy of every weight it used until its step returns (R copies). The
        # blocks behind this point are done with theirs (their graphs hold what the backward
        # needs); a weight used again (tied) is cast again.
        torch.clear_autocast_cache()
        fiber.park()
        arrived, rec.arrived = rec.arrived, None
        answer = arrived.detach().requires_grad_(torch.is_grad_enabled())
        if torch.is_grad_enabled():
            rec.answer = answer
        return answer

    def _in_hand(self) -> int | None:
        """The micro-batch the model is running: its fiber's, or the one being recomputed."""
        fiber = fibers.current()
        return fiber.mb if fiber is not None else self.replaying[1] if self.replaying is not None else None

    def _real_of(self, mb: int | None, num_tokens: int) -> Tensor | None:
        if self.step.masks is None or mb is None:
            return None
        return flat_mask(self.step.masks[mb], num_tokens)

    def real_tokens(self, num_tokens: int) -> Tensor | None:
        """Which of the micro-batch in hand's tokens are real (``None``: all of them)."""
        return self._real_of(self._in_hand(), num_tokens)

    def balance_counts(self, layer: int, indices: Tensor) -> Tensor:
        mb = self._in_hand()
        g = self.schedule.balance_group(mb) if mb is not None else None
        if g is None:
            return routed_counts(indices, self.E, self._real_of(mb, indices.shape[0]))
        return self.global_counts[(layer, g)]

    # -- the loop -------------------------------------------------------------------------
    def run(self, tasks: list[Task]) -> StepOutput:
        started = self._watch.now()
        trace: list[tuple[Task, Any, Any]] = []
        self.exchange.start()
        try:
            for task in tasks:
                inputs = self._collect(task)
                if self.clock is not None:  # the step before's tail runs first on the device
                    self.clock.settle()
                t0, wall = self._watch.now(), time.perf_counter()
                with self.task_context():
                    self._compute(task, inputs)
                modelled = self._modelled(task)
                self._flush(wall + modelled[1] if modelled else None)
                self._pad(task, wall, modelled)
                trace.append((task, t0, self._watch.now()))
                if self.account:
                    self.out.held_bytes.append(self.held_bytes())
            self.exchange.finish()
            if self.account:  # and once the last sends completed: nothing may be left
                self.out.held_bytes.append(self.held_bytes())
        except BaseException:
            for f in self.fibers.values():
                f.abort()
            raise
        finally:
            # each fiber holds this run (its owner, its body's closure): let go of them here
            # and the step's objects are freed when the step ends, not by a garbage collection
            self.fibers.clear()
        # read when asked (rank_busy), not here: no host sync of the executor's own
        self.out.stamps = StepStamps(self._watch, started, trace, self.exchange.spans, self._watch.now())
        self.out.work = list(self.work.tasks)
        self.out.transfer_s = dict(self.exchange.transfer_s)
        return self.out

    def held_bytes(self) -> int:
        """Bytes this rank's step holds between tasks: records, saved expert graphs, and
        tensors of collectives in flight."""
        held = [t for rec in self.records.values() for t in rec.tensors()]
        return tensor_bytes(held + self.experts.tensors() + self.exchange.in_flight())

    def _flush(self, leaves_at: float | None) -> None:
        """Issue what the task sends; ``leaves_at``: when its rows leave on the modelled clock."""
        for send in self._outbox:
            send(leaves_at)
        self._outbox.clear()

    def _collect(self, task: Task) -> Any:
        """Wait for what ``task`` needs (not part of its time)."""
        ex, j, l = self.exchange, task.mb, task.layer
        ex.pump()  # what the last tasks held back and can go now, before this task's work is queued
        if task.kind == "attn_fwd" and l > 0 or task.kind == "head":
            prev = l - 1 if task.kind == "attn_fwd" else self.L - 1
            answer = ex.answers(Round("fwd", prev, j))
            g = self.schedule.balance_group(j)
            if g is not None and (prev, g) not in self.global_counts:
                self.global_counts[(prev, g)] = comm.to_device(ex.balance((prev, g)), self.device)
            return answer
        if task.kind == "attn_bwd":
            return ex.answers(Round("bwd", l, j))
        if task.kind in ("expert_fwd", "expert_bwd"):
            return ex.rows(Round("fwd" if task.kind == "expert_fwd" else "bwd", l, j))
        return None

    def _compute(self, task: Task, inputs: Any) -> None:
        kind, l, j = task.kind, task.layer, task.mb
        ex = self.exchange
        if kind == "expert_fwd":
            answers = self.experts.forward(l, j, inputs, self.work)
            self._outbox.append(lambda at: ex.reply(Round("fwd", l, j), answers, at))
            return
        if kind == "expert_bwd":
            grads = self.experts.backward(l, j, inputs)
            self._outbox.append(lambda at: ex.reply(Round("bwd", l, j), grads, at))
            return
        empty = self.step.sizes[j] == 0
        if kind == "attn_fwd":
            if empty:
                self._emit_empty(Round("fwd", l, j), with_counts=True)
            else:
                if l == 0:
                    self._start_fiber(j)
                else:
                    self.records[(l - 1, j)].arrived = inputs
                self._resume(j, expect=l)
                if not self.step.train:
                    self.records.pop((l - 1, j), None)  # forward only: nothing later needs it
            self._post_counts_if_last(l, j)
        elif kind == "head":
            if not empty:
                self.records[(self.L - 1, j)].arrived = inputs
                self._resume(j, expect=None)
                self.out.results[j] = self.fibers[j].result
                if self.step.train:
                    loss = loss_of(self.fibers[j].result, j) * self.step.weights[j]
                    (self.step.scale(loss) if self.step.scale is not None else loss).backward()
            if self.step.train:
                self._send_answer_grad(self.L - 1, j)
            else:
                self.records.pop((self.L - 1, j), None)
        elif kind == "attn_bwd":
            if not empty:
                self._block_backward(l, j, inputs)
            if l > 0:
                self._send_answer_grad(l - 1, j)

    # -- attention pieces -------------------------------------------------------------------
    def _start_fiber(self, j: int) -> None:
        batch, run = self.step.microbatches[j], self.step.run

        def body() -> Any:
            result = run(batch, j)
            self.work.note("head", self.L - 1, j)  # the user's step returned: the head ran
            return result

        self.fibers[j] = fibers.Fiber(body, mb=j, context=self.step.context, owner=self, device=self.device,
                                      stream=self._stream)
        self.tokens[j] = _tokens(batch)

    def _resume(self, j: int, expect: int | None) -> None:
        fiber = self.fibers[j]
        fiber.resume(expect)
        if expect is not None and fiber.done:
            raise ZebraContractError(f"micro-batch {j}'s step returned before MoE layer {expect}: the model must "
                                     f"run all {self.L} MoE blocks in every forward")
        if expect is None and not fiber.done:
            raise ZebraContractError(f"micro-batch {j} reached an MoE layer after the last one ({self.L - 1})")

    def _empty_rows(self) -> Tensor:
        return torch.empty((0, self.exchange.d), dtype=self.exchange.wire, device=self.device)

    def _emit_empty(self, r: Round, with_counts: bool) -> None:
        counts = torch.zeros(self.E, dtype=torch.long, device="cpu") if with_counts else None
        self._outbox.append(lambda at: self.exchange.emit(r, self._empty_rows(), counts, at))

    def _post_counts_if_last(self, l: int, j: int) -> None:
        g = self.schedule.balance_group(j)
        if g is None or self._last_of_group[g] != j:
            return
        counts = self.routed.get((l, g), torch.zeros(self.E, dtype=torch.long, device="cpu"))
        self._outbox.append(lambda at: self.exchange.post_balance((l, g), counts))

    def _send_answer_grad(self, l: int, j: int) -> None:
        """Gradient of block ``l``'s expert answer, from the gradients of the block's outputs."""
        rec = self.records.get((l, j))
        if rec is None:  # an empty micro-batch
            self._emit_empty(Round("bwd", l, j), with_counts=False)
            return
        rec.answer_grads = [(o, leaf.grad) for o, leaf in rec.outputs + rec.aux if leaf.grad is not None]
        answer, grad = rec.answer, None
        if answer.shape[0] and rec.answer_grads:
            self.replaying = (l, j, rec)
            (grad,) = torch.autograd.grad([o for o, _ in rec.answer_grads], [answer],
                                          [g for _, g in rec.answer_grads], retain_graph=True, allow_unused=True)
            self.replaying = None
        grad = (grad if grad is not None else torch.zeros_like(answer)).detach()
        self._outbox.append(lambda at: self.exchange.emit(Round("bwd", l, j), grad, None, at))

    def _block_backward(self, l: int, j: int, sent_grad: Tensor) -> None:
        rec = self.records.pop((l, j))
        tensors, grads = [o for o, _ in rec.answer_grads], [g for _, g in rec.answer_grads]
        if rec.sent is not None and rec.sent.shape[0]:
            tensors.append(rec.sent)
            grads.append(sent_grad.to(rec.sent.dtype))
        self.replaying = (l, j, rec)
        try:
            if tensors:
                torch.autograd.backward(tensors, grads)
        finally:
            self.replaying = None
        ins = [(o, leaf.grad) for o, leaf in rec.inputs or [] if leaf.grad is not None]
        if ins:  # across the cut: into the previous block's output leaves (or the embedding)
            torch.autograd.backward([o for o, _ in ins], [g for _, g in ins])

    # -- emulation ----------------------------------------------------------------------------
    def _modelled(self, task: Task) -> tuple[str, float] | None:
        """``(kind of work, seconds)`` the emulated device takes for ``task``."""
        if self.clock is None:
            return None
        kind, j = task.kind, task.mb
        if kind in ("expert_fwd", "expert_bwd"):
            return "experts", self.clock.experts(self.experts.counts[(task.layer, j)], backward=kind == "expert_bwd")
        if kind == "head":
            return "head", self.clock.head(self.tokens[j], forward_only=not self.step.train)
        return "attention", self.clock.attention(self.tokens[j], backward=kind == "attn_bwd")

    def _pad(self, task: Task, t0: float, modelled: tuple[str, float] | None) -> None:
        if modelled is None:
            return
        name, seconds = modelled
        self.out.tasks += 1
        done = time.perf_counter()
        if done - t0 > seconds > 0:
            self.out.overruns += 1
        self.exchange.pump_until(t0 + seconds)
        self.clock.pad(name, (task.kind, task.layer), t0, seconds, done=done)


def loss_of(result: Any, mb: int) -> Tensor:
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ZebraContractError(f"training_step of micro-batch {mb} returned {type(result).__name__}: zebra needs a "
                                 f"scalar loss tensor (or a dict with 'loss')")
    return loss


def _tokens(batch: Any) -> int:
    try:
        return batch_size(batch) * sequence_length(batch)
    except (ValueError, TypeError):
        return 0
