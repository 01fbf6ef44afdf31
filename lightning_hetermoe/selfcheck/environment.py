"""Versions, the device and its compute capability, NCCL, bf16."""

from __future__ import annotations

import torch

from .report import Context, Failed


def check_environment(ctx: Context) -> str:
    import lightning

    from ..kernels import unavailable_reason

    parts = [f"torch {torch.__version__}", f"lightning {lightning.__version__}", _triton_version(ctx)]
    if ctx.device.type == "cuda":
        if not torch.cuda.is_available():
            raise Failed("--device cuda, but CUDA is not available in this process")
        name = torch.cuda.get_device_name(ctx.device)
        major, minor = torch.cuda.get_device_capability(ctx.device)
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        bf16 = "yes" if (major, minor) >= (8, 0) else "no (compute capability < 8.0)"
        parts += [f"device {name} (sm {major}.{minor})", f"CUDA {torch.version.cuda}", f"NCCL {nccl}",
                  f"bf16 {bf16}"]
    else:
        parts += ["device cpu", "NCCL n/a (no CUDA)", "bf16 n/a (cpu)"]
    why = unavailable_reason(ctx.device)
    if why:
        parts.append(f"triton kernels unavailable: {why}")
    return ", ".join(parts)


def _triton_version(ctx: Context) -> str:
    try:
        import triton
    except Exception as err:
        return f"triton not importable ({type(err).__name__}: {err})"
    return f"triton {triton.__version__}"
