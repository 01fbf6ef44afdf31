"""Shared by the benchmarks: run the main job as a subprocess with overrides, read its summary.

Every run is a real multi-process job (``recipes/train.py``): real processes, real gloo
collectives, the real strategy and executor; emulated clusters only model the clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What every benchmark run leaves out: validation, and the sanity check before training.
QUIET = ["trainer.limit_val_batches=0", "+trainer.num_sanity_val_steps=0", "final_validation=false",
         "trainer.enable_progress_bar=false"]


def cluster_overrides(name: str, devices: list[str], workload: str, seq_len: int, time_scale: float) -> list[str]:
    """An emulated cluster of ``devices`` whose clock is ``workload`` at ``seq_len`` tokens."""
    return ["cluster=emu_a40_v100_d1", f"cluster.name={name}", f"cluster.devices=[{','.join(devices)}]",
            f"cluster.time_scale={time_scale}", f"cluster.emulate_workload.model={workload}",
            f"cluster.emulate_workload.seq_len={seq_len}"]


# A rank that aborts at exit after its run wrote the summary. Its cause (the heartbeat's
# daemon thread ended by interpreter finalization inside a store call, issue #38) is gone:
# the thread is joined before exit. The count stays, reported by every benchmark, so that a
# regression shows as a number instead of a failed benchmark or a silently kept figure.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_ABORTS: list[str] = []  # runs whose summary was written before a rank aborted at exit


def run_job(overrides: list[str], timeout: float = 300.0, workdir: Path | None = None) -> dict:
    """Run the main job with ``overrides``; its ``summary.json`` plus the process wall time."""
    with tempfile.TemporaryDirectory(prefix="bench_", dir=workdir) as tmp:
        cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), *QUIET, *overrides, f"hydra.run.dir={tmp}"]
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "bench"), env.get("PYTHONPATH")) if p)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        wall = time.perf_counter() - t0
        written = (Path(tmp) / "summary.json").exists()
        if proc.returncode != 0 and not (written and TEARDOWN_ABORT in proc.stdout + proc.stderr):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise RuntimeError(f"run failed (exit {proc.returncode}): {' '.join(overrides)}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        if "status" in summary:  # a fit that ended early (interrupted, failed): its figures are partial
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise RuntimeError(f"run {summary['status']}: {' '.join(overrides)}")
        if proc.returncode != 0:
            # the run trained and wrote its summary; a rank aborted while its process exited
            # (a C++ thread of gloo or the store torn down mid-flight): its figures stand, and
            # the abort is counted, not hidden
            TEARDOWN_ABORTS.append(" ".join(overrides))
            sys.stderr.write(f"[bench] a rank aborted at exit after the run wrote its summary: {' '.join(overrides)}\n")
        plan = Path(tmp) / "plan.json"
        if plan.exists():
            summary["plan_json"] = json.loads(plan.read_text())
        record = Path(tmp) / "expert_load.json"  # the routing its steps had (the load monitor's)
        if record.exists():
            summary["expert_load_record"] = json.loads(record.read_text())
    summary["process_wall_s"] = wall
    return summary
