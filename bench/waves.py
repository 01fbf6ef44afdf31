"""A step in waves (gradient accumulation) against the same batch in one wave, measured in
real processes beside the simulator.

    python bench/waves.py                      # A40+V100 1+1, D1 at 16K, memory x0.4: ~3 minutes
    python bench/waves.py --memory-scale 1.0   # room to spare: one wave should win
    python bench/waves.py --extra strategy.require_expert_ranks=false   # any overrides, to every run

Zebra keeps every micro-batch's activations until its backward. Where they crowd the
experts off the ranks, the planner plans the step as waves (``Plan.waves``, run under
``trainer.accumulate_grad_batches``). This bench runs the main job (``recipes/train.py``:
real processes, gloo, the strategy and executor, the emulated clock of D1 on 4 layers at
16K tokens per sequence) on an A40 and a V100 whose memory is scaled down so that 12
sequences crowd them, three times:

1. one wave: 12 sequences per step, the strategy's own plan;
2. the strategy's plan for 6 sequences (what one wave of two holds), read from its
   ``plan.json``;
3. two waves: that plan with ``waves: 2``, given as ``strategy.plan``, 6 sequences per
   loader batch and ``trainer.accumulate_grad_batches=2``: 12 sequences per optimizer step.

It prints each run's measured and predicted seconds per optimizer step (both on the
emulated clock), their relative error and the share of emulated tasks that overran, and
the two-wave / one-wave speed-up measured beside predicted. The last line is one JSON
object with those figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from runs import cluster_overrides, run_job

DEVICES = ["a40", "v100"]
MODEL = ["model.n_layers=4", "model.moe.num_experts=24", "model.moe.top_k=2", "trainer.max_steps=3",
         "strategy.mode=zebra"]
GLOBAL_BATCH = 12  # sequences per optimizer step


def overrides(args: argparse.Namespace, per_rank: int, extra: list[str] = ()) -> list[str]:
    return [*cluster_overrides("a40_v100_waves", DEVICES, "d1", 16384, args.time_scale),
            f"cluster.memory_scale={args.memory_scale}", *MODEL, f"data.batch_size={per_rank}", *args.extra, *extra]


def row(name: str, s: dict) -> dict:
    plan = s.get("plan_json") or {}
    out = {"run": name, "measured_s": s["step_time_s"], "predicted_s": s["predicted_step_time_s"],
           "rel_error": s["step_time_rel_error"], "overrun_fraction": s["emulation"]["overrun_fraction"],
           "waves": plan.get("waves", 1), "R": plan.get("num_microbatches"),
           "roles": "".join(r[0] for r in plan.get("roles", [])), "seqs_per_rank": plan.get("seqs_per_rank")}
    print(f"{name:<28} {out['measured_s']:>8.3f} {out['predicted_s']:>9.3f} {out['rel_error']:>+7.1%} "
          f"{out['overrun_fraction']:>8.1%}  waves {out['waves']}, R={out['R']}, roles {out['roles']}, "
          f"sequences per rank {out['seqs_per_rank']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-scale", type=float, default=0.4, help="each device's memory times this")
    ap.add_argument("--time-scale", type=float, default=1.5, help="the emulated clock's slowdown")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides of recipes/train.py, to every run")
    args = ap.parse_args(argv)
    W = len(DEVICES)
    print(f"{'run':<28} {'s/step':>8} {'predicted':>9} {'error':>7} {'overran':>8}  plan")
    one = row("one wave of 12", run_job(overrides(args, GLOBAL_BATCH // W)))
    half = run_job(overrides(args, GLOBAL_BATCH // (2 * W)))
    row("(one wave of 6)", half)
    with tempfile.TemporaryDirectory(prefix="bench_waves_") as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(json.dumps({**half["plan_json"], "waves": 2}))
        two = row("two waves of 6", run_job(overrides(args, GLOBAL_BATCH // (2 * W), [
            f"strategy.plan={path}", "trainer.accumulate_grad_batches=2"])))
    result = {"memory_scale": args.memory_scale, "extra": args.extra, "one_wave": one, "two_waves": two,
              "two_over_one_measured": one["measured_s"] / two["measured_s"],
              "two_over_one_predicted": one["predicted_s"] / two["predicted_s"]}
    print(f"two waves / one wave, throughput: {result['two_over_one_measured']:.3f}x measured, "
          f"{result['two_over_one_predicted']:.3f}x predicted")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
