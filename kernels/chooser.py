"""Which expert backend runs, chosen in one place: ``expert_backend`` (auto, torch,
grouped_mm, triton) on a device, to the function that runs it, or one message saying why
it cannot run there.

``auto``: first what ``bench/expert_kernels.py --write`` measured fastest on this kind of device
(``measured.json``, keyed ``"cpu"``, ``"cuda:sm90"``, ...) if that backend can run here;
otherwise Triton where it emits tensor-core code (CUDA, compute capability 8.0 and up)
and the per-expert torch loop elsewhere: CPU, and V100 (sm70) / T4 (sm75), whose tensor
cores Triton does not use. Never the Triton interpreter.

On CUDA ``auto`` also looks at each call's compute dtype (autocast's where it is on, else
the inputs'): ``torch._grouped_mm`` is sync-free only for bf16 on sm90/sm100, so a measured
``grouped_mm`` runs bf16 there and every other dtype (fp16, fp32 under ``32-true``) takes
the rule above instead of grouped_mm's host-synced loop (:func:`backend_for`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor

from .availability import (
    grouped_mm_available,
    grouped_mm_sync_free,
    grouped_mm_unavailable_reason,
    triton_available,
    triton_uses_tensor_cores,
    unavailable_reason,
)

GroupedMLP = Callable[..., Tensor]
BACKENDS = ("auto", "torch", "grouped_mm", "triton")

# Resolved "auto" per device, memoised by hand (a module global: torch.compile traces
# resolve_backend, see availability). Tests that change what auto sees clear it.
_AUTO: dict[str, str] = {}
_WARNED: set[str] = set()


def auto_backend(device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend ``expert_backend="auto"`` runs on ``device``, by name (see the module);
    with ``dtype``, the one it runs for inputs of that dtype (``None``: the device's choice)."""
    from .measured import device_kind, measured_backend

    device = torch.device(device)
    best = measured_backend(device_kind(device))
    if best == "torch":
        return "torch"
    if best == "grouped_mm" and grouped_mm_available(device) and (
            device.type != "cuda" or dtype is None
            or grouped_mm_sync_free(dtype, torch.cuda.get_device_capability(device))):
        return "grouped_mm"
    if best == "triton" and device.type == "cuda" and triton_available(device):
        return "triton"
    if triton_uses_tensor_cores(device) and triton_available(device):
        return "triton"
    return "torch"


def why_not(name: str, device: torch.device | str) -> str:
    """Why ``expert_backend=name`` cannot run on ``device`` (empty: it can), as one sentence
    naming the field and what would be valid; every check of the backend says this."""
    device = torch.device(device)
    if name not in BACKENDS:
        return f"model.moe.expert_backend={name!r} is invalid: must be one of {BACKENDS}"
    reason = (unavailable_reason(device) if name == "triton" and not triton_available(device) else
              grouped_mm_unavailable_reason(device) if name == "grouped_mm" and not grouped_mm_available(device)
              else "")
    if not reason:
        return ""
    return (f"model.moe.expert_backend={name!r} cannot run on {device}: {reason}; use expert_backend=auto "
            f"(the fastest that runs there) or torch")


def _function(name: str) -> GroupedMLP:
    from . import grouped_mlp, grouped_mlp_grouped_mm, grouped_mlp_torch

    return {"torch": grouped_mlp_torch, "triton": grouped_mlp, "grouped_mm": grouped_mlp_grouped_mm}[name]


def backend_for(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs ``expert_backend=name`` on ``device`` for inputs of ``dtype``
    (``auto`` resolved per dtype on CUDA; any other name as given)."""
    if name != "auto":
        return name
    key = f"{device.type}:{device.index}:{dtype if device.type == 'cuda' else ''}"
    if key not in _AUTO:
        _AUTO[key] = auto_backend(device, dtype if device.type == "cuda" else None)
    return _AUTO[key]


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the experts multiply inputs of ``dtype`` in: autocast's where it is on for
    ``device`` (every backend casts to it first, see ``contract.prepare``), else ``dtype``."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else dtype


def runs_on_host_counts(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``expert_backend=name`` runs inputs of ``dtype`` (before autocast) on the torch
    loop, which reads ``counts`` on the host: the ``torch`` backend, and Triton's fallback for
    what it does not multiply on CUDA (plain fp32, see ``triton_falls_back``). Callers that
    know so hand it host counts and save the loop's device sync."""
    from .availability import triton_falls_back

    dtype = compute_dtype(dtype, device)
    chosen = backend_for(name, device, dtype)
    return chosen == "torch" or chosen == "triton" and triton_falls_back(dtype, device)


def _auto_by_dtype(x: Tensor, *args, **kwargs) -> Tensor:
    # by the dtype the GEMMs run in: under autocast fp32 activations multiply in bf16 (on
    # sm90 torch's grouped GEMM, measured fastest there), not as the fp32 they arrive in
    return _function(backend_for("auto", x.device, compute_dtype(x.dtype, x.device)))(x, *args, **kwargs)


def resolve_backend(name: str, device: torch.device) -> GroupedMLP:
    """The function that runs ``expert_backend=name`` on ``device``; ``ValueError`` with
    :func:`why_not`'s sentence where it cannot run. ``auto`` on CUDA chooses at each call
    from the inputs' dtype (:func:`backend_for`)."""
    if name == "auto":
        if device.type == "cuda":
            return _auto_by_dtype
        return _function(backend_for(name, device, torch.float32))
    problem = why_not(name, device)
    if problem:
        raise ValueError(problem)
    if name == "triton" and device.type == "cuda" and not triton_uses_tensor_cores(device):
        key = f"{device.type}:{device.index}"
        if key not in _WARNED:  # asked for explicitly: it runs, slower than the plan's price
            _WARNED.add(key)
            major, minor = torch.cuda.get_device_capability(device)
            warnings.warn(f"model.moe.expert_backend='triton' on {device} (compute capability {major}.{minor}, below "
                          f"8.0) runs Triton's dots on the CUDA cores, not the tensor cores the cost model prices; "
                          f"expert_backend=auto runs the torch loop (cuBLAS, tensor cores) here", stacklevel=2)
    return _function(name)
