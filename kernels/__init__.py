"""Triton expert kernels, shipped as ``lightning_hetermoe.kernels``.

Importing this package is cheap and never fails on a CPU-only machine: triton and the
kernel modules load on first use. Modules, one job each:

- ``availability``: whether the kernels can run on a device, and why not.
- ``triton_src``: the Triton kernels (gather-GEMM with epilogues, grouped weight gradient).
- ``configs``: autotuning candidates per GPU generation, interpreter block sizes.
- ``launch``: Python launchers (variant per device, sync-free grids).
- ``activation``: GELU/SwiGLU and their derivatives.
- ``mlp``: the expert MLP as custom ops with autograd (the ``grouped_mlp`` backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .availability import triton_available, unavailable_reason

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["grouped_gemm", "grouped_mlp", "grouped_wgrad", "GroupedMLPFunction", "triton_available",
           "unavailable_reason", "warm_up"]


def grouped_mlp(x: "Tensor", gather_idx: "Tensor", counts: "Tensor", w_up: "Tensor", b_up: "Tensor | None",
                w_down: "Tensor", b_down: "Tensor | None", activation: str, recompute: bool = False) -> "Tensor":
    """Expert backend (contract in ``lightning_hetermoe.moe.experts``) on the Triton kernels."""
    from .mlp import grouped_mlp as impl

    return impl(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation, recompute=recompute)


def warm_up(d_model: int, d_ff: int, activation: str, bias: bool, dtype: "torch.dtype", device: "torch.device",
            rows: int = 256, experts: int = 2) -> None:
    """Launch every kernel of the expert MLP, forward and backward, once for these shapes,
    so that Triton's autotuner picks its configs now. Its benchmarks synchronise the whole
    device: inside a training step that could wait on a kernel that waits on a peer (a
    posted receive), so the strategy calls this at set-up, before any collective is in
    flight. Configs are keyed by the weight shapes and dtypes, not by the row count."""
    import torch

    from .mlp import grouped_mlp as impl

    h = 2 * d_ff if activation == "swiglu" else d_ff
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype).requires_grad_()

    x, w_up, w_down = rand(rows, d_model), rand(experts, d_model, h), rand(experts, d_ff, d_model)
    b_up, b_down = (rand(experts, h), rand(experts, d_model)) if bias else (None, None)
    counts = torch.tensor([rows // 2, rows - rows // 2] + [0] * (experts - 2), device=device)
    gather_idx = torch.arange(rows, device=device)
    impl(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation).float().sum().backward()
    torch.cuda.synchronize(device)


def __getattr__(name: str):
    # Lazy so that `import lightning_hetermoe.kernels` does not import triton.
    if name in ("grouped_gemm", "grouped_wgrad"):
        from . import launch

        return getattr(launch, name)
    if name == "GroupedMLPFunction":
        from .mlp import GroupedMLPFunction

        return GroupedMLPFunction
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
