"""Can the Triton kernels run on a device? Answered without importing triton's kernels.

On CUDA they need ``triton`` importable. On CPU they run only through Triton's
interpreter, which is for tests, so only when ``TRITON_INTERPRET=1`` asks for it; the env
var is read at each call (see ``triton_src`` for why import time would be too early).
"""

from __future__ import annotations

import importlib.util
import os

import torch


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
        return _triton_import_error() or ""
    return f"Triton kernels support CUDA (and CPU through TRITON_INTERPRET=1), not {device.type!r}"


def triton_available(device: torch.device | str) -> bool:
    return unavailable_reason(device) == ""
