"""Heterogeneous GPUs emulated on CPU processes: real math, real collectives, modelled clock;
and the same task boundaries measured on real devices (:class:`BusyMeter`)."""

from .clock import (
    FAITHFUL_SLIP,
    EmulatedWorkload,
    EmulationWarning,
    Emulator,
    TaskStats,
    emulated_workload,
    emulation_cost_model,
    rank_emulator,
    workload_model,
)
from .hooks import EmulationHandle, apply_emulation, install, installed
from .meter import BusyMeter

__all__ = [
    "FAITHFUL_SLIP",
    "BusyMeter",
    "EmulatedWorkload",
    "EmulationHandle",
    "EmulationWarning",
    "Emulator",
    "TaskStats",
    "apply_emulation",
    "emulated_workload",
    "emulation_cost_model",
    "install",
    "installed",
    "rank_emulator",
    "workload_model",
]
