"""Where a step's time goes on one GPU: ``bench/gpu_train.py``'s model and strategies, with
the host's Python profile, torch's profiler (host ops and device kernels) and CUDA's sync
debug mode over steady steps, each strategy in a process of its own.

    python bench/gpu_profile.py --strategy zebra --out-dir /tmp/prof [--microbatches 1] [--quick]

Writes ``<strategy>[-r<R>].txt`` (the tables) and ``.json`` (step seconds, host syncs by
site, device busy seconds over wall seconds). Steps: ``warm`` to settle, 6 plain, then 4
under a Python profiler, 2 under torch's profiler, 1 under the sync debug mode; each window
is timed on its own, so the profilers' overhead does not hide in the plain step time.

The Python profiler is yappi where it is installed (every thread, each on its own clock:
the zebra fibers run the model in threads of their own), else cProfile (Python >= 3.12
sees every thread but charges them to one clock). Device busy time is the union of the
kernels' and copies' spans on the timeline (annotations such as the optimizer's step range
left out).
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import os
import pstats
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch



def _load_gpu_train() -> Any:
    """``bench/gpu_train.py`` (the bench's model, data and loopback plan), loaded by its path:
    ``bench/`` stays off ``sys.path`` (no bench script may shadow an installed package:
    ``tests/test_bench_names.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hetermoe_bench_gpu_train", Path(__file__).with_name("gpu_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_train = _load_gpu_train()

PLAIN, PY, TORCH, SYNC = 6, 4, 2, 1


class Windows:
    """A Lightning callback that opens one profiler per window of steps."""

    def __init__(self, warm: int, cuda: bool) -> None:
        import lightning as L

        self.cuda, self.warm = cuda, warm
        self.bounds = {"plain": warm, "python": warm + PLAIN, "torch": warm + PLAIN + PY,
                       "sync": warm + PLAIN + PY + TORCH, "end": warm + PLAIN + PY + TORCH + SYNC}
        self.started: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.py = PythonProfile()
        self.prof: Any = None
        self.syncs: list[Any] = []
        self._catch: Any = None
        outer = self

        class _CB(L.Callback):
            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                outer.at(trainer.global_step)

        self.callback = _CB()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _close(self, name: str) -> None:
        self._sync()
        self.seconds[name] = time.perf_counter() - self.started[name]

    def at(self, step: int) -> None:
        b = self.bounds
        if step == b["plain"]:
            self._sync()
            self.started["plain"] = time.perf_counter()
        elif step == b["python"]:
            self._close("plain")
            self.started["python"] = time.perf_counter()
            self.py.enable()
        elif step == b["torch"]:
            self.py.disable()
            self._close("python")
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.started["torch"] = time.perf_counter()
            self.prof.__enter__()
        elif step == b["sync"]:
            self._close("torch")
            self.prof.__exit__(None, None, None)
            self._catch = warnings.catch_warnings(record=True)
            self.syncs = self._catch.__enter__()
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            self.started["sync"] = time.perf_counter()
        elif step == b["end"]:
            if self.cuda:
                torch.cuda.set_sync_debug_mode("default")
            self._close("sync")
            self._catch.__exit__(None, None, None)


class PythonProfile:
    """yappi over every thread where it is installed, else cProfile."""

    def __init__(self) -> None:
        try:
            import yappi
        except ImportError:
            yappi = None
        self.yappi = yappi
        self.cprofile = cProfile.Profile() if yappi is None else None

    def enable(self) -> None:
        if self.yappi is not None:
            self.yappi.set_clock_type("wall")
            self.yappi.start(builtins=True)
        else:
            self.cprofile.enable()

    def disable(self) -> None:
        if self.yappi is not None:
            self.yappi.stop()
        else:
            self.cprofile.disable()

    def write(self, text: io.StringIO) -> None:
        if self.yappi is None:
            text.write("\n# cProfile, by own time\n")
            stats = pstats.Stats(self.cprofile, stream=text)
            stats.sort_stats("tottime").print_stats(35)
            text.write("\n# cProfile, by cumulative time\n")
            stats.sort_stats("cumulative").print_stats(45)
            return
        for thread in self.yappi.get_thread_stats():
            stats = self.yappi.get_func_stats(filter={"ctx_id": thread.id})
            for key, rows in (("tsub", 40), ("ttot", 45)):
                text.write(f"\n# yappi (wall), thread {thread.name} {thread.id} ({thread.ttot:.3f} s), by {key}\n"
                           f"{'function':90s} {'calls':>8} {'own s':>9} {'total s':>9}\n")
                if not len(stats):
                    continue
                stats.sort(key)
                for i, row in enumerate(stats):
                    if i >= rows:
                        break
                    text.write(f"{row.full_name[-90:]:90s} {row.ncall:>8} {row.tsub:9.4f} {row.ttot:9.4f}\n")


def device_work(prof: Any) -> list[Any]:
    """The device's kernels and copies on the profile's timeline (not the user annotations
    that CUDA events also carry: the optimizer's step range spans a whole Lightning step)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and "#" not in e.name]


def device_busy_s(prof: Any) -> float:
    """Seconds the device ran kernels and copies: their union on the timeline, not their sum."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in device_work(prof))
    busy, end = 0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=gpu_train.STRATEGIES, required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--microbatches", type=int, default=2, help="zebra's R")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    import lightning as L

    from lightning_hetermoe import HeterMoEStrategy

    cuda = torch.cuda.is_available() and not args.quick
    shape = dict(gpu_train.QUICK if args.quick else gpu_train.FULL)
    windows = Windows(shape["warm"], cuda)
    shape["steps"] = windows.bounds["end"] + 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(gpu_train._free_port()))
    model, dm = gpu_train.model_and_data(shape)
    strategy: Any = {"default": "auto", "hetermoe": "hetermoe"}.get(args.strategy)
    if strategy is None:
        plan = gpu_train.loopback_plan(shape, "h100" if cuda else "cpu", args.microbatches)
        strategy = HeterMoEStrategy(mode="zebra", plan=plan)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=shape["steps"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[windows.callback])
    trainer.fit(model, datamodule=dm)
    name = args.strategy + (f"-r{args.microbatches}" if args.strategy == "zebra" else "")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_step = {"plain": windows.seconds["plain"] / PLAIN, "python": windows.seconds["python"] / PY,
                "torch": windows.seconds["torch"] / TORCH, "sync": windows.seconds["sync"] / SYNC}
    sites = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in windows.syncs
                                if "synchronizing CUDA operation" in str(w.message))
    busy = device_busy_s(windows.prof) if cuda else None
    report = {"strategy": name, "step_s": per_step, "host_syncs_per_step": sum(sites.values()),
              "sync_sites": dict(sites.most_common()), "device_busy_s_per_step": busy / TORCH if busy else None,
              "device_busy_fraction": busy / windows.seconds["torch"] if busy else None,
              # what the host launched: where it is the bound, its time goes with this count
              "device_ops_per_step": len(device_work(windows.prof)) / TORCH if cuda else None}
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = io.StringIO()
    text.write(json.dumps(report, indent=1) + "\n")
    windows.py.write(text)
    avg = windows.prof.key_averages()
    text.write("\n# torch profiler, by self CPU time\n" + avg.table(sort_by="self_cpu_time_total", row_limit=30))
    if cuda:
        text.write("\n# torch profiler, by self device time\n" + avg.table(sort_by="self_device_time_total",
                                                                            row_limit=30))
    (out / f"{name}.txt").write_text(text.getvalue())
    print(json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a profiler (CUPTI) or thread alive at exit can hang the interpreter's exit


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
