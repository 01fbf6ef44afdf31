"""What every kernel backend of the expert MLP does before its op: check the activation,
and cast the operands as autocast would (the ops are opaque to autocast)."""

from __future__ import annotations

import torch
from torch import Tensor


def prepare(x: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor, b_down: Tensor | None,
            activation: str) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    if activation not in ("gelu", "swiglu"):
        raise ValueError(f"activation={activation!r} is invalid: must be 'gelu' or 'swiglu'")
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    x, w_up, b_up, w_down, b_down = [t.to(dtype) if t is not None and t.dtype != dtype else t
                                     for t in (x, w_up, b_up, w_down, b_down)]
    return x, w_up, b_up, w_down, b_down


def fake_mlp(x: Tensor, gather_idx: Tensor, counts: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
             b_down: Tensor | None, activation: str, recompute: bool) -> tuple[Tensor, Tensor]:
    """Shapes only (what ``torch.compile`` traces): ``(y [M, d_model], h [M, H] or empty)``."""
    M = gather_idx.shape[0]
    y = x.new_empty(M, w_down.shape[-1])
    return y, (x.new_empty(0) if recompute else x.new_empty(M, w_up.shape[-1]))
