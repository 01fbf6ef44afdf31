"""The expert MLP, forward and backward, written once over a small set of grouped GEMMs.

Every backend runs the same algorithm (gather-GEMM, activation, GEMM; in backward the
weight gradients as grouped reductions and the input gradient summed back onto the
gathered rows) and differs only in how it multiplies: :class:`Gemms` is that difference.
The Triton kernels (``mlp.py``), ``torch._grouped_mm`` (``grouped_mm.py``) and a loop of one
``torch.mm`` per expert (``loop.py``) each provide one.

Memory: forward keeps only the pre-activation ``h`` (``[M, H]``, none under ``recompute``);
backward writes each weight gradient once, ``[E, ...]``, never per expert then stacked.
Numerics: the input gradient of a row that several choices gathered (top-k) is summed in
fp32 for 16-bit inputs, so that rounding happens once, after the sum.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from . import activation as act


class Gemms(Protocol):
    """One backend's grouped products; rows are grouped by expert, ``counts[e]`` each."""

    def up(self, x: Tensor, gather_idx: Tensor, w_up: Tensor, b_up: Tensor | None) -> Tensor:
        """``[M, H]``: row ``m`` is ``x[gather_idx[m]] @ w_up[e(m)] (+ b_up[e(m)])``."""

    def down(self, a: Tensor, w_down: Tensor, b_down: Tensor | None) -> Tensor:
        """``[M, N]``: row ``m`` is ``a[m] @ w_down[e(m)] (+ b_down[e(m)])``."""

    def grad_rows(self, g: Tensor, w_t: Tensor, out_dtype: torch.dtype) -> Tensor:
        """``[M, K]``: row ``m`` is ``g[m] @ w_t[e(m)]`` (``w_t`` a transposed view)."""

    def grad_weight(self, a: Tensor, g: Tensor, gather_idx: Tensor | None, out_dtype: torch.dtype) -> Tensor:
        """``[E, K, N]``: ``a[rows of e]^T @ g[rows of e]`` (``a``'s rows gathered by
        ``gather_idx`` when given)."""

    def grad_bias(self, g: Tensor) -> Tensor:
        """``[E, N]``: per-expert column sums of ``g``, in fp32."""


def forward(gemms: Gemms, x: Tensor, gather_idx: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
            b_down: Tensor | None, activation: str, recompute: bool) -> tuple[Tensor, Tensor]:
    """``(y, h)``; ``h`` (the pre-activation, kept for backward) is empty under ``recompute``."""
    h = gemms.up(x, gather_idx, w_up, b_up)
    y = gemms.down(act.forward(h, activation), w_down, b_down)
    return y, (h.new_empty(0) if recompute else h)


def backward(gemms: Gemms, dy: Tensor, x: Tensor, gather_idx: Tensor, w_up: Tensor, b_up: Tensor | None,
             w_down: Tensor, b_down: Tensor | None, h: Tensor, activation: str, recompute: bool, need_dx: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dw_up, db_up, dw_down, db_down)``; an absent bias, or dx when not needed, is empty."""
    dy = dy.to(x.dtype).contiguous()  # the incoming gradient may be an expanded (stride-0) view
    if recompute:
        h = gemms.up(x, gather_idx, w_up, b_up)
    a = act.forward(h, activation)
    dw_down = gemms.grad_weight(a, dy, None, w_down.dtype)
    del a
    db_down = gemms.grad_bias(dy).to(b_down.dtype) if b_down is not None else dy.new_empty(0)
    # dy @ w_down^T on a transposed view: no weight copy
    dh = act.backward(h, gemms.grad_rows(dy, w_down.transpose(1, 2), dy.dtype), activation)
    del h
    dw_up = gemms.grad_weight(x, dh, gather_idx, w_up.dtype)
    db_up = gemms.grad_bias(dh).to(b_up.dtype) if b_up is not None else dh.new_empty(0)
    if need_dx:
        acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        d_rows = gemms.grad_rows(dh, w_up.transpose(1, 2), acc)
        dx = torch.zeros(x.shape, device=x.device, dtype=acc).index_add_(0, gather_idx, d_rows.to(acc)).to(x.dtype)
    else:
        dx = x.new_empty(0)
    return dx, dw_up, db_up, dw_down, db_down


def fake_backward(dy, x, gather_idx, counts, w_up, b_up, w_down, b_down, h, activation, recompute, need_dx):
    """Shapes only, for ``torch.compile``."""
    return (
        x.new_empty(x.shape) if need_dx else x.new_empty(0),
        w_up.new_empty(w_up.shape),
        b_up.new_empty(b_up.shape) if b_up is not None else x.new_empty(0),
        w_down.new_empty(w_down.shape),
        b_down.new_empty(b_down.shape) if b_down is not None else x.new_empty(0),
    )


def autograd(backward_op) -> tuple:
    """``(setup_context, backward)`` for an MLP op ``op(x, gather_idx, counts, w_up, b_up,
    w_down, b_down, activation, recompute) -> (y, h)`` whose backward is ``backward_op``:
    what ``op.register_autograd`` takes, and an ``autograd.Function``'s two methods."""

    def setup_context(ctx, inputs, output):
        x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute = inputs
        _, h = output
        ctx.save_for_backward(x, gather_idx, counts, w_up, b_up, w_down, b_down, h)
        ctx.activation, ctx.recompute = activation, recompute
        ctx.mark_non_differentiable(h)

    def grads(ctx, dy, _dh):
        x, gather_idx, counts, w_up, b_up, w_down, b_down, h = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dx, dw_up, db_up, dw_down, db_down = backward_op(
            dy, x, gather_idx, counts, w_up, b_up, w_down, b_down, h, ctx.activation, ctx.recompute, need_dx)
        return (dx if need_dx else None, None, None, dw_up, db_up if b_up is not None else None,
                dw_down, db_down if b_down is not None else None, None, None)

    return setup_context, grads


def register_autograd(op, backward_op) -> tuple:
    """:func:`autograd`, registered on the custom op ``op``; returns the pair too."""
    setup_context, grads = autograd(backward_op)
    op.register_autograd(grads, setup_context=setup_context)
    return setup_context, grads
