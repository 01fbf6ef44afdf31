"""The expert MLP on PyTorch's own grouped GEMM, ``torch._grouped_mm`` (the ``grouped_mm`` backend).

Each GEMM of the MLP, forward and backward, is one ``_grouped_mm`` call over all experts
instead of one matmul per expert from Python. Pure torch: nothing here imports triton
(the SwiGLU between the GEMMs takes the fused kernels on CUDA, see ``swiglu``).

What ``torch._grouped_mm(a, b, offs=...)`` accepts (checked on CPU with torch 2.13; the
CUDA side from ``aten/native/cuda/GroupedBlas.cpp``):

- dtypes float32, bfloat16, float16 (not float64); the result has ``a``'s dtype (no fp32
  result from bf16 inputs). ``offs`` is int32, the *inclusive* cumulative sum of the group
  sizes, on the operands' device. Bias is not supported (added here per row).
- 2-D x 3-D (``[M, K] @ [E, K, N] -> [M, N]``, rows grouped by ``offs``) for the forward
  GEMMs and the input gradient, 2-D x 2-D (``[K, M] @ [M, N] -> [E, K, N]``, the reduction
  grouped) for the weight gradients. Empty groups and zero rows are fine (zero results).
- layouts: each operand row- or column-major in its last two dims with the other stride a
  multiple of 16 bytes; on CUDA also a 16-byte-aligned data pointer. Transposed views of
  the weights qualify as they are; operands that do not (a width that is no multiple of
  16 bytes) are copied here into a padded buffer of the same major order, so odd shapes
  work, only slower. Where the grouped dimension is the contiguous one, CUDA also needs
  every group's size in bytes to be a multiple of 16 (a device-side assert otherwise): the
  forms used here never group along a contiguous dimension.
- CPU: a C++ loop of one ``mm`` per group, the same products as the per-expert loop
  without its Python overhead. CUDA: a sync-free CUTLASS kernel for bf16 on sm90/sm100;
  for every other dtype or GPU, the same loop after copying ``offs`` to the host (a device
  sync per GEMM), so ``auto`` takes it on CUDA only where it was measured fastest.
- autograd: torch has a derivative for it, but (2.13) it fails on a stride-0 incoming
  gradient (``y.sum().backward()``), and its fake kernel for ``torch.compile`` admits bf16
  only. So, as with the Triton kernels, forward and backward here are two
  ``torch.library.custom_op`` with fake implementations, the backward written with more
  ``_grouped_mm`` calls (the algorithm of :mod:`.algorithm`): it keeps only the
  pre-activation ``h`` (nothing with ``recompute``) and gathers the input rows again rather
  than saving them. Eagerly the same bodies run as an ``autograd.Function``, without the
  ops' Python layers (:mod:`.eager`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import algorithm, eager
from .contract import fake_mlp, prepare

_NS = "lightning_hetermoe"


def _acceptable(t: Tensor) -> bool:
    """Whether ``_grouped_mm`` takes ``t`` as it is (its stride check, in its order)."""
    align = 16 // t.element_size()
    (rows, cols), (s_rows, s_cols) = t.shape[-2:], t.stride()[-2:]
    if s_rows == 1 and s_cols >= max(1, rows):  # column-major (checked first by torch)
        ok = s_cols % align == 0
    elif s_cols == 1 and s_rows >= max(1, cols):  # row-major
        ok = s_rows % align == 0
    else:
        ok = False
    return ok and (t.device.type == "cpu" or t.data_ptr() % 16 == 0)


def _operand(t: Tensor) -> Tensor:
    """``t``, or a copy of it (same shape, same major order) whose leading stride is padded
    to 16 bytes.

    The order is kept: in the weight gradients' 2-D x 2-D form the grouped dimension is the
    reduction, strided in ``rows.t()``; made contiguous by a row-major copy, CUDA's kernel
    would need every group's size there to be a multiple of 16 bytes, and asserts on the
    device where it is not (seen on an H200 at d_ff 12 in bf16)."""
    if _acceptable(t):
        return t
    align = 16 // t.element_size()

    def padded(n: int) -> int:
        return max(align, -(-n // align) * align)

    rows, cols = t.shape[-2:]
    if t.stride(-2) == 1 and t.stride(-1) != 1:  # column-major: pad the columns' stride
        buf = t.new_empty(*t.shape[:-2], cols, padded(rows))[..., :rows].transpose(-1, -2)
    else:
        buf = t.new_empty(*t.shape[:-1], padded(cols))[..., :cols]
    return buf.copy_(t)


def _gmm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    out = torch._grouped_mm(_operand(a), _operand(b), offs=offs)
    # CUDA builds pad the result's row stride to 16 bytes; the rest of the MLP (and the
    # fake kernels) work on contiguous tensors.
    return out.contiguous()


def _offsets(counts: Tensor, device: torch.device) -> Tensor:
    return torch.cumsum(counts.to(device), 0, dtype=torch.int32)


def _owner(counts: Tensor, rows: int, device: torch.device) -> Tensor:
    """The expert of each grouped row; ``output_size`` spares reading ``counts`` on the host."""
    counts = counts.to(device)
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts, output_size=rows)


def _segment_sum(rows: Tensor, owner: Tensor, experts: int) -> Tensor:
    """Per-expert column sums (a bias gradient), in fp32."""
    return rows.new_zeros(experts, rows.shape[1], dtype=torch.float32).index_add_(0, owner, rows.float())


class GroupedMMGemms:
    """:class:`~.algorithm.Gemms` on ``torch._grouped_mm``: rows gathered and biases added
    by torch ops around it."""

    def __init__(self, counts: Tensor, rows: int, device: torch.device, bias: bool) -> None:
        self.experts = counts.shape[0]
        self.offs = _offsets(counts, device)
        self.owner = _owner(counts, rows, device) if bias else None

    def up(self, x, gather_idx, w_up, b_up):
        h = _gmm(x.index_select(0, gather_idx), w_up, self.offs)
        if b_up is not None:
            h += b_up.index_select(0, self.owner)
        return h

    def down(self, a, w_down, b_down):
        y = _gmm(a, w_down, self.offs)
        if b_down is not None:
            y += b_down.index_select(0, self.owner)
        return y

    def grad_rows(self, g, w_t, out_dtype):
        return _gmm(g, w_t, self.offs).to(out_dtype)  # in g's dtype: _grouped_mm has no fp32 result

    def grad_weight(self, a, g, gather_idx, out_dtype):
        rows = a.index_select(0, gather_idx) if gather_idx is not None else a
        # the 2-D x 2-D form groups the reduction: dW[e] = rows[of e]^T @ g[of e]
        return _gmm(rows.t(), g, self.offs).to(out_dtype)

    def grad_bias(self, g):  # asked only of a layer with biases: ``owner`` is there
        return _segment_sum(g, self.owner, self.experts)


def _gemms(counts: Tensor, gather_idx: Tensor, x: Tensor, b_up: Tensor | None, b_down: Tensor | None) -> GroupedMMGemms:
    return GroupedMMGemms(counts, gather_idx.shape[0], x.device, b_up is not None or b_down is not None)


def _grouped_mm_mlp(
    x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Optional[Tensor],
    w_down: Tensor, b_down: Optional[Tensor], activation: str, recompute: bool,
) -> tuple[Tensor, Tensor]:
    """Returns ``(y, h)``; ``h`` (the pre-activation, kept for backward) is empty under ``recompute``."""
    return algorithm.forward(_gemms(counts, gather_idx, x, b_up, b_down), x, gather_idx, w_up, b_up, w_down,
                             b_down, activation, recompute)


grouped_mm_mlp_op = torch.library.custom_op(f"{_NS}::grouped_mm_mlp", mutates_args=())(_grouped_mm_mlp)
grouped_mm_mlp_op.register_fake(fake_mlp)


def _grouped_mm_mlp_backward(
    dy: Tensor, x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Optional[Tensor],
    w_down: Tensor, b_down: Optional[Tensor], h: Tensor, activation: str, recompute: bool, need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dw_up, db_up, dw_down, db_down)``; an absent bias, or dx when not needed, is empty."""
    return algorithm.backward(_gemms(counts, gather_idx, x, b_up, b_down), dy, x, gather_idx, w_up, b_up, w_down,
                              b_down, h, activation, recompute, need_dx)


grouped_mm_mlp_backward_op = torch.library.custom_op(f"{_NS}::grouped_mm_mlp_backward",
                                                     mutates_args=())(_grouped_mm_mlp_backward)
grouped_mm_mlp_backward_op.register_fake(algorithm.fake_backward)
_setup_context, _backward = algorithm.register_autograd(
    grouped_mm_mlp_op, eager.direct(grouped_mm_mlp_backward_op, _grouped_mm_mlp_backward))
# what the backend calls: torch's grouped GEMMs themselves eagerly, the ops under torch.compile
mlp_eager = eager.differentiable(grouped_mm_mlp_op, _grouped_mm_mlp, _setup_context, _backward)


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
    """The expert backend contract of ``lightning_hetermoe.moe.experts`` on ``torch._grouped_mm``."""
    x, w_up, b_up, w_down, b_down = prepare(x, w_up, b_up, w_down, b_down, activation)
    y, _ = mlp_eager(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute)
    return y
