"""One process: the model as written, every expert local, no collective in the step.

``mode="auto"`` on one device lands here; the emulated clock and the busy meter still
time its tasks, so a one-device run is measured like any other."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...model_contract import moe_layers
from ...materialize import Holding, Materializer
from ..grad_norm import squared_norm
from .base import ParallelBackend, Simulated


class SingleDeviceBackend(ParallelBackend):
    schedule = "single"

    def __init__(self, clock: Any, device: torch.device, measure_busy: bool = False) -> None:
        self.clock, self.device, self.measure_busy = clock, device, measure_busy
        self._emulation: Any = None

    def setup(self, module: nn.Module, fitting: bool, materialize: Materializer | None = None) -> None:
        if materialize is not None:
            materialize(module, Holding(dense=True, rows=[list(range(layer.num_experts))
                                                          for _, layer in moe_layers(module)]))
        if fitting and self._emulation is None:
            self._emulation = self.clock.install(module, self.device, self.measure_busy)

    def restore(self, module: nn.Module, gather: bool) -> None:
        if self._emulation is not None:
            self._emulation.remove()
            self._emulation = None

    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter], dense_sq: Tensor | None = None) -> Tensor:
        return squared_norm((p.grad for p in params), self.device)

    def simulated(self, placement=None) -> Simulated:
        return Simulated("ep", ep_size=1)  # the simulator's EP on one device is a single device

    def describe_rank(self, rank: int) -> str:
        names = [d.name for d in self.clock.devices]
        return f"single device {names[0] if names else '?'}"
