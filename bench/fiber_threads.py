"""Zebra's micro-batch threads on a CPU: each at one intra-op thread (the default) beside
each at the rank's own count, on one rank whose exchange talks to itself.

    python bench/fiber_threads.py                       # R = 1 and 2, this machine's cores, 40 s on 2 cores
    python bench/fiber_threads.py --d-model 512 --seq 256 --steps 14 --rounds 1    # larger work per op

Under OpenMP every thread that enters a parallel region leads a team of its own: a zebra
rank with n intra-op threads and R micro-batches in flight keeps R + 1 teams, and only the
baton's holder works while the others' members sleep and wake. The contenders run in turn
in this one process (``bench/gpu_train.py``'s loopback plan and model, ``--threads``
intra-op threads for the rank, the workers started again for each), ``--rounds`` times
each; per R it prints the median seconds a step and the ratio rank's count / one (> 1: one
thread is faster). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

CONTENDERS = {"one thread": 1, "rank's count": None}  # fibers.INTRAOP_THREADS


def measure(shape: dict[str, int], microbatches: int, threads: int, rounds: int) -> dict[str, Any]:
    import torch

    import gpu_train
    from lightning_hetermoe.strategy.backends.zebra import fibers

    setting_before = fibers.INTRAOP_THREADS
    steps: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    try:
        for _ in range(rounds):
            for name, setting in CONTENDERS.items():
                fibers.stop_workers()
                fibers.INTRAOP_THREADS = setting
                torch.set_num_threads(threads)
                steps[name].append(gpu_train.run("zebra", quick=True, shape=shape, microbatches=microbatches)["step_s"])
    finally:
        fibers.INTRAOP_THREADS = setting_before
    median = {name: statistics.median(s) for name, s in steps.items()}
    return {"microbatches": microbatches, "step_s": median, "runs": steps,
            "rank_count_over_one": median["rank's count"] / median["one thread"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the rank's intra-op threads")
    p.add_argument("--microbatches", default="1,2", help="R values, comma-separated")
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--seq", type=int, default=16, help="tokens a sequence (8 sequences a step)")
    p.add_argument("--steps", type=int, default=40, help="steps a run; the first 10 are warm-up")
    p.add_argument("--rounds", type=int, default=2, help="runs of each contender, in turn")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    for name in ("threads", "d_model", "seq", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if args.steps <= 10:
        p.error(f"--steps={args.steps} is invalid: must be > 10 (the first 10 are warm-up)")
    try:
        rs = [int(r) for r in args.microbatches.split(",")]
    except ValueError:
        p.error(f"--microbatches={args.microbatches!r} is invalid: give integers >= 1, e.g. 1,2")
    if any(r < 1 for r in rs):
        p.error(f"--microbatches={args.microbatches!r} is invalid: every R must be >= 1")
    # before torch starts OpenMP, and so that Lightning leaves the count as set here
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    shape = dict(d_model=args.d_model, n_layers=8, n_heads=2, experts=4, top_k=2, d_ff=2 * args.d_model,
                 seq=args.seq, batch=8, steps=args.steps, warm=10)
    rows = []
    for r in rs:
        row = measure(shape, r, args.threads, args.rounds)
        rows.append(row)
        ms = {k: round(v * 1e3, 1) for k, v in row["step_s"].items()}
        one, own = ms["one thread"], ms["rank's count"]
        print(f"R={r} at {args.threads} threads: one thread {one} ms/step, the rank's count {own} ms/step, "
              f"ratio {row['rank_count_over_one']:.2f}x", flush=True)
    result = {"threads": args.threads, "shape": shape, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
