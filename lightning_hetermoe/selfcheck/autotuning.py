"""No autotuning after set-up (CUDA). By default the Triton kernels do not autotune at all
(each launch takes the shipped table's or the heuristic's config; a CPU test shows no
autotuner on that path). Autotuning on request (``HETERMOE_AUTOTUNE=1``) must still keep
its benchmarks, which synchronise the whole device, out of the steps: every (shape, dtype,
row bucket) a zebra step launches must have been tuned by ``kernels.warm_up`` at set-up.
This check runs with autotuning on and counts with Triton's autotuning listener, which
Triton calls whenever a kernel meets a key its in-memory cache lacks (benchmarked, or read
from the disk cache)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from .report import Context, Failed, Skip
from .runs import data, loopback_plan, mixed_precision, one_run, tiny_model


@dataclass
class Tuning:
    phase: str  # "set-up" or "steps"
    kernel: str
    key: tuple
    benchmarked: bool  # False: the timings came from Triton's disk cache (no device sync)


@contextlib.contextmanager
def listening(phase: list[str]) -> Iterator[list[Tuning]]:
    """Every new autotuning key inside the block, tagged with ``phase[0]`` at the time
    (Triton's ``knobs.autotuning.listener``; the previous listener is put back)."""
    knobs = _autotuning_knobs()
    seen: list[Tuning] = []

    def listener(*, fn: Any, key: Any, cache_hit: bool, **_: Any) -> None:
        seen.append(Tuning(phase[0], getattr(fn, "__name__", str(fn)), tuple(key), not cache_hit))

    previous, knobs.listener = knobs.listener, listener
    try:
        yield seen
    finally:
        knobs.listener = previous


def _autotuning_knobs() -> Any:
    import triton

    knobs = getattr(getattr(triton, "knobs", None), "autotuning", None)
    if knobs is None or not hasattr(knobs, "listener"):
        raise Skip(f"triton {triton.__version__} has no autotuning listener (triton.knobs.autotuning.listener)")
    return knobs


def judge_autotuning(tunings: Sequence[Tuning]) -> str:
    """Pass when set-up tuned at least one key and no training step met a new one."""
    setup = [t for t in tunings if t.phase == "set-up"]
    steps = [t for t in tunings if t.phase == "steps"]
    detail = (f"set-up tuned {len(setup)} keys ({sum(t.benchmarked for t in setup)} benchmarked, the rest from "
              f"Triton's disk cache); training steps met {len(steps)} new keys")
    if steps:
        where = ", ".join(f"{t.kernel} {t.key}" + (" (benchmarked)" if t.benchmarked else "") for t in steps[:4])
        raise Failed(f"{detail}: {where}")
    if not setup:
        raise Failed(detail + ": nothing autotuned at set-up, so the Triton kernels never ran")
    return detail


def check_autotuning(ctx: Context) -> str:
    import lightning as L

    from ..kernels import unavailable_reason
    from ..kernels.tuning import autotuning

    why = unavailable_reason(ctx.device)
    if why:
        raise Skip(why)
    if torch.cuda.get_device_capability(ctx.device) < (8, 0):
        raise Skip("the Triton expert kernels need sm80 or newer")
    phase = ["set-up"]

    class Phase(L.Callback):  # set-up (and kernels.warm_up in it) ends before training starts
        def on_train_start(self, trainer, pl_module):
            phase[0] = "steps"

    with listening(phase) as tunings, autotuning(True):
        with one_run(ctx, "autotuning", "zebra", loopback_plan(ctx), max_steps=3, precision=mixed_precision(ctx),
                     callbacks=[Phase()]) as (_, trainer):
            trainer.fit(tiny_model(d_model=64, expert_backend="triton"), datamodule=data())
    return judge_autotuning(tunings)
