"""Peak memory during zebra's dense gradient sync: at most one bucket beyond the gradients
(CUDA's allocator measures it; on CPU the sync runs and its sums are checked, then the row
is skipped: no allocator statistics)."""

from __future__ import annotations

import gc
from typing import Any

import torch

from .report import Context, Failed, Skip
from .runs import data, loopback_plan, one_run, tiny_model

# Allowed beyond one bucket: the caching allocator's rounding (512 B a block) and whatever
# the collective allocates for itself, far below a whole dense part.
SYNC_SLACK_BYTES = 64 * 1024
BUCKETS_AT_LEAST = 4  # the cap is set so the dense part spans this many buckets


def judge_sync_peak(peak: int, cap: int, dense_bytes: int, buckets: int) -> str:
    """Pass when the sync's peak above what was allocated before it stays within one bucket
    (``cap``) and the case could tell one bucket from a flat buffer of every gradient."""
    detail = (f"{buckets} buckets of at most {cap:,} B over {dense_bytes:,} B of dense gradients: peak "
              f"{peak:,} B above the gradients (limit {cap:,} + {SYNC_SLACK_BYTES:,} B)")
    if buckets < 2 or dense_bytes <= cap + SYNC_SLACK_BYTES:
        raise Failed("the case cannot tell one bucket from a flat buffer: " + detail)
    if peak > cap + SYNC_SLACK_BYTES:
        raise Failed(detail)
    return detail


def _sync_probe(ctx: Context, step: int = 1) -> Any:
    """A callback that, before step ``step``'s optimizer step, runs the backend's dense sync
    again with a bucket a quarter of the dense part and measures it (on one rank the sum
    leaves every gradient as it was)."""
    import lightning as L

    from ..model_contract import moe_layers

    class SyncProbe(L.Callback):
        result: dict | None = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step != step:
                return
            backend = trainer.strategy.backend
            experts = {id(p) for _, layer in moe_layers(pl_module) for p in layer.experts.parameters()}
            dense = [p for p in pl_module.parameters() if id(p) not in experts and p.grad is not None]
            dense_bytes = sum(p.grad.numel() * p.grad.element_size() for p in dense)
            before = [p.grad.clone() for p in dense]
            saved, backend.bucket_bytes = backend.bucket_bytes, max(dense_bytes // BUCKETS_AT_LEAST, 1)
            peak = None
            try:
                if ctx.cuda:
                    gc.collect()
                    torch.cuda.synchronize(ctx.device)
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                    start = torch.cuda.memory_allocated(ctx.device)
                backend.sync_dense(pl_module)
                if ctx.cuda:
                    torch.cuda.synchronize(ctx.device)
                    peak = torch.cuda.max_memory_allocated(ctx.device) - start
                cap = backend.bucket_bytes
            finally:
                backend.bucket_bytes = saved
            changed = sum(not torch.equal(b, p.grad) for b, p in zip(before, dense))
            self.result = dict(peak=peak, cap=cap, dense_bytes=dense_bytes, buckets=backend.last_buckets,
                               changed=changed, params=len(dense))

    return SyncProbe()


def check_grad_sync(ctx: Context) -> str:
    probe = _sync_probe(ctx)
    # on CUDA a dense part of a few MB, so that one bucket and a flat buffer differ clearly
    model = tiny_model(d_model=256 if ctx.cuda else 16)
    with one_run(ctx, "grad-sync", "zebra", loopback_plan(ctx), max_steps=2, callbacks=[probe]) as (_, trainer):
        trainer.fit(model, datamodule=data())
    r = probe.result
    if r is None:
        raise Failed("the probed step never reached its optimizer step")
    if r["changed"]:
        raise Failed(f"a one-rank sum changed {r['changed']} of {r['params']} dense gradients "
                     f"({r['buckets']} buckets): the buckets' sums went back to the wrong places")
    if r["peak"] is None:
        raise Skip(f"no CUDA allocator to measure the peak; the sync ran in {r['buckets']} buckets of at most "
                   f"{r['cap']:,} B over {r['dense_bytes']:,} B, every gradient intact")
    return judge_sync_peak(r["peak"], r["cap"], r["dense_bytes"], r["buckets"])
