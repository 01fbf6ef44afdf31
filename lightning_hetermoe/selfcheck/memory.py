"""What the zebra executor holds in a forward-only step does not grow with depth."""

from __future__ import annotations

import gc

import torch

from .report import Context, Failed
from .runs import data, loopback_plan, one_run, tiny_model

MEMORY_DEPTHS = (2, 4)
MEMORY_GROWTH = 1.25  # deeper models may hold at most this much more between tasks


def _held_in_validation(ctx: Context, n_layers: int) -> tuple[list[int], int | None]:
    """Bytes the executor held after each task of the last forward-only step, and the
    device's peak allocation over the run (CUDA)."""
    import lightning as L

    class AccountMemory(L.Callback):
        # The backend exists only once the strategy set up; the steps come after.
        def on_validation_start(self, trainer, pl_module):
            trainer.strategy.backend.account_memory = True

    if ctx.cuda:
        gc.collect()  # the last run's model may still sit in a reference cycle, counted in the peak
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with one_run(ctx, f"memory-{n_layers}", "zebra", loopback_plan(ctx, n_layers), limit_val_batches=2,
                  callbacks=[AccountMemory()]) as (strategy, trainer):
        trainer.validate(tiny_model(n_layers), datamodule=data(), verbose=False)
        last = strategy.backend.last_eval
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    if last is None or not last.held_bytes:
        raise Failed(f"{n_layers} layers: no forward-only step was accounted")
    return last.held_bytes, peak


def check_memory(ctx: Context) -> str:
    held, peaks = {}, {}
    for n in MEMORY_DEPTHS:
        held[n], peaks[n] = _held_in_validation(ctx, n)
    shallow, deep = (max(held[n]) for n in MEMORY_DEPTHS)
    detail = ", ".join(f"{n} layers: max {max(held[n])} B held after a task" for n in MEMORY_DEPTHS)
    if ctx.cuda:
        detail += "; CUDA peak per layer: " + ", ".join(f"{n} layers {peaks[n] / n / 2 ** 20:.2f} MiB"
                                                        for n in MEMORY_DEPTHS)
    problems = []
    if shallow == 0:  # the growth bound below would hold vacuously
        problems.append("nothing was ever held: the accounting saw no rows in flight")
    elif deep > MEMORY_GROWTH * shallow:
        problems.append(f"{MEMORY_DEPTHS[1]} layers held {deep / shallow:.2f}x the {MEMORY_DEPTHS[0]}-layer "
                        f"bytes (limit {MEMORY_GROWTH}x)")
    left = {n: held[n][-1] for n in MEMORY_DEPTHS if held[n][-1]}
    if left:
        problems.append(f"bytes still held after the last task: {left}")
    if problems:
        raise Failed("; ".join(problems) + "; " + detail)
    return detail
