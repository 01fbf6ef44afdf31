"""The expert MLP on the Triton kernels (the ``triton`` backend), with its backward.

The algorithm is :mod:`.algorithm`'s, over the Triton grouped GEMMs of :mod:`.launch`.
Forward and backward are each one ``torch.library.custom_op``, so ``torch.compile`` sees
two opaque nodes with fake (shape-only) implementations instead of tracing into kernel
launches; eagerly the same bodies run as an ``autograd.Function`` (:class:`GroupedMLPFunction`,
without the ops' Python layers: :mod:`.eager`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import algorithm, eager
from .availability import triton_falls_back
from .contract import fake_mlp, prepare
from .launch import RowTiles, grouped_gemm, grouped_wgrad, segment_sum

_NS = "lightning_hetermoe"


class TritonGemms:
    """:class:`~.algorithm.Gemms` on the Triton kernels: gathers and biases fused; the GEMMs
    over the same rows share one row tile map."""

    def __init__(self, counts: Tensor) -> None:
        self.counts = counts
        self.row_tiles = RowTiles(counts)

    def up(self, x, gather_idx, w_up, b_up):
        return grouped_gemm(x, w_up, self.counts, gather_idx=gather_idx, bias=b_up, row_tiles=self.row_tiles)

    def down(self, a, w_down, b_down):
        return grouped_gemm(a, w_down, self.counts, bias=b_down, row_tiles=self.row_tiles)

    def grad_rows(self, g, w_t, out_dtype):
        return grouped_gemm(g, w_t, self.counts, out_dtype=out_dtype, row_tiles=self.row_tiles)

    def grad_weight(self, a, g, gather_idx, out_dtype):
        return grouped_wgrad(a, g, self.counts, gather_idx=gather_idx, out_dtype=out_dtype)

    def grad_bias(self, g):
        return segment_sum(g, self.counts)


def _grouped_mlp(
    x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Optional[Tensor],
    w_down: Tensor, b_down: Optional[Tensor], activation: str, recompute: bool,
) -> tuple[Tensor, Tensor]:
    """Returns ``(y, h)``; ``h`` (the pre-activation, kept for backward) is empty under ``recompute``."""
    return algorithm.forward(TritonGemms(counts), x, gather_idx, w_up, b_up, w_down, b_down, activation, recompute)


grouped_mlp_op = torch.library.custom_op(f"{_NS}::grouped_mlp", mutates_args=())(_grouped_mlp)
grouped_mlp_op.register_fake(fake_mlp)


def _grouped_mlp_backward(
    dy: Tensor, x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Optional[Tensor],
    w_down: Tensor, b_down: Optional[Tensor], h: Tensor, activation: str, recompute: bool, need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dw_up, db_up, dw_down, db_down)``; an absent bias, or dx when not needed, is empty."""
    return algorithm.backward(TritonGemms(counts), dy, x, gather_idx, w_up, b_up, w_down, b_down, h, activation,
                              recompute, need_dx)


grouped_mlp_backward_op = torch.library.custom_op(f"{_NS}::grouped_mlp_backward",
                                                  mutates_args=())(_grouped_mlp_backward)
grouped_mlp_backward_op.register_fake(algorithm.fake_backward)
_setup_context, _backward = algorithm.register_autograd(
    grouped_mlp_op, eager.direct(grouped_mlp_backward_op, _grouped_mlp_backward))
# what the backend calls: the kernels themselves eagerly, the ops under torch.compile
mlp_eager = eager.differentiable(grouped_mlp_op, _grouped_mlp, _setup_context, _backward)
# the op's autograd as an ``autograd.Function`` (``forward`` returns ``(y, h)`` like the op)
GroupedMLPFunction = mlp_eager.function


def grouped_mlp(x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
                b_down: Tensor | None, activation: str, recompute: bool = False) -> Tensor:
    """The expert backend contract of ``lightning_hetermoe.moe.experts`` on Triton kernels;
    on CUDA, inputs Triton would multiply as plain fp32 (fp32 without TF32, fp64) run on the
    torch loop instead (:func:`~.availability.triton_runs_dtype`, decided from the dtype at
    each call; the loop reads ``counts`` on the host: one sync per call on that path)."""
    x, w_up, b_up, w_down, b_down = prepare(x, w_up, b_up, w_down, b_down, activation)
    if triton_falls_back(x.dtype, x.device):
        from .loop import grouped_mlp as loop_mlp

        return loop_mlp(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute=recompute)
    y, _ = mlp_eager(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute)
    return y
