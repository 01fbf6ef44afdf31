"""Expert activations and their derivatives, written out so backward needs only ``h``.

Saving the pre-activation ``h`` alone (and recomputing ``act(h)`` in backward) keeps one
``[M, H]`` tensor alive per layer instead of two. Derivatives are formed in fp32. SwiGLU
runs on fused Triton kernels where :func:`.swiglu.runs_fused` says so (CUDA), else on
torch's ops below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import swiglu


def forward(h: Tensor, activation: str) -> Tensor:
    if activation == "gelu":
        return F.gelu(h)  # exact erf form, as the reference
    if activation == "swiglu":
        if swiglu.runs_fused(h):
            return swiglu.swiglu(h)
        gate, up = h.chunk(2, dim=-1)  # gate columns first, then up (backend contract)
        return F.silu(gate) * up
    raise ValueError(f"activation={activation!r} is invalid: must be 'gelu' or 'swiglu'")


def backward(h: Tensor, grad: Tensor, activation: str) -> Tensor:
    """d act(h) / dh applied to ``grad``; same shape and dtype as ``h``."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, h)
    if activation == "swiglu":
        if swiglu.runs_fused(h):
            return swiglu.swiglu_backward(h, grad)
        gate, up = h.float().chunk(2, dim=-1)
        g = grad.float()
        # d/d gate of silu(gate) * up is silu'(gate) * up (aten's fused silu_backward);
        # d/d up is silu(gate). Written into the two halves of one result: no concatenation.
        out = torch.empty_like(h)
        d_gate, d_up = out.chunk(2, dim=-1)
        d_gate.copy_(torch.ops.aten.silu_backward(g * up, gate))
        d_up.copy_(F.silu(gate).mul_(g))
        return out
    raise ValueError(f"activation={activation!r} is invalid: must be 'gelu' or 'swiglu'")
