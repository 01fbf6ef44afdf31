"""Which expert backend was fastest on each kind of device, as ``bench/expert_kernels.py --write`` measured.

The measurements ship in this package as ``measured.json``: an object keyed by device
kind (:func:`device_kind`: ``"cpu"``, ``"cuda:sm80"``, ``"cuda:sm90"``, ``"rocm:gfx942"``, ...), each entry
naming its fastest backend under ``"best"`` (``"torch"``, ``"grouped_mm"`` or
``"triton"``) with the cases and times that chose it. ``expert_backend="auto"`` reads it
through :func:`measured_backend`; a kind with no entry, or whose backend cannot run in
this process, falls back to the rule in :func:`.chooser.auto_backend`.
Read once per process with ``importlib.resources`` (so from a wheel as from the source
tree), never at import: ``import lightning_hetermoe`` stays free of file reads.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch

FILE = "measured.json"
BACKENDS = ("torch", "grouped_mm", "triton")

# Memoised by hand in a module global (see availability._IMPORT_ERROR): torch.compile
# traces resolve_backend, and reads a global where it would bypass a functools cache.
_LOADED: list[dict[str, Any]] = []


def device_kind(device: torch.device | str) -> str:
    """``"cuda:sm<major><minor>"`` for an NVIDIA GPU, ``"rocm:<gfx arch>"`` for an AMD one
    (``"rocm:gfx942"``: its capability would read as an NVIDIA kind, see
    :func:`.availability.on_rocm`), the device type otherwise."""
    from .availability import on_rocm

    device = torch.device(device)
    if device.type == "cuda":
        if on_rocm():
            arch = str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or "unknown")
            return f"rocm:{arch.split(':')[0]}"  # without its feature flags (gfx942:sramecc+:xnack-)
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm{major}{minor}"
    return device.type


def shipped_json(name: str) -> dict[str, Any]:
    """A JSON object shipped in this package (empty when missing, unreadable or not an object)."""
    try:
        data = json.loads(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))
    except (OSError, ValueError, ModuleNotFoundError, TypeError):
        return {}
    return data if isinstance(data, dict) else {}


def load() -> dict[str, Any]:
    """The shipped measurements (empty when the file is missing or unreadable)."""
    if not _LOADED:
        _LOADED.append(shipped_json(FILE))
    return _LOADED[0]


def measured_backend(kind: str) -> str | None:
    """The backend measured fastest on ``kind`` of device, or ``None`` if none was."""
    entry = load().get(kind)
    best = entry.get("best") if isinstance(entry, dict) else None
    return best if best in BACKENDS else None
