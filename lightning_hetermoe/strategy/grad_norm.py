"""The clipping norm's arithmetic: squared norms with no copy of a gradient, and the scaling.

Every backend sums the squares of the gradients its rank holds (each counted once over the
ranks) and the strategy scales them by ``clip / norm``. Done per tensor as
``g.double().square().sum()``, the sum wrote a float64 copy of each gradient and then a
second one for the squares: 36 bytes moved per fp32 element in three kernels, 16 bytes per
element of the largest gradient held at once (an embedding of 151,936 x 2,048 held 5 GB
for the clip alone), and float64 arithmetic, which the A40, L40S and T4 run at 1/32-1/64
of their fp32 rate. Here each tensor's norm is taken in one pass over its elements,
accumulated in fp32 (torch's multi-tensor norm, as Lightning's own clipping takes it: one
kernel per device and dtype on CUDA, 16-bit gradients read as they are); only those norms
are squared and summed in float64, over tensors and then over ranks, so that how a rank's
tensors are cut moves the sum by no more than fp32 rounding of a 65,536-element chunk
(``CPU_CHUNK``), relatively ~1e-7.

No host sync (a sparse gradient's coalescing aside): every result stays a device tensor
until the optimizer reads it.

The scaling itself is one more pass over every gradient (read and written: 8 bytes per fp32
element) before the optimizer reads them again. torch's fused steps (Adam, AdamW, SGD with
``fused=True``) take a divisor for the gradients, the hook ``GradScaler`` unscales through,
and write the divided gradient back: handed ``1 / coef`` there (:func:`fold_into_step`), the
clip costs the step 4 bytes per element instead of 8 and one launch fewer, and leaves the
same clipped gradients behind (parameters within fp32 rounding of the scaled ones: a
division where the pass multiplied).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


# CUDA's multi-tensor norm reduces a tensor chunk by chunk (a partial sum per 65,536
# elements, then their sum). The CPU's accumulates a whole tensor in a few fp32 lanes, which
# drifts by percents over hundreds of millions of elements (7% at 268M, measured; Lightning's
# clip has the same drift there): on the CPU a tensor goes in as views of this many elements,
# each accurate to ~1e-7, their squares summed in float64.
CPU_CHUNK = 1 << 16


def _pieces(t: Tensor) -> list[Tensor]:
    if t.is_sparse:  # a sparse embedding's gradient: its summed rows are what it holds
        t = t.coalesce().values()
    if t.device.type != "cpu" or t.numel() <= CPU_CHUNK or not t.is_contiguous():
        return [t]
    return list(t.view(-1).split(CPU_CHUNK))


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    # the multi-tensor kernels take one device and dtype per launch
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    # fp32 for fp32 and 16-bit gradients; a float64 model's own precision
    return torch.float64 if dtype == torch.float64 else torch.float32


def _norms(group: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Each tensor's 2-norm, accumulated (and returned) in :func:`_accumulator`'s dtype."""
    if _accumulator(dtype) == dtype:
        return list(torch._foreach_norm(group, 2))  # accumulated in their own precision
    try:
        return list(torch._foreach_norm(group, 2, dtype=torch.float32))
    except TypeError:  # a torch whose multi-tensor norm has no dtype argument: upcast, a copy each
        return list(torch._foreach_norm([t.float() for t in group], 2))


def squared_norm(tensors: Iterable[Tensor | None], device: torch.device | str) -> Tensor:
    """Sum of the squares of every element of ``tensors`` (``None`` and empty ones skipped):
    a 0-d float64 tensor on ``device``."""
    present = [piece for t in tensors if t is not None and t.numel() for piece in _pieces(t.detach())]
    if not present:
        return torch.zeros((), dtype=torch.float64, device=device)
    # one stack and one cast per device and dtype, not a cast per tensor (hundreds of launches)
    norms = [torch.stack(_norms(group, dtype)).to(device=device, dtype=torch.float64)
             for (_, dtype), group in _by_device_and_dtype(present).items()]
    return torch.cat(norms).square().sum()


def squared_row_norms(tensor: Tensor) -> Tensor:
    """Per row of dim 0 (an expert's slot in a stacked expert tensor), the sum of the
    squares of its elements: float64, shape ``[tensor.shape[0]]``."""
    rows = tensor.detach().reshape(tensor.shape[0], -1)
    width = CPU_CHUNK if rows.device.type == "cpu" else rows.shape[1] or 1
    parts = [torch.linalg.vector_norm(part, 2, dim=1, dtype=_accumulator(rows.dtype))
             for part in rows.split(width, dim=1)]
    return torch.stack(parts).double().square().sum(0)


def scale_(tensors: Iterable[Tensor | None], coef: Tensor) -> None:
    """Multiply every tensor in place by the 0-d ``coef``, cast once per device and dtype."""
    present = [t for t in tensors if t is not None]
    for (device, dtype), group in _by_device_and_dtype(present).items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))


def clip_coefficient(total_norm: Tensor, clip_val: float) -> Tensor:
    """``clip / norm``, at most 1 (torch's and Lightning's clip: 1e-6 keeps a zero norm finite)."""
    return (clip_val / (total_norm + 1e-6)).clamp(max=1.0)


def step_takes_scale(optimizer) -> bool:
    """Whether ``optimizer``'s own step divides the gradients by ``optimizer.grad_scale``:
    torch's fused steps, with no scale set by anyone else (a loss scaler sets one for its
    own step)."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    return (bool(getattr(opt, "_step_supports_amp_scaling", False)) and bool(opt.param_groups)
            and all(g.get("fused") for g in opt.param_groups)
            and getattr(opt, "grad_scale", None) is None and getattr(opt, "found_inf", None) is None)


def fold_into_step(optimizer, coef: Tensor) -> None:
    """Scale the gradients by ``coef`` inside ``optimizer``'s next step (see the module
    docstring; only where :func:`step_takes_scale`). :func:`unfold` after the step."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    # the fused kernels read the divisor as one fp32 value on the parameters' device
    opt.grad_scale = coef.reciprocal().to(torch.float32)


def clip_(optimizer, grads: list[Tensor | None], total_norm: Tensor, clip_val: float, fold: bool = True) -> None:
    """Clip ``grads`` (``optimizer``'s, their global norm ``total_norm``) at ``clip_val``:
    the coefficient folded into the optimizer's next step where ``fold`` and the step takes
    one (:func:`step_takes_scale`), else every gradient scaled by it."""
    coef = clip_coefficient(total_norm, clip_val)
    if fold and step_takes_scale(optimizer):
        fold_into_step(optimizer, coef)
    else:
        scale_(grads, coef)


def unfold(optimizer) -> None:
    """Take back a divisor :func:`fold_into_step` left (a step that never ran included)."""
    getattr(optimizer, "_optimizer", optimizer).__dict__.pop("grad_scale", None)
