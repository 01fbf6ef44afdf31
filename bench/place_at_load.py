"""Experts placed at a lasting routing at set-up, measured beside id order.

    python bench/place_at_load.py           # about 25 minutes on 2 cores
    python bench/place_at_load.py --quick   # A40+V100 1+1 only, about 5 minutes

The routing lasts here: every router gets a fixed logit offset on two experts
(``bench/skew.py``), so those two take about half of every layer's tokens for the whole
run, as a trained model's hot experts do. The run plans at its warm-up routing either way
(the counts per member are Asym-EA's); ``strategy.place_at_load=true`` also chooses which
expert goes where at it (``lightning_hetermoe/plan/load_placement.py``), ``false`` keeps
id order. Two hot pairs: experts 0 and 1 (id order gives both to the same member, an
expert rank where there is one) and 22 and 23 (id order gives both to the attention ranks,
where Asym-EA moves the highest ids). Cells as ``bench/schedules.py``'s (its clock, model,
batch and checkpointed blocks; twice its time scale, seconds divided back), zebra and
DistEP, side by side in one run.

Per row: the measured s/step in id order and placed, their ratio, the simulator's ratio
for the same two plans, and each run's error from its prediction (``x4``: a run held
faithful only at four times the grid's time scale). The last line is JSON with every row and
``placed_over_id_worst`` (the largest measured ratio: placing must not cost) and
``placed_over_id_best``.
"""

from __future__ import annotations

import argparse
import json
import time

import skew
from runs import TEARDOWN_ABORTS, run_job
from schedules import cell_overrides

HOT = {"0,1": [0, 1], "22,23": [22, 23]}
MIXES = ("a40+v100 1+1", "a40+v100 2+2", "l40s+t4 1+3")
STEPS = ["trainer.max_steps=4"]
# Two experts with half the tokens: their CPU work runs longer than the grid's clock covers
# (bench/schedules.py's time scale left 2+2 unfaithful): a run starts at twice its scale and
# runs again at twice that until its emulation is faithful
SLOWDOWNS = (2.0, 4.0, 8.0)


def measure(mix: str, schedule: str, hot: list[int], placed: bool) -> dict:
    for slowdown in SLOWDOWNS:
        s = run_job([*cell_overrides(mix, "4K", schedule, slowdown=slowdown), *STEPS, *skew.overrides(hot),
                     f"strategy.place_at_load={'true' if placed else 'false'}"])
        if s["emulation"]["faithful"]:
            break
    return {"s": s["step_time_s"] / slowdown, "predicted_s": s["predicted_step_time_s"] / slowdown,
            "rel_error": s["step_time_rel_error"], "x": slowdown,
            "faithful": s["emulation"]["faithful"], "hot_share": s.get("expert_token_share_top2_min")}


def main(argv: list[str] | None = None) -> dict:
    quick = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick.add_argument("--quick", action="store_true", help="A40+V100 1+1 only")
    mixes = MIXES[:1] if quick.parse_args(argv).quick else MIXES
    started, rows = time.perf_counter(), []
    print(f"{'mix':13} {'schedule':8} {'hot':>5} {'id s':>7} {'placed s':>8} {'measured':>8} {'predicted':>9} "
          f"{'hot share':>9}  {'errors (id, placed)':>19}", flush=True)
    for mix in mixes:
        for schedule in ("zebra", "distep"):
            for name, hot in HOT.items():
                by_id, placed = (measure(mix, schedule, hot, p) for p in (False, True))
                row = {"mix": mix, "schedule": schedule, "hot": hot, "id_s": by_id["s"], "placed_s": placed["s"],
                       "placed_over_id": placed["s"] / by_id["s"],
                       "predicted_placed_over_id": placed["predicted_s"] / by_id["predicted_s"],
                       "faithful": by_id["faithful"] and placed["faithful"], "hot_share": by_id["hot_share"],
                       "rel_error_id": by_id["rel_error"], "rel_error_placed": placed["rel_error"],
                       "time_scale_x": [by_id["x"], placed["x"]]}
                rows.append(row)
                share = f"{row['hot_share']:.0%}" if row["hot_share"] is not None else "-"
                print(f"{mix:13} {schedule:8} {name:>5} {row['id_s']:7.3f} {row['placed_s']:8.3f} "
                      f"{row['placed_over_id']:7.2f}x {row['predicted_placed_over_id']:8.2f}x {share:>9}  "
                      f"{row['rel_error_id']:+8.1%} {row['rel_error_placed']:+8.1%}"
                      + "".join(f"  x{x:g}" for x in sorted(set(row["time_scale_x"])) if x != SLOWDOWNS[0])
                      + ("" if row["faithful"] else "  UNFAITHFUL"), flush=True)
    ratios = [r["placed_over_id"] for r in rows if r["faithful"]]
    result = {"placed_over_id_worst": max(ratios, default=None), "placed_over_id_best": min(ratios, default=None),
              "teardown_aborts": len(TEARDOWN_ABORTS), "rows": rows, "wall_s": time.perf_counter() - started}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
