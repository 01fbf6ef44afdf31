"""Rotary position embedding on CUDA as one Triton kernel, behind a custom op (called
eagerly without its Python layers: :mod:`.eager`).

The pack's attention (``model/transformer.py``) rotates queries and keys with torch's
ops: an fp32 copy, four products and two sums over the halves, a concatenation and the cast
back, some 48 bytes read and written per element forward and as many backward. At D1's
width on a 16K-token micro-batch that is about 3 GB per layer for the queries and keys,
some 4.5 ms on an A40 (arithmetic, not a measurement), against the 72 bytes per token and
width the cost model gives all of the attention block's elementwise work. The kernel
(``triton_src.rotary_kernel``) reads ``x`` once and writes the result once, in fp32 and
rounded once as torch's ops are; its gradient is the same kernel rotating back.

It runs where ``x`` is on a CUDA device that runs Triton; on CPU torch's ops run (the
interpreter is for tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import eager
from .availability import Setting, triton_available

_NS = "lightning_hetermoe"
MAX_HEAD_DIM = 512
fused = Setting(True)  # fused(False): torch's ops everywhere, for side-by-side benchmarks


def runs_fused(x: Tensor, cos: Tensor) -> bool:
    """Whether the rotation of ``x`` (``[B, H, S, D]``) by ``cos``'s table runs on the kernel."""
    return (fused.value and x.device.type == "cuda" and x.dim() == 4 and x.stride(-1) == 1
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and cos.dtype == torch.float32
            and x.shape[-1] % 2 == 0 and 0 < x.shape[-1] <= MAX_HEAD_DIM and triton_available(x.device))


def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``[x1 * cos - x2 * sin, x1 * sin + x2 * cos]`` of ``x = [x1 | x2]`` in ``x``'s dtype."""
    from .launch import rotary as launch_rotary

    return launch_rotary(x, cos, sin)


rotary_op = torch.library.custom_op(f"{_NS}::rotary", mutates_args=())(_rotary)


@rotary_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x.new_empty(x.shape)


def _rotary_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of :func:`rotary`: ``grad`` rotated back."""
    from .launch import rotary as launch_rotary

    return launch_rotary(grad, cos, sin, inverse=True)


rotary_backward_op = torch.library.custom_op(f"{_NS}::rotary_backward", mutates_args=())(_rotary_backward)


@rotary_backward_op.register_fake
def _(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return grad.new_empty(grad.shape)


rotary_backward = eager.direct(rotary_backward_op, _rotary_backward)


def _setup_context(ctx, inputs, output) -> None:
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad: Tensor):
    cos, sin = ctx.saved_tensors
    return rotary_backward(grad, cos, sin), None, None


rotary_op.register_autograd(_backward, setup_context=_setup_context)
# what the attention calls: the kernel itself eagerly, the op under torch.compile
rotary = eager.differentiable(rotary_op, _rotary, _setup_context, _backward)
