"""The experts a rank holds, run on what a round brings (expert ranks, and attention ranks
that hold experts by Asym-EA). Each round is its own small graph, kept until its backward.

A round lies outside the blocks' activation checkpointing (the block is cut where its
tokens leave), so where the model checkpoints its blocks a round checkpoints itself: it
keeps the rows it received and its answer, and runs its experts again in its backward,
as the block would under expert parallelism. Otherwise every expert's hidden activation
(``d_ff`` per row, twice that for SwiGLU) stays for every token in flight, which under
zebra is every token of the step: at Mixtral's shape 7 of every 8 values a round keeps."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

import lightning_hetermoe.comm as comm
from ....moe.dispatch import scatter_to_slots
from .layout import Layout
from .records import Dispatched, ExpertRecord


def expert_order(counts: Tensor, rows: int, device: torch.device) -> Tensor:
    """The received rows in expert order: they arrive by sender, each sender's by local
    expert (``counts``, host ``[G, local experts]``, summing to ``rows``); a stable sort of
    each row's expert. Formed on ``device`` from a copy of the counts alone, without a
    sync (``output_size``): on the host it was a sort of every routed row per round and a
    copy of the result (about 0.8 ms a round of host time in an H200's profile)."""
    local = torch.arange(counts.shape[1], device=device).repeat(counts.shape[0])
    expert_of_row = torch.repeat_interleave(local, comm.to_device(counts.reshape(-1), device), output_size=rows)
    return torch.argsort(expert_of_row, stable=True)


def arrived_in_expert_order(counts: Tensor) -> bool:
    """Whether the rows of ``counts`` (host ``[G, local experts]``) came from one sender at
    most (a ZP group of one attention rank, the common plan): they are in expert order as
    they are, and :func:`expert_order` would be the identity."""
    return int((counts.sum(1) > 0).sum()) <= 1


class ExpertTasks:
    """``work`` (a :class:`~.executor.WorkLog`) hears from the experts' own hooks when a
    round's experts really ran, forward and backward."""

    def __init__(self, layout: Layout, layers: list, device: torch.device, recompute: bool = False) -> None:
        self.layout, self.layers, self.recompute = layout, layers, recompute
        self._running: tuple[Any, int, int] | None = None  # (work log, layer, mb) while experts run
        self._hooks = [layer.experts.register_forward_pre_hook(self._ran) for layer in layers]
        self.position: list[Tensor] = []  # [E] on the device: where expert e's rows go (attention side)
        self.ids_by_position: list[Tensor] = []  # [E] on the host: the expert at each position
        for l in range(layout.num_layers):
            pos = layout.expert_position(l)
            self.position.append(torch.tensor(pos, dtype=torch.long, device=device))
            ids = [0] * len(pos)
            for e, p in enumerate(pos):
                ids[p] = e
            self.ids_by_position.append(torch.tensor(ids, dtype=torch.long, device="cpu"))
        self.saved: dict[tuple[int, int], ExpertRecord] = {}
        self.counts: dict[tuple[int, int], list[int]] = {}  # rows per local expert, per round (emulation)

    def _ran(self, module, args) -> None:
        if self._running is not None:
            work, layer, mb = self._running
            work.note("expert_fwd", layer, mb)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def forward(self, layer: int, mb: int, got: Dispatched, work: Any) -> Tensor:
        counts = got.counts  # host [G, local experts]
        rows = got.rows
        per_expert = counts.sum(0)
        self.counts[(layer, mb)] = per_expert.tolist()
        in_order = arrived_in_expert_order(counts)  # no sort, and no rows to put back
        by_expert = torch.arange(rows.shape[0], device=rows.device) if in_order else \
            expert_order(counts, rows.shape[0], rows.device)
        inp = rows.detach().requires_grad_(torch.is_grad_enabled())
        self._running = (work, layer, mb)
        try:
            experts = self.layers[layer].experts
            if self.recompute and torch.is_grad_enabled():
                y = checkpoint(experts, inp, by_expert, per_expert, use_reentrant=False)
            else:
                y = experts(inp, by_expert, per_expert)
        finally:
            self._running = None
        out = scatter_to_slots(y, by_expert, rows.shape[0]) if rows.shape[0] and not in_order else y
        if torch.is_grad_enabled():
            if out.requires_grad:
                out.register_hook(lambda g: work.note("expert_bwd", layer, mb))  # its backward began
            self.saved[(layer, mb)] = ExpertRecord(inp, out)
        return out.detach()

    def backward(self, layer: int, mb: int, grad: Tensor) -> Tensor:
        rec = self.saved.pop((layer, mb))
        if rec.outputs.requires_grad:
            torch.autograd.backward(rec.outputs, grad.to(rec.outputs.dtype))
        return rec.inputs.grad if rec.inputs.grad is not None else torch.zeros_like(rec.inputs)

    def tensors(self) -> list[Tensor]:
        return [t for rec in self.saved.values() for t in (rec.inputs, rec.outputs)]
