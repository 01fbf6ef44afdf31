"""The experts' answer weighed and summed into the MoE layer's output, on attention ranks.

An attention rank's block backward runs in two passes: the gradient of the experts' answer
first (sent to the expert ranks, whose backward it starts), the block's own backward once
their gradient for the sent rows is back. Where the model checkpoints its blocks, every
pass that reads a tensor the checkpoint dropped runs the block's forward again, and the
first pass read two: the router's weights and the scattered rows, which the layer's
weighted sum saved. :class:`AnswerCombine` is that weighted sum with its backward reading
only what the executor holds anyway (the answer, the slot of each row) and the weights it
keeps itself, so the first pass stops at the answer without recomputing the block: one
recompute per block and micro-batch, as the planner prices it, not two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....moe.dispatch import scatter_to_slots, weighted_sum


class AnswerCombine(torch.autograd.Function):
    """``weighted_sum(slots, weights)`` where ``slots`` is ``answer`` scattered to ``slot``
    (given, computed without a graph); differentiable in ``answer`` and ``weights``."""

    @staticmethod
    def forward(ctx, answer: Tensor, weights: Tensor, slots: Tensor, slot: Tensor) -> Tensor:  # noqa: D401
        # kept as attributes, not saved tensors: a checkpoint's hooks would drop and recompute them
        ctx.answer, ctx.weights, ctx.slot = answer.detach(), weights.detach(), slot
        ctx.slots_dtype, ctx.num_slots = slots.dtype, slots.shape[0]
        return weighted_sum(slots, weights)

    @staticmethod
    def backward(ctx, grad: Tensor):
        T, k = ctx.weights.shape
        grad_slots = grad.unsqueeze(1) * ctx.weights.unsqueeze(-1)  # [T, k, d], as the product's backward
        grad_answer = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_answer = grad_slots.reshape(T * k, -1).index_select(0, ctx.slot).to(ctx.answer.dtype)
        if ctx.needs_input_grad[1]:
            slots = scatter_to_slots(ctx.answer.to(ctx.slots_dtype), ctx.slot, ctx.num_slots)
            grad_weights = (grad.unsqueeze(1) * slots.view(T, k, -1)).sum(-1)
        return grad_answer, grad_weights, None, None
