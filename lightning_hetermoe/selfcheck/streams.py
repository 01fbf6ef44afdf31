"""The zebra exchange's NCCL all-to-all kernels ran off the compute stream (CUDA)."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Sequence

import torch

from .report import Context, Failed
from .runs import data, loopback_plan, one_run, tiny_model

_ALL_TO_ALL_KERNELS = ("sendrecv", "alltoall", "all_to_all")


def _kernels_by_stream(prof: Any, path: str) -> list[tuple[str, int]]:
    """``(kernel name, stream)`` of every device kernel in the profile (Kineto's trace format)."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    return [(e.get("name", ""), int(e.get("args", {}).get("stream", e.get("tid", -1))))
            for e in events if str(e.get("cat", "")).lower() == "kernel"]


def check_streams(ctx: Context) -> str:
    import lightning as L
    from torch.profiler import ProfilerActivity, profile

    class StepProfile(L.Callback):
        """The last training step alone (set-up broadcasts and autotuning left out)."""

        def __init__(self) -> None:
            self.prof: Any = None
            self.running = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                torch.cuda.synchronize(ctx.device)
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.start()
                self.running = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.running:
                torch.cuda.synchronize(ctx.device)
                self.stop()

        def on_exception(self, trainer, pl_module, exception):
            self.stop()  # a profiler left running would record the checks after this one

        def stop(self) -> None:
            if self.running:
                self.running = False
                self.prof.stop()

    probe = StepProfile()
    # step 0 warms up (communicators, kernels); step 1 is the one profiled
    with one_run(ctx, "streams", "zebra", loopback_plan(ctx), max_steps=2, callbacks=[probe]) as (_, trainer):
        trainer.fit(tiny_model(), datamodule=data())
    if probe.prof is None:
        raise Failed("the profiled step never ran")
    return judge_streams(_kernels_by_stream(probe.prof, os.path.join(ctx.workdir, "streams-trace.json")))


def judge_streams(kernels: Sequence[tuple[str, int]]) -> str:
    """Pass when every NCCL all-to-all kernel ran off the compute stream (the stream most
    non-NCCL kernels ran on); ``kernels`` are ``(name, stream)`` of one profiled step."""
    nccl = [(n, s) for n, s in kernels if "nccl" in n.lower()]
    a2a = [(n, s) for n, s in nccl if any(k in n.lower() for k in _ALL_TO_ALL_KERNELS)]
    compute = Counter(s for n, s in kernels if "nccl" not in n.lower())
    if not compute:
        raise Failed(f"no compute kernel in the profiled step ({len(kernels)} kernels)")
    compute_stream = compute.most_common(1)[0][0]
    a2a_streams = Counter(s for _, s in a2a)
    detail = (f"compute stream {compute_stream} ({compute[compute_stream]} kernels); NCCL all-to-all on streams "
              f"{dict(a2a_streams)}; every NCCL kernel: {dict(Counter(n for n, _ in nccl))}")
    if not a2a:
        raise Failed("no NCCL all-to-all kernel in the profiled step; " + detail)
    if compute_stream in a2a_streams:
        raise Failed(f"{a2a_streams[compute_stream]} NCCL all-to-all kernels ran on the compute stream; " + detail)
    return detail
