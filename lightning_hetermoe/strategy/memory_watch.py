"""Each rank's memory: what it holds, its peak, and its budget.

A rank's *state* is what it keeps between steps: its parameters, their gradients, its
optimizer state, its buffers, counted from the tensors themselves. Its *peak* is the
process's high-water mark: on a GPU the allocator's peak on the device; on the CPU the
resident set's (``VmHWM``) above what the process held when its strategy started (the
interpreter, torch, Lightning and the data: what a GPU would not count).

A *budget* applies where the cluster config gives one: ``memory_scale`` scales every
device's memory (an emulated V100 with ``memory_scale: 0.01`` has 0.32 GB, as the clock
scales its speed), and a rank whose peak passes its budget ends the run with an error
that names it, its device, its budget, and what it held; the other ranks end with it.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

GB = 1e9


class MemoryBudgetError(RuntimeError):
    """A rank's peak passed its device's memory budget."""


def return_freed_memory() -> None:
    """On a CPU rank, hand tensors' freed memory back to the system at once.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MB), after
    which tensors of that size come from the heap and their memory stays with the process
    when freed: a rank's resident set then drifts hundreds of MB above its live tensors.
    A fixed 1 MB threshold keeps large tensors in their own mappings, returned on free, so
    a CPU rank's footprint is what it holds (what a GPU's allocator accounts)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, which also stops the dynamic raise
    except (OSError, AttributeError):
        pass


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its high-water mark (``VmHWM``) in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


@dataclass
class Held:
    """Bytes of what a rank keeps between steps."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers

    def describe(self) -> str:
        return (f"weights {self.weights / GB:.2f} GB, gradients {self.gradients / GB:.2f} GB, optimizer state "
                f"{self.optimizer / GB:.2f} GB, buffers {self.buffers / GB:.2f} GB")


def held_state(module: nn.Module, optimizers: list) -> Held:
    out = Held()
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.weights += p.numel() * p.element_size()
        if p.grad is not None:
            out.gradients += p.grad.numel() * p.grad.element_size()
    for b in module.buffers():
        out.buffers += b.numel() * b.element_size()
    for opt in optimizers:
        for state in getattr(opt, "_optimizer", opt).state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    out.optimizer += v.numel() * v.element_size()
    return out


class MemoryWatch:
    """One rank's memory, checked at step boundaries and around checkpoints.

    ``budget``: bytes this rank may use (``None``: no budget); ``where``: names the rank
    (its role and device) in messages; ``device``: the compute device."""

    def __init__(self, rank: int, device: torch.device, budget: float | None, where: Callable[[], str],
                 scale: float | None = None) -> None:
        self.rank, self.device, self.budget, self.where, self.scale = rank, torch.device(device), budget, where, scale
        self.baseline = rss_bytes("VmRSS") if self.device.type == "cpu" else 0
        self.peak_state: Held = Held()
        self.events: list[str] = []

    def peak(self) -> int:
        """Peak bytes this run used on its device (see the module's docstring)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(rss_bytes("VmHWM") - self.baseline, 0)

    def check(self, module: nn.Module, optimizers: list, at: str) -> None:
        held = held_state(module, optimizers)
        if held.total > self.peak_state.total:
            self.peak_state = held
        if self.budget is None:
            return
        peak = self.peak()
        if peak > self.budget:
            scaled = f" (memory_scale {self.scale:g})" if self.scale else ""
            raise MemoryBudgetError(
                f"rank {self.rank} ({self.where()}) used {peak / GB:.3f} GB {at}, over its budget of "
                f"{self.budget / GB:.3f} GB{scaled}; it held {held.describe()}, and the rest "
                f"({max(peak - held.total, 0) / GB:.3f} GB) was activations, communication buffers and transients. "
                f"What would fit: fewer micro-batches in flight (strategy.num_microbatches), "
                f"model.activation_checkpointing=true, another mode (strategy.mode=ep, zebra or datacentric spread "
                f"the experts differently), sharded optimizer state (strategy.shard_optimizer_state=true), or more "
                f"devices")

    def report(self) -> dict[str, Any]:
        return {"rank": self.rank, "where": self.where(), "peak_gb": self.peak() / GB,
                "budget_gb": None if self.budget is None else self.budget / GB,
                "held_gb": self.peak_state.total / GB,
                "held": {k: v / GB for k, v in asdict(self.peak_state).items()}}
