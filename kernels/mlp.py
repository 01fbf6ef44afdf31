"""The expert MLP (gather-GEMM, activation, GEMM) on the Triton kernels, with its backward.

Forward and backward are each one ``torch.library.custom_op``, so ``torch.compile`` sees two
opaque nodes with fake (shape-only) implementations instead of tracing into kernel
launches. The autograd formula is written once, as :class:`GroupedMLPFunction`, and the
same ``setup_context``/``backward`` are registered on the op: ``GroupedMLPFunction.apply``
and the op differentiate identically.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import activation as act
from .launch import grouped_gemm, grouped_wgrad, segment_sum
from .contract import fake_mlp, prepare

_NS = "lightning_hetermoe"


def _hidden(x, gather_idx, counts, w_up, b_up):
    return grouped_gemm(x, w_up, counts, gather_idx=gather_idx, bias=b_up)


@torch.library.custom_op(f"{_NS}::grouped_mlp", mutates_args=())
def grouped_mlp_op(
    x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Optional[Tensor],
    w_down: Tensor, b_down: Optional[Tensor], activation: str, recompute: bool,
) -> tuple[Tensor, Tensor]:
    """Returns ``(y, h)``; ``h`` (the pre-activation, kept for backward) is empty under ``recompute``."""
    h = _hidden(x, gather_idx, counts, w_up, b_up)
    y = grouped_gemm(act.forward(h, activation), w_down, counts, bias=b_down)
    return y, (h.new_empty(0) if recompute else h)


grouped_mlp_op.register_fake(fake_mlp)


@torch.library.custom_op(f"{_NS}::grouped_mlp_backward", mutates_args=())
def grouped_mlp_backward_op(
    dy: Tensor, x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Optional[Tensor],
    w_down: Tensor, b_down: Optional[Tensor], h: Tensor, activation: str, recompute: bool, need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dw_up, db_up, dw_down, db_down)``; an absent bias, or dx when not needed, is empty."""
    dy = dy.to(x.dtype)
    if recompute:
        h = _hidden(x, gather_idx, counts, w_up, b_up)
    a = act.forward(h, activation)
    dw_down = grouped_wgrad(a, dy, counts, out_dtype=w_down.dtype)
    db_down = segment_sum(dy, counts).to(b_down.dtype) if b_down is not None else dy.new_empty(0)
    # dy @ w_down^T is the forward kernel on a transposed view: no weight copy.
    dh = act.backward(h, grouped_gemm(dy, w_down.transpose(1, 2), counts), activation)
    del a, h
    dw_up = grouped_wgrad(x, dh, counts, gather_idx=gather_idx, out_dtype=w_up.dtype)
    db_up = segment_sum(dh, counts).to(b_up.dtype) if b_up is not None else dh.new_empty(0)
    if need_dx:
        # gather_idx may name a row of x more than once (top-k): per-row grads are summed,
        # in fp32 so that bf16 rounding happens once, after the sum.
        d_rows = grouped_gemm(dh, w_up.transpose(1, 2), counts, out_dtype=torch.float32)
        dx = torch.zeros(x.shape, device=x.device, dtype=torch.float32).index_add_(0, gather_idx, d_rows).to(x.dtype)
    else:
        dx = x.new_empty(0)
    return dx, dw_up, db_up, dw_down, db_down


@grouped_mlp_backward_op.register_fake
def _(dy, x, gather_idx, counts, w_up, b_up, w_down, b_down, h, activation, recompute, need_dx):
    return (
        x.new_empty(x.shape) if need_dx else x.new_empty(0),
        w_up.new_empty(w_up.shape),
        b_up.new_empty(b_up.shape) if b_up is not None else x.new_empty(0),
        w_down.new_empty(w_down.shape),
        b_down.new_empty(b_down.shape) if b_down is not None else x.new_empty(0),
    )


class GroupedMLPFunction(torch.autograd.Function):
    """Autograd for :func:`grouped_mlp_op`; ``forward`` returns ``(y, h)`` like the op."""

    @staticmethod
    def forward(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute):
        return grouped_mlp_op(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute = inputs
        _, h = output
        ctx.save_for_backward(x, gather_idx, counts, w_up, b_up, w_down, b_down, h)
        ctx.activation, ctx.recompute = activation, recompute
        ctx.mark_non_differentiable(h)

    @staticmethod
    def backward(ctx, dy, _dh):
        x, gather_idx, counts, w_up, b_up, w_down, b_down, h = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dx, dw_up, db_up, dw_down, db_down = grouped_mlp_backward_op(
            dy, x, gather_idx, counts, w_up, b_up, w_down, b_down, h, ctx.activation, ctx.recompute, need_dx)
        return (dx if need_dx else None, None, None, dw_up, db_up if b_up is not None else None,
                dw_down, db_down if b_down is not None else None, None, None)


grouped_mlp_op.register_autograd(GroupedMLPFunction.backward, setup_context=GroupedMLPFunction.setup_context)


def grouped_mlp(
    x: Tensor,
    gather_idx: Tensor,
    counts: Tensor,
    w_up: Tensor,
    b_up: Tensor | None,
    w_down: Tensor,
    b_down: Tensor | None,
    activation: str,
    recompute: bool = False,
) -> Tensor:
    """The expert backend contract of ``lightning_hetermoe.moe.experts`` on Triton kernels."""
    x, w_up, b_up, w_down, b_down = prepare(x, w_up, b_up, w_down, b_down, activation)
    y, _ = grouped_mlp_op(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute)
    return y
