"""Experts stored as one 3-D weight per layer, and the backends that run them.

Backend contract (shared by the pure-torch path here and the Triton kernels in
``lightning_hetermoe.kernels``)::

    grouped_mlp(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation,
                recompute=False) -> Tensor[M, d_model]

``x`` is ``[N, d_model]``; ``gather_idx`` (long, ``[M]``) lists the rows of ``x`` to
process, grouped by expert: the first ``counts[0]`` belong to expert 0, the next
``counts[1]`` to expert 1, and so on (``counts`` is a long tensor ``[E]`` summing to M).
``w_up`` is ``[E, d_model, H]`` with ``H = d_ff`` (GELU) or ``2 * d_ff`` (SwiGLU: gate
columns first, then up), ``w_down`` is ``[E, d_ff, d_model]``, biases are ``[E, H]`` and
``[E, d_model]`` or ``None``. Row ``m`` of the result is expert ``e(m)`` applied to
``x[gather_idx[m]]``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from ..config import EXPERT_BACKENDS
from ..kernels.activation import forward as activate

GroupedMLP = Callable[..., Tensor]


def grouped_mlp_torch(
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
    """Sort-by-expert then one matmul per non-empty segment: the CPU path."""
    xs = x.index_select(0, gather_idx)
    outs = []
    for e, (start, n) in enumerate(_segments(counts)):
        if n == 0:
            continue
        seg = xs.narrow(0, start, n)
        if recompute:
            outs.append(torch.utils.checkpoint.checkpoint(_expert_fn, seg, e, w_up, b_up, w_down, b_down,
                                                          activation, use_reentrant=False))
        else:
            outs.append(_expert_fn(seg, e, w_up, b_up, w_down, b_down, activation))
    if not outs:
        # No rows: still return a tensor in the graph of the weights, so that callers
        # can treat "no tokens" like any other batch (zero gradients, not None).
        return xs.new_zeros(0, w_down.shape[-1]) + 0 * w_down.sum()
    return torch.cat(outs, 0)


def _expert_fn(seg, e, w_up, b_up, w_down, b_down, activation):
    h = seg @ w_up[e]
    if b_up is not None:
        h = h + b_up[e]
    y = activate(h, activation) @ w_down[e]
    if b_down is not None:
        y = y + b_down[e]
    return y


def _segments(counts: Tensor) -> list[tuple[int, int]]:
    sizes = counts.tolist()
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return list(zip(starts, sizes))


def resolve_backend(name: str, device: torch.device) -> GroupedMLP:
    """``auto``: Triton on CUDA, torch elsewhere. Asking for Triton where it cannot run raises."""
    if name not in EXPERT_BACKENDS:
        raise ValueError(f"moe.expert_backend={name!r} is invalid: must be one of {EXPERT_BACKENDS}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return grouped_mlp_torch
    from .. import kernels

    if name == "triton" and not kernels.triton_available(device):
        raise ValueError(
            f"moe.expert_backend='triton' cannot run on device {device}: "
            f"{kernels.unavailable_reason(device)}; use expert_backend=torch or auto"
        )
    if name == "auto" and not kernels.triton_available(device):
        return grouped_mlp_torch
    return kernels.grouped_mlp


class Experts(nn.Module):
    """``num_experts`` MLPs (GELU or SwiGLU) held as stacked weights ``[E, ...]``.

    ``expert_ids`` records which global experts these rows are; a parallel strategy may
    replace the module's weights with a slice and update it, the layer never needs to know.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str, bias: bool,
                 backend: str = "auto", recompute: bool = False) -> None:
        super().__init__()
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self.backend, self.recompute = backend, recompute
        h = 2 * d_ff if activation == "swiglu" else d_ff
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, h))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.b_up = nn.Parameter(torch.zeros(num_experts, h)) if bias else None
        self.b_down = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        nn.init.normal_(self.w_up, std=1.0 / math.sqrt(d_model))
        nn.init.normal_(self.w_down, std=1.0 / math.sqrt(d_ff))
        self.register_buffer("expert_ids", torch.arange(num_experts), persistent=False)

    @property
    def num_local_experts(self) -> int:
        return self.w_up.shape[0]

    def forward(self, x: Tensor, gather_idx: Tensor, counts: Tensor) -> Tensor:
        """``counts`` may be on the host (the torch path reads it there without a sync; the
        kernels get a copy from pinned memory, ordered on the stream)."""
        fn = resolve_backend(self.backend, x.device)
        if fn is not grouped_mlp_torch and counts.device != x.device:
            counts = counts.pin_memory().to(x.device, non_blocking=True) if x.device.type == "cuda" \
                else counts.to(x.device)
        return fn(x, gather_idx, counts, self.w_up, self.b_up, self.w_down, self.b_down,
                  self.activation, recompute=self.recompute)
