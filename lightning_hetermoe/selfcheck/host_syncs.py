"""Host syncs of one zebra training step, and of one single-device step's dispatch, under
CUDA's sync debug mode (CUDA)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .report import Context, Failed
from .runs import data, loopback_plan, one_run, tiny_model

# what c10's warn_or_error_on_sync() warns (TORCH_WARN) in sync debug mode "warn", at every
# synchronizing CUDA operation; matching it exactly counts no other warning that mentions
# synchronising (torch's own notices, a library's deprecation)
SYNC_WARNING = "called a synchronizing CUDA operation"


def is_sync_warning(message: Any) -> bool:
    return SYNC_WARNING in str(message)


def _sync_debug_callback(step: int = 1) -> Any:
    """A Lightning callback that turns CUDA's sync debug mode on for one training step (the
    second: the first warms the allocator and autotunes)."""
    import lightning as L

    class SyncDebug(L.Callback):  # nothing to count off CUDA (the runs still go through, for tests)
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step and torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")

    return SyncDebug()


def syncs_in(syncs: list[Any], filename: str) -> int:
    """How many of the recorded sync warnings a line of ``filename`` (a base name) made."""
    return sum(1 for w in syncs if os.path.basename(w.filename) == filename)


def _step_syncs(ctx: Context, name: str, mode: str, plan: Any, n_layers: int) -> list[Any]:
    import warnings

    with warnings.catch_warnings(record=True) as seen:  # module state: the fibers' warnings land here too
        warnings.simplefilter("always")
        with one_run(ctx, name, mode, plan, max_steps=2, callbacks=[_sync_debug_callback()]) as (_, trainer):
            trainer.fit(tiny_model(n_layers), datamodule=data())
    return [w for w in seen if is_sync_warning(w.message)]


def check_host_syncs(ctx: Context) -> str:
    """Host syncs in one zebra training step (a loopback plan: every exchange goes through
    comm on one GPU), counted by CUDA's sync debug mode: the design allows one per (layer,
    micro-batch), the round's host header; every other drains the queue zebra overlaps on.
    Then one single-device step: its dispatch reads nothing back where the experts run on
    the kernels (the default top-k keeps every choice), one per layer where they run the
    torch loop (which fp32 without TF32 does on CUDA, Triton's fallback)."""
    from ..kernels import runs_on_host_counts

    n_layers, plan = 2, loopback_plan(ctx)
    syncs = _step_syncs(ctx, "syncs", "zebra", plan, n_layers)
    per = len(syncs) / (n_layers * plan.num_microbatches)
    where = sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs})
    detail = (f"{len(syncs)} host syncs in a step of {n_layers} layers x {plan.num_microbatches} micro-batches: "
              f"{per:.1f} per (layer, micro-batch); at " + (", ".join(where[:6]) or "nowhere"))
    if per > 1:
        raise Failed(detail + " (the design allows 1)")
    single = _step_syncs(ctx, "syncs-single", "auto", None, n_layers)  # one device: the single-device backend
    on_kernels = not runs_on_host_counts("auto", ctx.device, torch.float32)  # the tiny model trains in fp32
    allowed = 0 if on_kernels else n_layers
    dispatch = syncs_in(single, "dispatch.py")
    detail += (f"; single device ({'kernels' if on_kernels else 'torch loop'}): {len(single)} in a step, "
               f"{dispatch} in the dispatch")
    if dispatch > allowed:
        raise Failed(detail + f" (allowed: {allowed})")
    return detail
