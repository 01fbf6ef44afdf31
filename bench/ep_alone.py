"""EP groups of one (``strategy.expert_parallel_size=1``: every rank holds every expert)
dispatching as a single device, against the same run sending its rows through the
all-to-all with itself (what every group of one did before; the GPU self-check's
``through_the_exchange`` forces it), side by side.

    python bench/ep_alone.py                  # 2 CPU processes (cluster=cpu2), about 2 minutes
    python bench/ep_alone.py --rounds 3 --steps 80

Each round runs both, in turn, on the main job's tiny model with no emulation, so the
steps are the host's own time: the median step of each, their ratio, and whether the two
trained alike (final loss). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

from runs import run_job

RUN = ["strategy.mode=ep", "strategy.expert_parallel_size=1", "cluster=cpu2", "logger=none"]
EXCHANGE = ["+callbacks.exchange._target_=lightning_hetermoe.selfcheck.runs.through_the_exchange"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each, alternated (default 2)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 3:
        ap.error(f"--rounds={args.rounds} --steps={args.steps}: at least 1 round and 3 steps")
    runs: dict[str, list[dict]] = {"alone": [], "exchange": []}
    for r in range(args.rounds):
        for name, extra in (("alone", []), ("exchange", EXCHANGE)):
            s = run_job([*RUN, f"trainer.max_steps={args.steps}", *extra])
            runs[name].append(s)
            print(f"round {r + 1} {name:8}: {s['step_time_median_s'] * 1e3:7.2f} ms/step median, "
                  f"final loss {s['final_loss']:.6f}", flush=True)
    median = {n: statistics.median(s["step_time_median_s"] for s in v) for n, v in runs.items()}
    same = {s["final_loss"] for v in runs.values() for s in v}
    out = {"alone_ms": median["alone"] * 1e3, "exchange_ms": median["exchange"] * 1e3,
           "exchange_over_alone": median["exchange"] / median["alone"], "same_final_loss": len(same) == 1,
           "rounds": args.rounds, "steps": args.steps}
    print(f"groups of one as one device: {out['alone_ms']:.2f} ms/step, through the exchange "
          f"{out['exchange_ms']:.2f}: {out['exchange_over_alone']:.3f}x; the same final loss: {out['same_final_loss']}")
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
