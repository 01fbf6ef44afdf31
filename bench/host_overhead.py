"""Zebra's host overhead on one rank: what the schedule costs over Lightning's own training
of the same model in the same micro-batches, when the work per op is too small to hide it.

    python bench/host_overhead.py                          # R = 1 and 2, 3 rounds, about 2 minutes
    python bench/host_overhead.py --microbatches 2 --rounds 5
    python bench/host_overhead.py --ops                    # and each one's aten calls a step, about 3 minutes

On a GPU a small model's step is host-bound: on one H200 (2026-12-04) issue #38's model
stepped in 82 ms under Lightning's default strategy and 211 ms under a zebra loopback plan
at R = 2, with 67 ms of device work. That host time is Python and op dispatch, which this
CPU has too: with widths so small that the arithmetic is a small part of a step
(``bench/gpu_train.py``'s model at 8 layers, 4 experts top-2, d_model 32, 128 tokens a
step, one intra-op thread) the seconds a step are mostly what each strategy does around
its ops.

Contenders, in turn in this one process (``--rounds`` times each, the median reported):

- ``lightning``: Lightning's default strategy, the whole batch in one forward and backward;
- ``lightning xR``: the same, the batch cut into R micro-batches by Lightning's
  ``accumulate_grad_batches=R``: the ops R micro-batches launch, with Lightning's overhead
  and none of the schedule's (the floor for zebra at R);
- ``hetermoe``: ``strategy="hetermoe"`` on one device (the single-device schedule);
- ``zebra R``: a zebra loopback plan (one rank attends and holds every expert; its
  exchange talks to itself) at R micro-batches.

It prints milliseconds a step and the ratios ``zebra R / lightning xR`` (the schedule's own
overhead) and ``hetermoe / lightning``; the last line is JSON. ``--ops`` also counts, once
per contender, the aten calls a step makes in every thread (zebra's fibers included; torch's
profiler over ``--op-steps`` steps after ``OP_WARM``): each call is a trip through torch's
dispatcher from Python or autograd (an op called by another op not counted), the host work
a GPU step pays whatever its widths, and a count that does not drift with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

SHAPE = dict(d_model=32, n_layers=8, n_heads=2, experts=4, top_k=2, d_ff=32, seq=32, batch=4, steps=40, warm=10)


def contenders(rs: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"lightning": dict(strategy="default"), "hetermoe": dict(strategy="hetermoe")}
    for r in rs:
        if r > 1:
            out[f"lightning x{r}"] = dict(strategy="default", accumulate=r)
        out[f"zebra {r}"] = dict(strategy="zebra", microbatches=r)
    return out


def measure(rs: list[int], rounds: int, fit_steps: int) -> dict[str, list[float]]:
    import gpu_train

    runs = contenders(rs)
    steps: dict[str, list[float]] = {name: [] for name in runs}
    # the process's first fit pays imports and first-call set-up: not a contender's
    gpu_train.run("default", quick=True, shape=dict(SHAPE, steps=SHAPE["warm"] + 1))
    for i in range(rounds):
        for name, how in runs.items():
            shape = dict(SHAPE, steps=fit_steps)
            accumulate = how.get("accumulate", 1)
            shape["batch"] //= accumulate
            step_s = gpu_train.run(how["strategy"], quick=True, shape=shape, accumulate=accumulate,
                                   microbatches=how.get("microbatches", 2))["step_s"]
            steps[name].append(step_s)
            print(f"round {i + 1}/{rounds}: {name} {step_s * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    return steps


OP_WARM = 3  # steps before --ops profiles: the first two make the optimizer's state and the strategy's
# caches; from the third a step's count moves by under 1% (a mean of --op-steps steps, 3 by default)


def aten_calls(events: Any) -> int:
    """The profiled aten ops no other aten op called (events with a parent chain)."""
    def called_by_aten(e: Any) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return True
            p = p.cpu_parent
        return False

    return sum(1 for e in events if e.name.startswith("aten::") and not called_by_aten(e))


def count_ops(rs: list[int], steps: int = 3) -> dict[str, float]:
    """Each contender's aten calls a step (:func:`aten_calls`) over ``steps`` steps, every
    thread, one fit each."""
    import gpu_train
    import lightning as L
    import torch

    class Profiled(L.Callback):
        def __init__(self) -> None:
            self.prof: Any = None
            self.steps = 0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == OP_WARM and self.prof is None:
                config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   experimental_config=config)
                self.prof.__enter__()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self.prof is not None and not self.steps and trainer.global_step == OP_WARM + steps:
                self.prof.__exit__(None, None, None)
                self.steps = steps

    out: dict[str, float] = {}
    for name, how in contenders(rs).items():
        accumulate = how.get("accumulate", 1)
        shape = dict(SHAPE, steps=OP_WARM + steps + 1, warm=OP_WARM, batch=SHAPE["batch"] // accumulate)
        profiled = Profiled()
        gpu_train.run(how["strategy"], quick=True, shape=shape, accumulate=accumulate,
                      microbatches=how.get("microbatches", 2), callbacks=[profiled])
        out[name] = aten_calls(profiled.prof.events()) / profiled.steps
        print(f"{name}: {out[name]:,.0f} aten calls a step", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--microbatches", default="1,2", help="zebra's R values, comma-separated (each divides 4)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each contender, in turn")
    p.add_argument("--steps", type=int, default=SHAPE["steps"], help=f"steps a fit; the first {SHAPE['warm']} are warm-up")
    p.add_argument("--core", type=int, default=0, help="the one CPU core every thread runs on (-1: any)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--ops", action="store_true", help="also count each contender's aten calls a step")
    p.add_argument("--op-steps", type=int, default=3, help="--ops: steps profiled in each contender's fit")
    args = p.parse_args(argv)
    if args.core == -1:
        args.core = None
    elif args.core < 0 or (hasattr(os, "sched_getaffinity") and args.core not in os.sched_getaffinity(0)):
        p.error(f"--core={args.core} is invalid: give a core this process may run on, or -1 for any")
    if args.steps <= SHAPE["warm"]:
        p.error(f"--steps={args.steps} is invalid: must be > {SHAPE['warm']} (the warm-up steps)")
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} is invalid: must be >= 1")
    if args.op_steps < 1:
        p.error(f"--op-steps={args.op_steps} is invalid: must be >= 1")
    try:
        rs = [int(r) for r in args.microbatches.split(",")]
    except ValueError:
        p.error(f"--microbatches={args.microbatches!r} is invalid: give integers, e.g. 1,2")
    if any(r < 1 or SHAPE["batch"] % r for r in rs):
        p.error(f"--microbatches={args.microbatches!r} is invalid: every R must divide the batch of {SHAPE['batch']}")
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts OpenMP: the arithmetic stays small and serial
    if args.core is not None and hasattr(os, "sched_setaffinity"):
        # every thread made from here on (zebra's fibers, gloo's) inherits it: hand-offs
        # between threads on two cores of a busy 2-core machine varied zebra's step by 25%
        os.sched_setaffinity(0, {args.core})
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    torch.set_num_threads(1)
    steps = measure(rs, args.rounds, args.steps)
    ms = {name: statistics.median(s) * 1e3 for name, s in steps.items()}
    ratios = {"hetermoe / lightning": ms["hetermoe"] / ms["lightning"]}
    for r in rs:
        floor = "lightning" if r == 1 else f"lightning x{r}"
        ratios[f"zebra {r} / {floor}"] = ms[f"zebra {r}"] / ms[floor]
    for name, v in ms.items():
        print(f"{name:>14}: {v:6.1f} ms/step")
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}x")
    result = {"shape": dict(SHAPE, steps=args.steps), "core": args.core, "ms_per_step": ms, "ratios": ratios, "runs_s": steps}
    if args.ops:
        calls = count_ops(rs, args.op_steps)
        result["aten_calls_per_step"], result["op_steps"] = calls, args.op_steps
        for name, v in calls.items():
            print(f"{name:>14}: {v:8,.0f} aten calls/step")
        for r in rs:
            floor = "lightning" if r == 1 else f"lightning x{r}"
            result["ratios"][f"zebra {r} / {floor} aten calls"] = calls[f"zebra {r}"] / calls[floor]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
