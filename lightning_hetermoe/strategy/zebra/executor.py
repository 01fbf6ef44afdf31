"""One step of a zebra (or DistEP, or forward-only) schedule on one rank.

:class:`StepRun` walks this rank's task list from the :class:`~lightning_hetermoe.schedule.Schedule`:

* ``attn_fwd (l, j)``: resume micro-batch ``j``'s fiber (start it when ``l = 0``); it runs the
  user's step until the dispatch of layer ``l`` and parks there, its rows posted.
* ``head (j)``: resume the fiber to the end of the user's step (the loss), then
  ``(w_j * loss).backward()`` down to the block-output leaves of the last layer, and send the
  gradient of the last layer's expert answer (only the combine lies in between).
* ``attn_bwd (l, j)``: with the gradient of the dispatched rows back, one
  ``torch.autograd.backward`` over block ``l``'s graph, then across the cut to block
  ``l - 1`` and out again with the gradient of that block's expert answer.
* ``expert_fwd / expert_bwd (l, j)``: the experts this rank holds, on what the round
  brought, each its own small graph (:class:`ExpertTasks`).

Everything the loop waits for (an answer from the experts, the balance counts) is awaited
before a task's clock starts; under emulation the task is then padded to its modelled time.
The loop records ``(task, start, end)`` for every task: the order the schedule demands is
also the order that ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from ...moe.balance import routed_counts
from ...moe.dispatch import scatter_to_slots, sort_choices
from ...schedule import Round, Schedule, Task
from . import fibers
from .comm import Dispatched, Exchange
from .layout import Layout


class ZebraContractError(RuntimeError):
    """The model did something the zebra executor cannot schedule (see the model contract)."""


@dataclass
class StepInput:
    """What one rank computes in a step."""

    microbatches: list[Any]  # this rank's micro-batches (None where empty)
    sizes: list[int]  # sequences per micro-batch
    weights: list[float]  # loss weight of each micro-batch (its share of the global batch)
    run: Callable[[Any, int], Any] | None  # the user's step on one micro-batch, in a fiber
    context: Callable[[], Any] | None  # torch state for the fiber (grad mode, autocast)
    train: bool = True


@dataclass
class StepOutput:
    results: dict[int, Any] = field(default_factory=dict)  # mb -> what the user's step returned
    trace: list[tuple[Task, float, float]] = field(default_factory=list)  # (task, start, end) from step start
    overruns: int = 0  # tasks whose real compute exceeded their modelled time
    tasks: int = 0
    transfer_s: dict[tuple[str, Round], float] = field(default_factory=dict)  # modelled seconds per transfer


class StepRun:
    def __init__(self, layout: Layout, schedule: Schedule, exchange: Exchange, module_layers: list,
                 expert_tasks: "ExpertTasks", step: StepInput, *, clock: Any = None, d_model: int = 0,
                 task_context: Callable[[], Any] | None = None) -> None:
        self.layout, self.schedule, self.exchange = layout, schedule, exchange
        self.layers = module_layers
        self.experts = expert_tasks
        self.step = step
        self.clock = clock
        self.d = d_model
        self.task_context = task_context
        self.records: dict[tuple[int, int], dict[str, Any]] = {}
        self.fibers: dict[int, fibers.Fiber] = {}
        self.routed: dict[tuple[int, int], Tensor] = {}
        self.global_counts: dict[tuple[int, int], Tensor] = {}
        self.out = StepOutput()
        self.L = schedule.num_layers
        self.tokens = [0] * schedule.num_microbatches
        self._outbox: list[tuple[str, Any, Any]] = []
        self._last_of_group: dict[int, int] = {}
        for g, mbs in enumerate(schedule.balance_groups):
            self._last_of_group[g] = mbs[-1]

    # -- used from inside the model (fiber threads) -------------------------------------
    def post(self, channel: str, key: Any, value: Any) -> None:
        """What a task sends leaves when the task ends: after its padding, under emulation,
        as on the device it plays (a send cannot start before the kernel that made it)."""
        self._outbox.append((channel, key, value))

    def _flush(self) -> None:
        for channel, key, value in self._outbox:
            self.exchange.post(channel, key, value)
        self._outbox.clear()

    def record(self, layer: int, mb: int) -> dict[str, Any]:
        return self.records.setdefault((layer, mb), {})

    def dispatch(self, layer: int, x: Tensor, indices: Tensor, keep: Tensor) -> Tensor:
        fiber = fibers.current()
        mb = fiber.mb
        rec = self.record(layer, mb)
        if "sent" in rec:
            raise ZebraContractError(f"the MoE layer {layer} ran twice on micro-batch {mb}")
        expect = fiber.expect
        if expect != layer:
            raise ZebraContractError(f"micro-batch {mb} reached MoE layer {layer} where the schedule expected layer "
                                     f"{expect}: the model must call its MoE blocks once each, in order")
        position = self.experts.position[layer]
        sc = sort_choices(indices, keep, position)
        sent = x.index_select(0, sc.token)
        expert_counts = torch.zeros(self.layout.num_experts, dtype=torch.long)
        expert_counts[self.experts.ids_by_position[layer]] = sc.counts.cpu()
        rec.update(sent=sent, slot=sc.slot, num_slots=indices.numel(), dtype=x.dtype)
        g = self.schedule.balance_group(mb)
        if g is not None:
            acc = self.routed.get((layer, g))
            counts = routed_counts(indices, self.layout.num_experts).cpu()
            self.routed[(layer, g)] = counts if acc is None else acc + counts
        self.post("dispatch", Round("fwd", layer, mb), {"rows": sent.detach(), "expert_counts": expert_counts})
        fiber.park()
        back = rec.pop("back")
        recv = back.detach().requires_grad_(torch.is_grad_enabled())
        rec["recv"] = recv
        return scatter_to_slots(recv.to(x.dtype), sc.slot, indices.numel())

    def balance_counts(self, layer: int, indices: Tensor) -> Tensor:
        fiber = fibers.current()
        g = self.schedule.balance_group(fiber.mb) if fiber is not None else None
        if g is None:
            return routed_counts(indices, self.layout.num_experts)
        return self.global_counts[(layer, g)].to(indices.device)

    # -- the loop -----------------------------------------------------------------------
    def run(self, tasks: list[Task]) -> StepOutput:
        t_step = time.perf_counter()
        self.exchange.start()
        try:
            for task in tasks:
                inputs = self._collect(task)
                t0 = time.perf_counter()
                with self.task_context() if self.task_context is not None else _null():
                    self._compute(task, inputs)
                self._pad(task, t0, inputs)
                self._flush()
                self.out.trace.append((task, t0 - t_step, time.perf_counter() - t_step))
            self.exchange.join()
            self.out.transfer_s = dict(self.exchange.transfer_s)
        except BaseException as err:
            self.exchange.abort(err)
            for f in self.fibers.values():
                f.abort()
            raise
        return self.out

    def _collect(self, task: Task) -> Any:
        """Wait for what ``task`` needs (not part of its time)."""
        ex, j, l = self.exchange, task.mb, task.layer
        if task.kind == "attn_fwd" and l > 0 or task.kind == "head":
            prev = l - 1 if task.kind == "attn_fwd" else self.L - 1
            back = ex.get("combine", Round("fwd", prev, j))
            g = self.schedule.balance_group(j)
            if g is not None and (prev, g) not in self.global_counts:
                self.global_counts[(prev, g)] = ex.get("balance", (prev, g))
            return back
        if task.kind == "attn_bwd":
            return ex.get("combine", Round("bwd", l, j))
        if task.kind == "expert_fwd":
            return ex.get("dispatch", Round("fwd", l, j))
        if task.kind == "expert_bwd":
            return ex.get("dispatch", Round("bwd", l, j))
        return None

    def _compute(self, task: Task, inputs: Any) -> None:
        kind, l, j = task.kind, task.layer, task.mb
        if kind == "expert_fwd":
            self.post("combine", Round("fwd", l, j), self.experts.forward(l, j, inputs))
            return
        if kind == "expert_bwd":
            self.post("combine", Round("bwd", l, j), self.experts.backward(l, j, inputs))
            return
        empty = self.step.sizes[j] == 0
        if kind == "attn_fwd":
            if empty:
                self._post_empty_dispatch(l, j)
            else:
                if l == 0:
                    self._start_fiber(j)
                else:
                    self.records[(l - 1, j)]["back"] = inputs
                self._resume(j, expect=l)
            self._post_counts_if_last(l, j)
        elif kind == "head":
            if not empty:
                self.records[(self.L - 1, j)]["back"] = inputs
                self._resume(j, expect=None)
                self.out.results[j] = self.fibers[j].result
                if self.step.train:
                    loss = loss_of(self.fibers[j].result, j)
                    (loss * self.step.weights[j]).backward()
            if self.step.train:
                self._send_answer_grad(self.L - 1, j)
        elif kind == "attn_bwd":
            if not empty:
                self._block_backward(l, j, inputs)
            if l > 0:
                self._send_answer_grad(l - 1, j)

    # -- attention pieces ---------------------------------------------------------------
    def _start_fiber(self, j: int) -> None:
        batch, run = self.step.microbatches[j], self.step.run
        fiber = fibers.Fiber(lambda: run(batch, j), mb=j, context=self.step.context, owner=self)
        self.fibers[j] = fiber
        self.tokens[j] = _tokens(batch)

    def _resume(self, j: int, expect: int | None) -> None:
        fiber = self.fibers[j]
        fiber.expect = expect
        fiber.resume()
        if expect is not None and fiber.done:
            raise ZebraContractError(f"micro-batch {j}'s step returned before MoE layer {expect}: the model must "
                                     f"run all {self.L} MoE blocks in every forward")
        if expect is None and not fiber.done:
            raise ZebraContractError(f"micro-batch {j} reached an MoE layer after the last one ({self.L - 1})")

    def _empty_rows(self) -> Tensor:
        return torch.empty(0, self.d, dtype=self.exchange.dtype, device=self.exchange.device)

    def _post_empty_dispatch(self, l: int, j: int) -> None:
        self.post("dispatch", Round("fwd", l, j), {
            "rows": self._empty_rows(), "expert_counts": torch.zeros(self.layout.num_experts, dtype=torch.long)})

    def _post_counts_if_last(self, l: int, j: int) -> None:
        g = self.schedule.balance_group(j)
        if g is None or self._last_of_group[g] != j:
            return
        counts = self.routed.get((l, g), torch.zeros(self.layout.num_experts, dtype=torch.long))
        self.post("balance", (l, g), counts)

    def _send_answer_grad(self, l: int, j: int) -> None:
        """Gradient of block ``l``'s expert answer, from the gradients of the block's outputs."""
        rec = self.records.get((l, j))
        if rec is None:  # an empty micro-batch
            self.post("dispatch", Round("bwd", l, j), {"rows": self._empty_rows()})
            return
        outs = [(o, leaf.grad) for o, leaf in rec.get("outputs", []) if leaf.grad is not None]
        rec["outs"] = outs
        recv = rec["recv"]
        grad = None
        if recv.shape[0] and outs:
            (grad,) = torch.autograd.grad([o for o, _ in outs], [recv], [g for _, g in outs], retain_graph=True,
                                          allow_unused=True)
        if grad is None:
            grad = torch.zeros_like(recv)
        self.post("dispatch", Round("bwd", l, j), {"rows": grad.detach()})

    def _block_backward(self, l: int, j: int, sent_grad: Tensor) -> None:
        rec = self.records.pop((l, j))
        outs = rec.get("outs", [])
        tensors, grads = [o for o, _ in outs], [g for _, g in outs]
        sent = rec["sent"]
        if sent.shape[0]:
            tensors.append(sent)
            grads.append(sent_grad.to(sent.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)
        ins = [(o, leaf.grad) for o, leaf in rec.get("inputs", []) if leaf.grad is not None]
        if ins:  # across the cut: into the previous block's output leaves (or the embedding)
            torch.autograd.backward([o for o, _ in ins], [g for _, g in ins])

    # -- emulation ----------------------------------------------------------------------
    def _pad(self, task: Task, t0: float, inputs: Any) -> None:
        if self.clock is None:
            return
        kind, j = task.kind, task.mb
        if kind in ("expert_fwd", "expert_bwd"):
            modelled = self.clock.experts(self.experts.counts[(task.layer, j)], backward=kind == "expert_bwd")
            name = "experts"
        elif kind == "head":
            modelled = self.clock.head(self.tokens[j], forward_only=not self.step.train)
            name = "head"
        else:
            modelled = self.clock.attention(self.tokens[j], backward=kind == "attn_bwd")
            name = "attention"
        self.out.tasks += 1
        if time.perf_counter() - t0 > modelled > 0:
            self.out.overruns += 1
        self.clock.pad(name, (kind, task.layer), t0, modelled)


class ExpertTasks:
    """The experts this rank holds, run on what a round brings (any role may hold some)."""

    def __init__(self, layout: Layout, layers: list, device: torch.device) -> None:
        self.layout, self.layers = layout, layers
        self.position: list[Tensor] = []
        self.ids_by_position: list[Tensor] = []
        for l in range(layout.num_layers):
            pos = layout.expert_position(l)
            self.position.append(torch.tensor(pos, dtype=torch.long, device=device))
            ids = [0] * len(pos)
            for e, p in enumerate(pos):
                ids[p] = e
            self.ids_by_position.append(torch.tensor(ids, dtype=torch.long))
        self.saved: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.counts: dict[tuple[int, int], list[int]] = {}  # rows per local expert, per round (emulation)

    def forward(self, layer: int, mb: int, got: Dispatched) -> Tensor:
        counts = got.counts  # [G, local experts]
        n_local = counts.shape[1]
        rows = got.rows
        per_expert = counts.sum(0)
        self.counts[(layer, mb)] = per_expert.tolist()
        local = torch.arange(n_local).repeat(counts.shape[0])
        by_expert = torch.argsort(torch.repeat_interleave(local, counts.reshape(-1)), stable=True).to(rows.device)
        inp = rows.detach().requires_grad_(torch.is_grad_enabled())
        y = self.layers[layer].experts(inp, by_expert, per_expert.to(rows.device))
        out = scatter_to_slots(y, by_expert, rows.shape[0]) if rows.shape[0] else y
        if torch.is_grad_enabled():
            self.saved[(layer, mb)] = (inp, out)
        return out.detach()

    def backward(self, layer: int, mb: int, grad: Tensor) -> Tensor:
        inp, out = self.saved.pop((layer, mb))
        if out.requires_grad:
            torch.autograd.backward(out, grad.to(out.dtype))
        return inp.grad if inp.grad is not None else torch.zeros_like(inp)


def loss_of(result: Any, mb: int) -> Tensor:
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ZebraContractError(f"training_step of micro-batch {mb} returned {type(result).__name__}: zebra needs a "
                                 f"scalar loss tensor (or a dict with 'loss')")
    return loss


def _tokens(batch: Any) -> int:
    from ..batch import batch_size, sequence_length

    try:
        return batch_size(batch) * sequence_length(batch)
    except (ValueError, TypeError):
        return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
