"""Can the expert backends run on a device? Answered without importing triton's kernels.

Triton: on CUDA it needs ``triton`` importable. On CPU it runs only through Triton's
interpreter, which is for tests, so only when ``TRITON_INTERPRET=1`` asks for it; the env
var is read at each call (see ``triton_src`` for why import time would be too early).
Triton emits tensor-core code (``mma``/``wgmma``) from compute capability 8.0 on; on
Volta (sm70) and Turing (sm75) its ``tl.dot`` runs on the CUDA cores, so ``auto`` does
not pick it there (see :func:`triton_uses_tensor_cores`).

``torch._grouped_mm`` (the ``grouped_mm`` backend): on CPU when this torch implements it
there (probed once), on CUDA wherever CUDA runs (a fast kernel for bf16 on sm90/sm100, a
per-group loop that reads the offsets on the host elsewhere).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from typing import Any, Iterator

import torch


class Setting:
    """A process-wide setting read as ``setting.value``; ``with setting(value):`` changes it
    for the block and puts the previous one back after (the fused paths' on/off, the
    launch order's row group, autotuning on request)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    @contextlib.contextmanager
    def __call__(self, value: Any) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# Memoised by hand, not with functools.cache: torch.compile traces resolve_backend and
# warns on (and bypasses) lru_cache wrappers, while a module global is a plain read.
_IMPORT_ERROR: list[str | None] = []


def _triton_import_error() -> str | None:
    if not _IMPORT_ERROR:
        if importlib.util.find_spec("triton") is None:
            _IMPORT_ERROR.append("the `triton` package is not installed")
        else:
            try:
                import triton  # noqa: F401
            except Exception as exc:  # a broken install must not break `import lightning_hetermoe`
                _IMPORT_ERROR.append(f"importing triton failed ({type(exc).__name__}: {exc})")
            else:
                _IMPORT_ERROR.append(None)
    return _IMPORT_ERROR[0]


# Triton's interpreter before 3.7 takes a scalar argument's index as int() of a 1-element
# array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
# scalars"): every kernel loop over a runtime bound fails. The compiler is not affected.
INTERPRETER_NUMPY_FIXED = (3, 7)
NUMPY_STRICT_INDEX = (2, 4)
_INTERPRETER_ERROR: list[str | None] = []  # memoised by hand, as _IMPORT_ERROR


def _major_minor(version: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", version)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def _interpreter_error() -> str | None:
    if not _INTERPRETER_ERROR:
        import triton

        try:
            import numpy
        except ImportError:
            _INTERPRETER_ERROR.append("Triton's interpreter needs numpy, which is not installed")
            return _INTERPRETER_ERROR[0]
        t, n = _major_minor(triton.__version__), _major_minor(numpy.__version__)
        if t < INTERPRETER_NUMPY_FIXED and n >= NUMPY_STRICT_INDEX:
            _INTERPRETER_ERROR.append(
                f"Triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__} (it passes "
                "scalar arguments as 1-element arrays, which numpy 2.4 no longer converts to an index): "
                "install triton>=3.7 or numpy<2.4")
        else:
            _INTERPRETER_ERROR.append(None)
    return _INTERPRETER_ERROR[0]


def unavailable_reason(device: torch.device | str) -> str:
    """Why the kernels cannot run on ``device``; empty when they can."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this process"
        return _triton_import_error() or ""
    if device.type == "cpu":
        if not _interpret_requested():
            return ("Triton kernels run on CUDA devices; on CPU only through Triton's interpreter, "
                    "which TRITON_INTERPRET=1 enables (slow, meant for tests)")
        return _triton_import_error() or _interpreter_error() or ""
    return f"Triton kernels support CUDA (and CPU through TRITON_INTERPRET=1), not {device.type!r}"


def triton_available(device: torch.device | str) -> bool:
    return unavailable_reason(device) == ""


# The first generation whose tensor cores Triton's tl.dot targets (Ampere: mma.sync for
# fp16/bf16/tf32; Hopper adds wgmma). Volta's and Turing's fp16 tensor cores are not used.
TENSOR_CORE_CAPABILITY = (8, 0)


def on_rocm() -> bool:
    """Whether torch's ``cuda`` devices are AMD GPUs (a ROCm build of torch). Their "compute
    capability" is the gfx version (MI250X's gfx90a reads (9, 0), MI300X's gfx942 (9, 4)), so
    every capability test written for NVIDIA's generations would take an MI250X for an H100:
    its measured backend, its tile table, TMA and a sync-free ``torch._grouped_mm``."""
    return getattr(torch.version, "hip", None) is not None


def triton_uses_tensor_cores(device: torch.device | str) -> bool:
    """Whether the Triton kernels' dots run on tensor cores on ``device`` (CUDA, sm80+)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= TENSOR_CORE_CAPABILITY


_GROUPED_MM_CPU_ERROR: list[str] = []  # memoised by hand, as _IMPORT_ERROR


def _grouped_mm_cpu_error() -> str:
    if not _GROUPED_MM_CPU_ERROR:
        try:  # a 2-group product of 4x4 blocks: microseconds
            a, b = torch.ones(4, 4), torch.ones(2, 4, 4)
            torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
        except Exception as exc:  # an older torch: CUDA-only kernel, or none
            _GROUPED_MM_CPU_ERROR.append(f"torch {torch.__version__} has no CPU torch._grouped_mm "
                                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        else:
            _GROUPED_MM_CPU_ERROR.append("")
    return _GROUPED_MM_CPU_ERROR[0]


def grouped_mm_unavailable_reason(device: torch.device | str) -> str:
    """Why the ``grouped_mm`` backend cannot run on ``device``; empty when it can."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8)"
    if device.type == "cpu":
        return _grouped_mm_cpu_error()
    if device.type == "cuda":
        return "" if torch.cuda.is_available() else "CUDA is not available in this process"
    return f"torch._grouped_mm runs on CPU and CUDA, not {device.type!r}"


def grouped_mm_available(device: torch.device | str) -> bool:
    return grouped_mm_unavailable_reason(device) == ""


def tf32_enabled() -> bool:
    """Whether torch's fp32 CUDA matmuls may use TF32 (what cuBLAS does under ``32-true``).

    Read through the precision API of torch >= 2.9 (``torch.backends.cuda.matmul.fp32_precision``,
    which resolves ``torch.backends.fp32_precision`` and ``set_float32_matmul_precision`` as
    well); the legacy ``allow_tf32`` flag only where that API is missing, since reading the
    legacy flag raises once a process has set precision through both APIs.
    """
    matmul = torch.backends.cuda.matmul
    try:
        return matmul.fp32_precision == "tf32"
    except (AttributeError, RuntimeError):
        return bool(matmul.allow_tf32)


def triton_runs_dtype(dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None, tf32: bool) -> bool:
    """Whether the ``triton`` backend runs inputs of ``dtype`` on its kernels (else the torch
    loop runs them, same results). On CUDA fp32 runs on Triton only as TF32 (torch allows it,
    ``tf32``, and the device has TF32 tensor cores, sm80+): plain fp32 ``tl.dot`` runs on the
    CUDA cores, compiles slowly and its bf16-sized tiles can exceed shared memory, while
    cuBLAS's fp32 GEMMs are the fast exact path. Off CUDA (the interpreter, for tests) fp32
    runs exactly on the kernels. fp64 never runs on Triton on CUDA (no tensor cores for it
    there either)."""
    if device_type != "cuda" or dtype in (torch.bfloat16, torch.float16):
        return True
    if dtype != torch.float32:
        return False
    return bool(tf32) and capability is not None and tuple(capability) >= TENSOR_CORE_CAPABILITY


def triton_falls_back(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the ``triton`` backend hands inputs of ``dtype`` on ``device`` to the torch
    loop (:func:`triton_runs_dtype` on this CUDA device under torch's TF32 setting; the CPU
    interpreter runs every dtype)."""
    return device.type == "cuda" and not triton_runs_dtype(dtype, "cuda", torch.cuda.get_device_capability(device),
                                                           tf32_enabled())


def grouped_mm_sync_free(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether ``torch._grouped_mm`` runs ``dtype`` on CUDA without a host sync: its CUTLASS
    kernel takes bf16 on sm90/sm100 only; every other dtype or GPU takes its fallback, one
    ``mm`` per group after copying the offsets to the host (a sync per GEMM). Not claimed on
    ROCm, whose gfx9 parts report capability 9.x: nothing here has timed torch's path there."""
    return (dtype == torch.bfloat16 and capability is not None and int(capability[0]) in (9, 10)
            and not on_rocm())
