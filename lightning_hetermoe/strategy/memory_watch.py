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
    averages: int = 0  # weight averages on the device (Lightning's WeightAveraging)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.averages

    def describe(self) -> str:
        from ..profile.memory import format_bytes as f

        return (f"weights {f(self.weights)}, gradients {f(self.gradients)}, optimizer state {f(self.optimizer)}, "
                f"buffers {f(self.buffers)}" + (f", weight averages {f(self.averages)}" if self.averages else ""))


def held_state(module: nn.Module, optimizers: list, averages: int = 0) -> Held:
    """``averages``: bytes of the weight averages the rank keeps on its device."""
    out = Held(averages=averages)
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


def optimizer_bytes_per_param(optimizers: list) -> float:
    """Bytes of state an optimizer keeps per parameter (fp32): Adam-like 8, SGD with
    momentum 4, plain SGD 0; unknown ones priced as Adam."""
    from ..profile.memory import optimizer_state_bytes

    most = 0.0
    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        momentum = any(g.get("momentum", 0) for g in inner.param_groups)
        most = max(most, optimizer_state_bytes(type(inner).__name__, momentum))
    return most


def optimizer_step_bytes(optimizers: list) -> float:
    """Bytes of temporaries an optimizer step allocates beside the state, as torch steps
    these optimizers where their parameters are: a fused step none; a multi-tensor one (the
    default on a GPU) the square root of the second moment of every parameter of a group at
    once, 4 bytes each; a per-parameter one a few tensors the size of the largest parameter
    (measured on CPU: 3). Priced as Adam, as :func:`optimizer_bytes_per_param` prices
    unknown optimizers; plain SGD allocates none."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    from ..profile.memory import FOREACH_STEP_BYTES

    most = 0.0
    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        if type(inner).__name__ == "SGD" and not any(g.get("momentum", 0) for g in inner.param_groups):
            continue
        step = 0.0
        for group in inner.param_groups:
            params = [p for p in group["params"] if p is not None]
            if not params or group.get("fused"):
                continue
            foreach = group.get("foreach")
            if foreach is None:  # torch's default: multi-tensor where every parameter's device has the kernels
                foreach = all(p.device.type in _get_foreach_kernels_supported_devices() for p in params)
            if foreach:
                step += FOREACH_STEP_BYTES * sum(p.numel() for p in params)
            else:
                step = max(step, 3.0 * max(p.numel() * 4 for p in params))
        most = max(most, step)
    return most


def predict_rank(module: nn.Module, expert_pieces: Callable, *, mode: str, dense_shards: int,
                 optimizer_bytes: float, activations: float, step: float | None = None,
                 expert_rows: float = 0.0, averages: float = 0.0) -> Any:
    """This rank's :class:`~lightning_hetermoe.profile.memory.RankMemory` from what it holds
    (``averages``: bytes of the weight averages it keeps on its device)."""
    from ..model_contract import moe_layers
    from ..profile.memory import RankMemory, working_bytes

    layers = [layer for _, layer in moe_layers(module)]
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters()}
    params = {id(p): p for p in module.parameters()}.values()
    dense = sum(p.numel() for p in params if id(p) not in expert_ids)
    dense_bytes = sum(p.numel() * p.element_size() for p in params if id(p) not in expert_ids)
    experts = sum(p.numel() for layer in layers for p in layer.experts.parameters())
    full_layer, local_layer = 0, 0
    for l, layer in enumerate(layers):
        named = list(layer.experts.named_parameters(recurse=False))
        full_layer = max(full_layer, sum(expert_pieces(l, n, p).numel * p.element_size() for n, p in named))
        local_layer = max(local_layer, sum(p.numel() * p.element_size() for _, p in named))
    param_bytes = next(iter(params)).element_size() if dense or experts else 4
    working = working_bytes(mode, layer_expert_bytes=full_layer, local_layer_expert_bytes=local_layer,
                            dense_bytes=dense_bytes)
    return RankMemory.of(dense_params=dense, expert_params=experts, dense_shards=dense_shards,
                         param_bytes=param_bytes, optimizer_bytes=optimizer_bytes, activations=activations,
                         working=working, layer=full_layer, step=step, expert_rows=expert_rows, averages=averages)


class MemoryWatch:
    """One rank's memory, checked at step boundaries and around checkpoints.

    ``budget``: bytes this rank may use (``None``: no budget); ``where``: names the rank
    (its role and device) in messages; ``device``: the compute device.

    What the rank holds (:func:`held_state`, a walk over every parameter, buffer and
    optimizer state tensor) is counted at the first :data:`COUNT_FIRST` checks, where it
    grows (gradients, then the optimizer's state), every :data:`COUNT_EVERY` after, for
    the report, and whenever the peak passes the budget, for the message: not at every
    step, where the walk is host time inside a GPU step (~0.5 ms at issue #38's 1.1B
    parameters, more with more tensors)."""

    COUNT_FIRST = 3
    COUNT_EVERY = 50

    def __init__(self, rank: int, device: torch.device, budget: float | None, where: Callable[[], str],
                 scale: float | None = None) -> None:
        self.rank, self.device, self.budget, self.where, self.scale = rank, torch.device(device), budget, where, scale
        self.baseline = rss_bytes("VmRSS") if self.device.type == "cpu" else 0
        self.peak_state: Held = Held()
        self.predicted: Any = None  # a RankMemory, set at set-up
        self._checks = 0

    def peak(self) -> int:
        """Peak bytes this run used on its device (see the module's docstring)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(rss_bytes("VmHWM") - self.baseline, 0)

    def count(self, module: nn.Module, optimizers: list, averages: int = 0) -> Held:
        """What the rank holds now, kept as its peak state where it is the most yet."""
        held = held_state(module, optimizers, averages)
        if held.total > self.peak_state.total:
            self.peak_state = held
        return held

    def check(self, module: nn.Module, optimizers: list, at: str, averages: int = 0) -> None:
        self._checks += 1
        if self._checks <= self.COUNT_FIRST or self._checks % self.COUNT_EVERY == 0:
            self.count(module, optimizers, averages)
        if self.budget is None:
            return
        peak = self.peak()
        if peak > self.budget:
            held = self.count(module, optimizers, averages)
            scaled = f" (memory_scale {self.scale:g})" if self.scale else ""
            from ..profile.memory import format_bytes as f

            raise MemoryBudgetError(
                f"rank {self.rank} ({self.where()}) used {f(peak)} {at}, over its budget of {f(self.budget)}{scaled}; "
                f"it held {held.describe()}, and the rest ({f(max(peak - held.total, 0))}) was activations, "
                f"communication buffers and transients. "
                f"What would fit: fewer micro-batches in flight (strategy.num_microbatches), "
                f"model.activation_checkpointing=true, another mode (strategy.mode=ep, zebra or datacentric spread "
                f"the experts differently), sharded optimizer state (strategy.shard_optimizer_state=true), "
                + ("the weight average in host memory (WeightAveraging(device='cpu')), " if held.averages else "")
                + "or more devices")

    def report(self) -> dict[str, Any]:
        out = {"rank": self.rank, "where": self.where(), "peak_gb": self.peak() / GB,
               "baseline_gb": self.baseline / GB, "budget_gb": None if self.budget is None else self.budget / GB,
               "held_gb": self.peak_state.total / GB,
               "held": {k: v / GB for k, v in asdict(self.peak_state).items()}}
        if self.predicted is not None:
            out["predicted_gb"] = self.predicted.total / GB
            out["predicted"] = {k: v / GB for k, v in self.predicted.to_dict().items()}
        return out
