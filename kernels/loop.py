"""The expert MLP as one ``torch.mm`` per expert from Python (the ``torch`` backend).

The algorithm is :mod:`.algorithm`'s, as for the other backends; here each grouped product
is a loop over the experts' row segments, writing into one preallocated result, so a
layer's weight gradients are formed once (``[E, ...]``), not per expert and then stacked.
``counts`` is read on the host once per call (the loop needs the segment bounds); given on
the host it costs no device sync. The autograd is an ``autograd.Function``: this backend is
plain torch, with no kernel to hide from ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import algorithm


def segments(counts: Tensor) -> list[tuple[int, int, int]]:
    """``(expert, start, rows)`` of every non-empty expert segment."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out.append((e, start, n))
        start += n
    return out


class LoopGemms:
    """:class:`~.algorithm.Gemms` as one matmul per expert."""

    def __init__(self, counts: Tensor) -> None:
        self.experts = counts.shape[0]
        self.segs = segments(counts)

    def _rows(self, a: Tensor, w: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
        out = a.new_empty(a.shape[0], w.shape[-1], dtype=out_dtype)
        for e, s, n in self.segs:
            torch.mm(a[s:s + n], w[e], out=out[s:s + n]) if out_dtype == a.dtype else \
                out[s:s + n].copy_(a[s:s + n] @ w[e])
            if bias is not None:
                out[s:s + n] += bias[e]
        return out

    def up(self, x, gather_idx, w_up, b_up):
        return self._rows(x.index_select(0, gather_idx), w_up, b_up, x.dtype)

    def down(self, a, w_down, b_down):
        return self._rows(a, w_down, b_down, a.dtype)

    def grad_rows(self, g, w_t, out_dtype):
        return self._rows(g, w_t, None, out_dtype)

    def grad_weight(self, a, g, gather_idx, out_dtype):
        rows = a.index_select(0, gather_idx) if gather_idx is not None else a
        dw = torch.zeros(self.experts, rows.shape[1], g.shape[1], dtype=out_dtype, device=g.device)
        for e, s, n in self.segs:
            torch.mm(rows[s:s + n].t(), g[s:s + n], out=dw[e]) if out_dtype == g.dtype else \
                dw[e].copy_(rows[s:s + n].t() @ g[s:s + n])
        return dw

    def grad_bias(self, g):
        out = g.new_zeros(self.experts, g.shape[1], dtype=torch.float32)
        for e, s, n in self.segs:
            out[e] = g[s:s + n].float().sum(0)
        return out


def _backward(dy, x, gather_idx, counts, w_up, b_up, w_down, b_down, h, activation, recompute, need_dx):
    with torch.autocast(x.device.type, enabled=False):
        return algorithm.backward(LoopGemms(counts), dy, x, gather_idx, w_up, b_up, w_down, b_down, h, activation,
                                  recompute, need_dx)


_setup_context, _grads = algorithm.autograd(_backward)


class LoopMLP(torch.autograd.Function):
    """``(y, h)`` of the algorithm on :class:`LoopGemms`, and its backward."""

    @staticmethod
    def forward(ctx, x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute):
        # ctx-style, as eager.differentiable: where a Function has a separate
        # ``setup_context``, torch binds its arguments through ``inspect.signature`` on every
        # call (54 us of a 460 us forward and backward at 64 rows on this CPU). The operands
        # are in the compute dtype already (``prepare``); autocast would refuse the matmuls
        # into preallocated results.
        with torch.autocast(x.device.type, enabled=False):
            out = algorithm.forward(LoopGemms(counts), x, gather_idx, w_up, b_up, w_down, b_down, activation,
                                    recompute)
        _setup_context(ctx, (x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute), out)
        return out

    backward = staticmethod(_grads)


def grouped_mlp(x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
                b_down: Tensor | None, activation: str, recompute: bool = False) -> Tensor:
    """The expert backend contract of ``lightning_hetermoe.moe.experts``, one matmul per expert.
    Runs in the inputs' dtype (under autocast, the weights are cast to the autocast dtype as
    autocast would cast them for a matmul)."""
    from .contract import prepare

    x, w_up, b_up, w_down, b_down = prepare(x, w_up, b_up, w_down, b_down, activation)
    y, _ = LoopMLP.apply(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute)
    return y
