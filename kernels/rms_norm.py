"""RMSNorm on CUDA as two Triton kernels, forward and backward, behind a custom op
(called eagerly without its Python layers: :mod:`.eager`).

The pack's RMSNorm (``model/transformer.py``) on torch's ops takes ``x`` to fp32, squares
it, averages, multiplies by the reciprocal root, casts back to ``x``'s dtype and multiplies
by the weight: some 38 bytes per element read and written forward, and autograd's backward
keeps fp32 copies and moves about twice that. Two norms a layer at D1's width (1,024) over
a 16K-token micro-batch move about 3.4 GB that way, forward and backward, some 5 ms on an
A40 beside the ~25 ms the cost model prices the whole attention task at (its 12 passes of
16-bit ``[tokens, d]`` for every elementwise op of the block; arithmetic, not a
measurement). The kernels (``triton_src.rms_norm_forward_kernel``,
``rms_norm_backward_kernel``) read ``x`` once and write the output once forward, read
``x`` and the gradient once and write ``dx`` once backward, with the same roundings as
torch's ops (the normalised value rounded to ``x``'s dtype before the weight, and the
gradient through it rounded alike).

They run where ``x`` is on a CUDA device that runs Triton and its width fits one block
(:data:`MAX_WIDTH`); on CPU torch's ops run (the interpreter is for tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import eager
from .availability import Setting, triton_available

_NS = "lightning_hetermoe"
MAX_WIDTH = 16384  # one row in one block of registers
fused = Setting(True)  # fused(False): torch's ops everywhere, for side-by-side benchmarks


def runs_fused(x: Tensor, weight: Tensor) -> bool:
    """Whether the RMSNorm of ``x`` by ``weight`` runs on the kernels."""
    return (fused.value and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dtype in (torch.float32, x.dtype) and weight.dim() == 1 and x.shape[-1] == weight.shape[0]
            and 0 < x.shape[-1] <= MAX_WIDTH and triton_available(x.device))


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``((x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight, rstd)``: the output in the dtype
    that product has, and each row's reciprocal root (fp32) for the backward."""
    from .launch import rms_norm_forward

    y, rstd = rms_norm_forward(_rows(x), weight, eps, torch.promote_types(x.dtype, weight.dtype))
    return y.view(x.shape), rstd


rms_norm_op = torch.library.custom_op(f"{_NS}::rms_norm", mutates_args=())(_rms_norm)


@rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(rows, dtype=torch.float32))


def _rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of :func:`rms_norm` under ``grad``."""
    from .launch import rms_norm_backward as launch_backward

    dx, dw = launch_backward(_rows(grad), _rows(x), weight, rstd)
    return dx.view(x.shape), dw.to(weight.dtype)


rms_norm_backward_op = torch.library.custom_op(f"{_NS}::rms_norm_backward", mutates_args=())(_rms_norm_backward)


@rms_norm_backward_op.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


rms_norm_backward = eager.direct(rms_norm_backward_op, _rms_norm_backward)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, grad: Tensor, _grad_rstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad, x, weight, rstd)
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)
# what the model calls: the kernels themselves eagerly, the op under torch.compile
rms_norm = eager.differentiable(rms_norm_op, _rms_norm, _setup_context, _backward)
