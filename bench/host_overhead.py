"""Zebra's host overhead on one rank: what the schedule costs over Lightning's own training
of the same model in the same micro-batches, when the work per op is too small to hide it.

    python bench/host_overhead.py                          # R = 1 and 2, 3 rounds, about 2 minutes
    python bench/host_overhead.py --microbatches 2 --rounds 5
    python bench/host_overhead.py --ops                    # and each one's aten calls a step

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
overhead) and ``hetermoe / lightning``; the last line is JSON. ``--ops`` also counts each
contender's aten calls a step in every thread (zebra's fibers included; torch's profiler over
``--op-steps`` of the first round's warm-up steps, from ``OP_WARM``, so the timed steps are
untouched and no fit is added): each call is a trip through torch's
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
OP_WARM = 3  # the warm-up step --ops starts at: the first two make the optimizer's state and the
# strategy's caches; from the third a step's count moves by under 1% (a mean of --op-steps steps)


def floor_of(r: int) -> str:
    """The contender zebra at R is set against: Lightning in as many micro-batches."""
    return "lightning" if r == 1 else f"lightning x{r}"


def contenders(rs: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"lightning": dict(strategy="default"), "hetermoe": dict(strategy="hetermoe")}
    for r in rs:
        if r > 1:
            out[floor_of(r)] = dict(strategy="default", accumulate=r)
        out[f"zebra {r}"] = dict(strategy="zebra", microbatches=r)
    return out


def measure(rs: list[int], rounds: int, fit_steps: int, op_steps: int = 0
            ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each contender's seconds a step, ``rounds`` fits each in turn; with ``op_steps``, its
    aten calls a step too, profiled over that many of the first round's warm-up steps (from
    ``OP_WARM``: the timed window, after the warm-up, is not touched)."""
    import gpu_train

    runs = contenders(rs)
    steps: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, float] = {}
    # the process's first fit pays imports and first-call set-up: not a contender's
    gpu_train.run("default", quick=True, shape=dict(SHAPE, steps=SHAPE["warm"] + 1))
    for i in range(rounds):
        for name, how in runs.items():
            shape = dict(SHAPE, steps=fit_steps)
            accumulate = how.get("accumulate", 1)
            shape["batch"] //= accumulate
            profiled = [op_counter(op_steps)] if op_steps and i == 0 else []
            step_s = gpu_train.run(how["strategy"], quick=True, shape=shape, accumulate=accumulate,
                                   microbatches=how.get("microbatches", 2), callbacks=profiled)["step_s"]
            steps[name].append(step_s)
            if profiled:
                calls[name] = aten_calls(profiled[0].prof) / op_steps
                print(f"{name}: {calls[name]:,.0f} aten calls a step", file=sys.stderr, flush=True)
            print(f"round {i + 1}/{rounds}: {name} {step_s * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    return steps, calls


def aten_calls(prof: Any) -> int:
    """The aten ops of a finished ``torch.profiler.profile`` that no other aten op called,
    every thread: on each thread an op inside another's span was called by it. From the
    profiler's raw events (building torch's event tree for a step's tens of thousands took
    seconds)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for e in prof.profiler.kineto_results.events():
        if e.name().startswith("aten::"):
            spans.setdefault(e.start_thread_id(), []).append((e.start_ns(), -e.duration_ns()))
    calls = 0
    for thread in spans.values():
        thread.sort()  # by start, the longer (the caller) first where two start together
        end = None  # where the outermost op open on this thread ends
        for start, minus in thread:
            if end is None or start >= end:
                calls += 1
                end = start - minus
    return calls


def op_counter(steps: int) -> Any:
    """A Lightning callback that profiles ``steps`` steps from ``OP_WARM`` in every thread."""
    import lightning as L
    import torch

    class Profiled(L.Callback):
        def __init__(self) -> None:
            self.prof: Any = None
            self.done = False

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == OP_WARM and self.prof is None:
                config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   experimental_config=config)
                self.prof.__enter__()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            # under accumulate_grad_batches the step's count holds over its batches: once
            if self.prof is not None and not self.done and trainer.global_step == OP_WARM + steps:
                self.prof.__exit__(None, None, None)
                self.done = True

    return Profiled()


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
    if not 1 <= args.op_steps <= SHAPE["warm"] - OP_WARM:
        p.error(f"--op-steps={args.op_steps} is invalid: must be 1 to {SHAPE['warm'] - OP_WARM} "
                f"(warm-up steps after the first {OP_WARM})")
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
    steps, calls = measure(rs, args.rounds, args.steps, args.op_steps if args.ops else 0)
    ms = {name: statistics.median(s) * 1e3 for name, s in steps.items()}
    ratios = {"hetermoe / lightning": ms["hetermoe"] / ms["lightning"]}
    for r in rs:
        ratios[f"zebra {r} / {floor_of(r)}"] = ms[f"zebra {r}"] / ms[floor_of(r)]
    for name, v in ms.items():
        print(f"{name:>14}: {v:6.1f} ms/step")
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}x")
    result = {"shape": dict(SHAPE, steps=args.steps), "core": args.core, "ms_per_step": ms, "ratios": ratios, "runs_s": steps}
    if args.ops:
        result["aten_calls_per_step"], result["op_steps"] = calls, args.op_steps
        for name, v in calls.items():
            print(f"{name:>14}: {v:8,.0f} aten calls/step")
        for r in rs:
            result["ratios"][f"zebra {r} / {floor_of(r)} aten calls"] = calls[f"zebra {r}"] / calls[floor_of(r)]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from lightning_hetermoe.process_exit import run_and_exit

    run_and_exit(main)  # no finalization: its collections walk every object torch and Lightning made
