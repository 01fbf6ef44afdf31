"""SwiGLU on CUDA as two fused Triton kernels, forward and gradient, behind custom ops.

Every expert backend runs the activation between its GEMMs (:mod:`.algorithm`). In torch's
ops (:mod:`.activation`) its gradient takes an fp32 copy of ``h``, a product, ``silu``'s
derivative, ``silu``, another product and two copies into the result's halves: 17.4 GB
read and written at Mixtral-8x7B's layer shape (16,384 rows, d_ff 14,336, bf16), where one
read of ``h`` and of the incoming gradient and one write of the result move 2.35 GB; the
forward (run twice: in the backward again, for the down weight's gradient) moves 2.35 GB
against 1.41. On an H100 that is some 5 ms of memory traffic per layer beside the GEMMs.
The kernels (``triton_src.swiglu_forward_kernel``, ``swiglu_backward_kernel``) form
everything in fp32 and round once.

They run where the activation's input is on a CUDA device that runs Triton and no autograd
graph is being recorded through them (the backends call them inside their own forward and
backward; the shared expert's MLP, differentiated by torch, keeps torch's ops). On CPU
torch's ops run: the interpreter is for tests. The custom ops keep them opaque to
``torch.compile`` (the ``torch`` backend is traced through); eager calls skip the ops'
Python layers (:mod:`.eager`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import eager
from .availability import Setting, triton_available

_NS = "lightning_hetermoe"
fused = Setting(True)  # fused(False): torch's ops everywhere, for side-by-side benchmarks


def runs_fused(h: Tensor) -> bool:
    """Whether the SwiGLU of ``h`` runs on the fused kernels (CUDA with Triton, 16-bit or
    fp32, outside any autograd recording through ``h``)."""
    return (fused.value and h.device.type == "cuda" and h.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not (h.requires_grad and torch.is_grad_enabled()) and triton_available(h.device))


def _swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]``: ``[M, 2F] -> [M, F]``."""
    from .launch import swiglu as launch_swiglu

    return launch_swiglu(h)


swiglu_op = torch.library.custom_op(f"{_NS}::swiglu", mutates_args=())(_swiglu)


@swiglu_op.register_fake
def _(h: Tensor) -> Tensor:
    return h.new_empty(h.shape[0], h.shape[1] // 2)


def _swiglu_backward(h: Tensor, grad: Tensor) -> Tensor:
    """``[d_gate | d_up]`` of ``silu(gate) * up`` at ``h`` under ``grad``: ``h``'s shape and dtype."""
    from .launch import swiglu_backward as launch_swiglu_backward

    return launch_swiglu_backward(h, grad)


swiglu_backward_op = torch.library.custom_op(f"{_NS}::swiglu_backward", mutates_args=())(_swiglu_backward)


@swiglu_backward_op.register_fake
def _(h: Tensor, grad: Tensor) -> Tensor:
    return torch.empty_like(h, memory_format=torch.contiguous_format)


# what the backends call (inside their own forward and backward, no autograd through
# these): the kernels themselves eagerly, the ops under torch.compile
swiglu = eager.direct(swiglu_op, _swiglu)
swiglu_backward = eager.direct(swiglu_backward_op, _swiglu_backward)
