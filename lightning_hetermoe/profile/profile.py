"""Measured task times per device kind: what the profiler writes and the planner reads.

A :class:`Profile` holds, for one model and one sequence length, a :class:`DeviceProfile`
per device kind (``"a40"``, ``"v100"``...): forward/backward seconds of attention+router
for micro-batches of a few token counts, of one expert for a few token counts, of the LM
head, and how many experts a rank of that kind can hold next to its other state. The
planner interpolates between the measured points (piecewise linear in tokens; beyond the
last point it scales proportionally, the regime where the kernels are compute-bound).

Everything is plain JSON: ``Profile.to_json()`` / ``Profile.from_json()``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..serialization import JsonDataclass


def _points(d: Mapping[Any, float]) -> list[tuple[float, float]]:
    return sorted((float(k), float(v)) for k, v in d.items())


def interpolate(table: Mapping[Any, float], x):
    """Piecewise-linear ``table[x]``; proportional scaling outside the measured range.
    ``x`` may be an array (each element as the number would give it, to the last bit)."""
    if isinstance(x, np.ndarray):
        return _interpolate_many(_points(table), x)
    if x <= 0:
        return 0.0
    pts = _points(table)
    if not pts:
        raise ValueError("interpolate: empty table")
    xs = [p[0] for p in pts]
    if x <= xs[0]:
        return pts[0][1] * x / xs[0] if xs[0] > 0 else pts[0][1]
    if x >= xs[-1]:
        return pts[-1][1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interpolate_many(pts: list[tuple[float, float]], x: np.ndarray) -> np.ndarray:
    if not pts:
        raise ValueError("interpolate: empty table")
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    low = ys[0] * x / xs[0] if xs[0] > 0 else np.full(x.shape, ys[0])
    out = np.where(x <= xs[0], low, ys[-1] * x / xs[-1])
    if len(xs) > 1:
        i = np.clip(np.searchsorted(xs, x, side="left"), 1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        out = np.where((x > xs[0]) & (x < xs[-1]), y0 + (y1 - y0) * (x - x0) / (x1 - x0), out)
    return np.where(x <= 0, 0.0, out)


@dataclass
class DeviceProfile:
    """Measured figures for one device kind; token counts map to seconds."""

    device: str
    # attention + router of one layer, one micro-batch of N tokens (at Profile.seq_len)
    attention_fwd_s: dict[int, float] = field(default_factory=dict)
    attention_bwd_s: dict[int, float] = field(default_factory=dict)
    # one expert MLP on N tokens
    expert_fwd_s: dict[int, float] = field(default_factory=dict)
    expert_bwd_s: dict[int, float] = field(default_factory=dict)
    # final norm + LM head + loss, forward and backward, on N tokens
    head_s: dict[int, float] = field(default_factory=dict)
    memory_gb: float = 0.0
    # n_max: experts an attention rank of this kind holds next to the attention stack.
    max_experts_attention: int | None = None
    # experts an expert rank of this kind holds (bounds n_min on the expert side).
    max_experts_expert: int | None = None

    def __post_init__(self) -> None:
        for name in ("attention_fwd_s", "attention_bwd_s", "expert_fwd_s", "expert_bwd_s", "head_s"):
            table = {int(k): float(v) for k, v in dict(getattr(self, name)).items()}
            if any(v < 0 for v in table.values()) or any(k <= 0 for k in table):
                raise ValueError(f"DeviceProfile {self.device!r}: {name} needs positive token counts and times >= 0")
            setattr(self, name, table)
        if not self.attention_fwd_s or not self.expert_fwd_s:
            raise ValueError(f"DeviceProfile {self.device!r}: attention_fwd_s and expert_fwd_s must not be empty")

    def attention(self, tokens: float, backward: bool = False) -> float:
        if backward:
            if self.attention_bwd_s:
                return interpolate(self.attention_bwd_s, tokens)
            return 3.0 * interpolate(self.attention_fwd_s, tokens)  # checkpointed: recompute + 2x
        return interpolate(self.attention_fwd_s, tokens)

    def expert(self, tokens: float, backward: bool = False) -> float:
        if backward:
            if self.expert_bwd_s:
                return interpolate(self.expert_bwd_s, tokens)
            return 3.0 * interpolate(self.expert_fwd_s, tokens)
        return interpolate(self.expert_fwd_s, tokens)

    def head(self, tokens: float) -> float | None:
        return interpolate(self.head_s, tokens) if self.head_s else None


@dataclass
class Profile(JsonDataclass):
    """Per-device-kind measurements for one model at one sequence length."""

    model: str
    seq_len: int
    devices: dict[str, DeviceProfile] = field(default_factory=dict)
    # "measured" (real GPUs), "emulated" (padded CPU ranks) or "cost_model".
    source: str = "measured"

    def __post_init__(self) -> None:
        self.devices = {
            str(k).lower(): (v if isinstance(v, DeviceProfile) else DeviceProfile(**v))
            for k, v in dict(self.devices).items()
        }
        if self.seq_len < 1:
            raise ValueError(f"Profile.seq_len={self.seq_len!r} must be >= 1")

    def get(self, device: str) -> DeviceProfile:
        key = device.lower()
        if key not in self.devices:
            raise ValueError(f"Profile has no measurements for device {device!r}; profiled: {sorted(self.devices)}")
        return self.devices[key]

