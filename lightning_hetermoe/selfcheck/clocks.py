"""Zebra's busy split on the device's clock: tasks, exchange and step all CUDA events (CUDA)."""

from __future__ import annotations

from typing import Any

from .report import Context, Failed
from .runs import data, loopback_plan, one_run, tiny_model


def check_clocks(ctx: Context) -> str:
    """A zebra step on one GPU (a loopback plan): every transfer is timed from its issue to
    its completion, the step on the tasks' clock, and attention + experts + comm + idle is
    that step (before, the exchange read zero outside emulation and the step was the host's)."""
    import lightning as L

    class Busy(L.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[dict, float, float, int]] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            s = trainer.strategy
            out = s.backend.last_step
            spans = sum(e - b for _, b, e in out.transfers)
            self.seen.append((s.rank_busy(), s.clock.device_step_s(), spans, len(out.transfers)))

    probe = Busy()
    with one_run(ctx, "clocks", "zebra", loopback_plan(ctx), max_steps=3, callbacks=[probe]) as (_, trainer):
        trainer.fit(tiny_model(), datamodule=data())
    if len(probe.seen) != 3:
        raise Failed(f"{len(probe.seen)} training steps read, 3 expected")
    busy, step, spans, transfers = probe.seen[-1]
    kinds = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in busy.items())
    detail = f"step {step * 1e3:.2f} ms on the device clock: {kinds}; {transfers} transfers, {spans * 1e3:.2f} ms in flight"
    if not transfers or spans <= 0:
        raise Failed("the exchange was not timed: " + detail)
    if min(busy.values()) < 0 or abs(sum(busy.values()) - step) > 1e-6 * max(step, 1e-3):
        raise Failed("the kinds do not add up to the step: " + detail)
    return detail
