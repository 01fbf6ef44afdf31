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

Backends (``MoEConfig.expert_backend``):

- ``torch``: :func:`grouped_mlp_torch`, one matmul per expert from Python.
- ``grouped_mm``: ``lightning_hetermoe.kernels.grouped_mlp_grouped_mm``, PyTorch's own
  grouped GEMM (``torch._grouped_mm``), one call per GEMM for all experts; CPU and CUDA.
- ``triton``: ``lightning_hetermoe.kernels.grouped_mlp``, gather-GEMM kernels with fused
  epilogues. On CUDA from sm80 (Ampere) on they run on tensor cores; asked for explicitly
  on a V100 (sm70) or T4 (sm75) they still run where Triton supports the GPU, but their
  dots run on the CUDA cores, without tensor cores.
- ``auto``: see ``lightning_hetermoe.kernels.chooser``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from ..seeded_init import draw_seed, fill_, fill_normal_, generator, initialise

GroupedMLP = Callable[..., Tensor]


# Backends and their choice live with the kernels (one chooser, one message).
from ..kernels import resolve_backend, runs_on_host_counts  # noqa: E402


class Experts(nn.Module):
    """``num_experts`` MLPs (GELU or SwiGLU) held as stacked weights ``[E, ...]``.

    ``expert_ids`` records which global experts these rows are; a parallel strategy may
    replace the module's weights with a slice and update it, the layer never needs to know.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str, bias: bool,
                 backend: str = "auto", recompute: bool = False) -> None:
        super().__init__()
        self.init_seed = draw_seed()
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self.backend, self.recompute = backend, recompute
        h = 2 * d_ff if activation == "swiglu" else d_ff
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, h))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.b_up = nn.Parameter(torch.zeros(num_experts, h)) if bias else None
        self.b_down = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        self.register_buffer("expert_ids", torch.arange(num_experts), persistent=False)
        initialise(self)
        if backend == "auto":
            # Resolve for the CPU now, outside any torch.compile trace (CUDA resolves on first
            # use: querying a GPU here would initialise CUDA at model construction).
            resolve_backend(backend, torch.device("cpu"))

    @property
    def num_local_experts(self) -> int:
        return self.w_up.shape[0]

    def reset_parameters(self) -> None:
        self.reset_experts(self.expert_ids.tolist())

    def reset_experts(self, rows: list[int]) -> None:
        """Local row ``i`` initialised as global expert ``rows[i]``, each expert from its own
        generator (up ~ N(0, 1/d_model), down ~ N(0, 1/d_ff), biases 0): the same values
        whichever experts this module holds."""
        for i, e in enumerate(rows):
            gen = generator(self.init_seed, e)
            fill_normal_(self.w_up[i], 1.0 / math.sqrt(self.d_model), gen)
            fill_normal_(self.w_down[i], 1.0 / math.sqrt(self.d_ff), gen)
        for b in (self.b_up, self.b_down):
            fill_(b, 0.0)

    def counts_on_device(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the backend on ``device`` takes ``counts`` for inputs of ``dtype`` where they
        were computed (the kernels), not on the host (the torch loop reads its segment
        bounds there)."""
        return not runs_on_host_counts(self.backend, device, dtype)

    def forward(self, x: Tensor, gather_idx: Tensor, counts: Tensor) -> Tensor:
        """``counts`` may be on the host (the torch path reads it there without a sync; the
        kernels get a copy from pinned memory, ordered on the stream) or on the device (the
        kernels take it there; the torch path reads it to the host once, here, not again in
        its backward)."""
        fn = resolve_backend(self.backend, x.device)
        if not self.counts_on_device(x.device, x.dtype):
            counts = counts.cpu()
        elif counts.device != x.device:
            counts = counts.pin_memory().to(x.device, non_blocking=True) if x.device.type == "cuda" \
                else counts.to(x.device)
        return fn(x, gather_idx, counts, self.w_up, self.b_up, self.w_down, self.b_down,
                  self.activation, recompute=self.recompute)
