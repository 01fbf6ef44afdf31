"""A zebra training step's memory does not grow with the number of micro-batches R at a
fixed global batch: what the executor holds between tasks (every device), and the step's
peak allocation (CUDA: the allocator's peak over the step, under mixed precision, where a
cast cache kept per micro-batch would hold R low-precision copies of the dense weights)."""

from __future__ import annotations

import gc
from typing import Any

import torch

from .report import Context, Failed, joined
from .runs import data, loopback_plan, mixed_precision, one_run, tiny_model

MICROBATCHES = (2, 4, 8)  # GLOBAL_BATCH = 8 sequences: down to one a micro-batch
R_GROWTH = 1.25  # the largest R may need at most this much of the smallest R's bytes


def judge_flat_in_r(values: dict[int, int], what: str) -> str:
    """Pass when ``values`` (bytes per R) at the largest R stay within ``R_GROWTH`` times
    those at the smallest, which must be non-zero (else the bound holds vacuously)."""
    rs = sorted(values)
    detail = f"{what}: " + ", ".join(f"R={r} {values[r]:,} B" for r in rs)
    if values[rs[0]] <= 0:
        raise Failed(f"{detail}: nothing measured at R={rs[0]}")
    growth = values[rs[-1]] / values[rs[0]]
    if growth > R_GROWTH:
        raise Failed(f"{detail}: R={rs[-1]} needs {growth:.2f}x R={rs[0]} (limit {R_GROWTH}x)")
    return detail


def _step_probe(ctx: Context, step: int = 1) -> Any:
    """A callback: the executor accounts what it holds; on CUDA, the allocator's peak of
    training step ``step`` above what was allocated when it started."""
    import lightning as L

    class StepProbe(L.Callback):
        peak: int | None = None
        start = 0

        def on_train_start(self, trainer, pl_module):
            trainer.strategy.backend.account_memory = True

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if ctx.cuda and batch_idx == step:
                gc.collect()
                torch.cuda.synchronize(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
                self.start = torch.cuda.memory_allocated(ctx.device)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if ctx.cuda and batch_idx == step:
                torch.cuda.synchronize(ctx.device)
                self.peak = torch.cuda.max_memory_allocated(ctx.device) - self.start

    return StepProbe()


def _one_r(ctx: Context, R: int) -> tuple[int, int | None]:
    """Most bytes the executor held after a task of the last training step, and the CUDA
    peak of a step (``None`` elsewhere)."""
    probe = _step_probe(ctx)
    # on CUDA dense weights of a few MB: R cast copies of them would dwarf the activations
    model = tiny_model(d_model=256 if ctx.cuda else 16)
    with one_run(ctx, f"memory-r{R}", "zebra", loopback_plan(ctx, num_microbatches=R), max_steps=2,
                 precision=mixed_precision(ctx), callbacks=[probe]) as (strategy, trainer):
        trainer.fit(model, datamodule=data())
        last = strategy.backend.last_step
    if last is None or not last.held_bytes:
        raise Failed(f"R={R}: no training step was accounted")
    return max(last.held_bytes), probe.peak


def check_memory_in_r(ctx: Context) -> str:
    held, peaks = {}, {}
    for R in MICROBATCHES:
        held[R], peaks[R] = _one_r(ctx, R)
    details, problems = [], []
    measured = [("executor held between tasks", held)]
    if ctx.cuda:
        measured.append(("CUDA peak of a step", peaks))
    for what, values in measured:
        try:
            details.append(judge_flat_in_r(values, what))
        except Failed as problem:
            problems.append(str(problem))
    if problems:
        raise Failed(joined(problems))
    return f"global batch fixed, {mixed_precision(ctx)}; " + "; ".join(details)
