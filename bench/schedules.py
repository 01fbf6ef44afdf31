"""Every schedule on emulated GPU mixes, measured in real processes beside the simulator.

    python bench/schedules.py            # the grid below, about 15 minutes on 2 cores
    python bench/schedules.py --quick    # one cell: A40+V100 1+1 at the D1 16K clock, ep and zebra
    python bench/schedules.py --mixes "a40+v100 1+1,a40x2" --clocks 16K   # a subset of the grid
    python bench/schedules.py --schedules datacentric                      # one schedule, every cell
    python bench/schedules.py --seed 7 --mixes "l40s+t4 1+3"               # another model init and data order
    python bench/schedules.py --mixes "l40s+t4 1+3" --clocks 16K --schedules zebra --steps 41  # routing drift

For each mix (A40+V100 as 1+1, 2+2, 1+2; L40S+T4 as 1+3; two A40s) and workload clock (D1
at 4K and 16K tokens per sequence) it runs ``ep``, ``ep`` with speed-proportional batches,
``distep``, ``zebra`` and ``datacentric`` (HEXA-MoE) through ``recipes/train.py``: real processes, real gloo collectives, the real
strategy and executor; only the clock is modelled (``lightning_hetermoe/emulate``). The
tiny model runs with D1's 24 experts, top-2, on 4 layers (the clock is D1's widths on that
depth), 12 sequences per step, 3 steps per run of which the first is warm-up. Every block
is checkpointed, as the paper trained (``--activations stored`` keeps every activation
instead): each recompute is real CPU work the clock pays as the device would, and the
simulator prices it (under ep with the recompute's two exchanges).

A cell is only kept when its emulation was faithful: if a rank's emulated tasks ran more
than 2% past their modelled time in all (``FAITHFUL_SLIP``: the CPU work did not fit under the
clock, so the run measured the machine, not the plan), the bench runs it again at twice the
``time_scale``, up to three times, and the table shows the scale that held (``x2`` beside the row); a cell that never
holds is named in the JSON (``unfaithful_cells``) and left out of ``max_rel_error``. (The
re-run's seconds are divided by its extra slowdown, so rows compare across the grid.) A
faithful cell more than 5% from its prediction is run once more at twice the scale: the
CPU's cost outside the padded tasks (Python between tasks, thread switches, gloo's own
latency, a fixed cost per round) halves there, a model error does not; the row keeps the
slower clock's figures, the JSON both errors (``rerun_cells``). A cell still more than 5%
off then runs once more with the weights all but frozen (``optim.lr=1e-12``: the same
steps, updates too small to move a router): what is left there is the simulator's error,
and what went away was the routing drifting as the model trained (the prediction is made
at set-up, from the freshly initialised model's routing); the JSON names each such cell's
error with frozen weights (``frozen_weights_rel_error``), each timed step's error at its own
routing (``at_load_by_step_rel_error``), and the remedy the job's last line names: the same
job once more, planned and predicted at the routing its trained steps had
(``strategy.expert_load=``, the load monitor's record), as a next run of it is: its error
from that prediction (``planned_at_record_rel_error``) and how much faster it stepped
(``planned_at_record_speedup``).

Per cell it prints the measured s/step, the simulator's s/step for the same plan (as
planned: the mean over held-out warm-up batches, each at its own routing) and its relative
error, the simulator's s/step at the routing the run's timed steps really had (the load
monitor's counts, step by step) and that error, the worst rank's slip (how far its
emulated tasks ran past their modelled time, a share of it) and the share of tasks that
overran at all, and zebra/ep measured beside zebra/ep predicted; then, per
mix and clock, the fastest schedule measured beside the one ``mode=auto`` would choose (the
fastest predicted).

A40+V100 1+1 at 16K also runs ep and zebra the other way (stored activations where the
grid checkpoints): each schedule's faster way gives the best-against-best speed-up, which
a user choosing per schedule gets (stored activations cost memory: zebra's plan then
spreads the experts over both ranks; checkpointed, they cost a forward more in each
backward, much more for ep, whose recompute runs the exchanges and the slow rank's
attention again).

A converted Hugging Face Mixtral of the same shape (``model.architecture=hf_mixtral``)
runs ep and zebra on A40+V100 1+1 at 16K beside the pack's model: its zebra/ep speed-up
should be within 5% of the pack model's (the clock is the workload's; what differs is
the model's code path: Hugging Face decoder layers, their losses beside the blocks, and
their own checkpointing).

Then the planner check: on A40+V100 at 16K, zebra with the planner's R against R-1 and
R+1, and Asym-EA on against off; the planner's choice must measure within 5% of the best.

The last line is one JSON object with ``max_rel_error`` and ``worst_cell`` (its name),
``max_rel_error_at_measured_load`` and its cell, ``unfaithful_cells``, ``rerun_cells``,
``zebra_over_ep_a40_v100_16k`` (measured, 1+1, the grid's activations), the same the other
way and ``..._best_of_each``, ``zebra_over_distep_a40_v100_16k``, ``hf_mixtral_zebra_over_ep``
beside the pack model's, and the planner check.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from runs import TEARDOWN_ABORTS, cluster_overrides, run_job

MIXES = {
    "a40+v100 1+1": ["a40", "v100"],
    "a40+v100 2+2": ["a40", "a40", "v100", "v100"],
    "a40+v100 1+2": ["a40", "v100", "v100"],
    "l40s+t4 1+3": ["l40s", "t4", "t4", "t4"],
    "a40x2": ["a40", "a40"],  # one homogeneous mix: what is left of zebra's edge
}
CLOCKS = {"4K": 4096, "16K": 16384}
# The tiny model's CPU tasks must stay under their modelled times: shorter at 4K, and four
# processes share two cores.
TIME_SCALE = {("4K", 2): 3.0, ("4K", 3): 4.0, ("4K", 4): 5.0, ("16K", 2): 1.5, ("16K", 3): 2.0, ("16K", 4): 2.5}
SCHEDULES = {"ep": ["strategy.mode=ep"], "ep_speed": ["strategy.mode=ep", "strategy.batch_split=speed"],
             "distep": ["strategy.mode=distep"], "zebra": ["strategy.mode=zebra"],
             "datacentric": ["strategy.mode=datacentric"]}
GLOBAL_BATCH = 12
GRID_STEPS = 3  # optimizer steps per run, the first of them warm-up (--steps sets another)
MODEL = ["model.n_layers=4", "model.moe.num_experts=24", "model.moe.top_k=2", f"trainer.max_steps={GRID_STEPS}"]
# What each block keeps for its backward. The grid trains as the paper did, every schedule
# with its blocks checkpointed (the clock pays each recompute, the simulator prices it);
# ``stored`` is the same run keeping every activation, which only fits where memory allows.
ACTIVATIONS = {"checkpointed": ["model.activation_checkpointing=true"], "stored": []}


ACCURACY = 0.05  # a faithful cell further than this from its prediction is checked at a slower clock
RETRIES = 3  # re-runs of an unfaithful cell, each at twice the last time_scale
# The control run of a cell still off at the slower clock: the same job whose updates cannot
# move the routers (the learning rate must be > 0), so its routing stays the set-up's.
FROZEN_WEIGHTS = ["optim.lr=1e-12"]


def cell_overrides(mix: str, clock: str, schedule: str, extra: list[str] = (), slowdown: float = 1.0,
                   activations: str = "checkpointed") -> list[str]:
    devices = MIXES[mix]
    W = len(devices)
    name = mix.replace(" ", "_").replace("+", "_")
    scale = TIME_SCALE[(clock, min(W, 4))] * slowdown
    own_steps = any(e.startswith("trainer.max_steps=") for e in extra)  # --steps: the cell's own, not the grid's
    model = [m for m in MODEL if not (own_steps and m.startswith("trainer.max_steps="))]
    return [*cluster_overrides(name, devices, "d1", CLOCKS[clock], scale),
            *model, *ACTIVATIONS[activations], f"data.batch_size={GLOBAL_BATCH // W}", *SCHEDULES[schedule], *extra]


def run_steps(extra: list[str]) -> int:
    """The steps a run takes: ``--steps``'s override among ``extra``, else the grid's."""
    return next((int(e.split("=", 1)[1]) for e in extra if e.startswith("trainer.max_steps=")), GRID_STEPS)


def cell_name(r: dict) -> str:
    return f"{r['mix']} {r['clock']} {r['schedule']}" + (" stored" if r.get("activations") == "stored" else "")


def measure(mix: str, clock: str, schedule: str, extra: list[str] = (), activations: str = "checkpointed") -> dict:
    """One cell, re-run at a slower emulated clock until its emulation is faithful. A run's
    measured and predicted seconds are both on its emulated clock (the workload's times the
    time_scale); a re-run's are divided by its extra slowdown, so every row is on the grid's
    clock and cells compare as before.

    A faithful cell more than ``ACCURACY`` from its prediction is run once more at twice the
    scale: what the padded tasks leave out (Python between tasks, thread switches, gloo's
    own latency: a fixed cost per round) weighs half as much there, while an error of the
    model stays whole. The row kept is the slower clock's; both errors are printed."""
    slowdown, before = 1.0, None
    for attempt in range(RETRIES + 1):
        row = _measure_once(mix, clock, schedule, extra, slowdown, activations)
        for key in ("measured_s", "predicted_s", "predicted_at_load_s"):
            if row[key] is not None:
                row[key] /= slowdown
        row["at_load_by_step_s"] = [t / slowdown for t in row.get("at_load_by_step_s") or ()] or None
        row["time_scale_x"] = slowdown
        if before is not None:
            row["rel_error_faster_clock"] = before
        if attempt == RETRIES:
            return row
        if not row["faithful"]:
            why = f"a rank's tasks ran {row['slip_fraction']:.1%} past their modelled time"
        elif abs(row["rel_error"]) > ACCURACY and before is None:
            why, before = f"{row['rel_error']:+.1%} from its prediction", row["rel_error"]
        elif abs(row["rel_error"]) > ACCURACY:
            return frozen_weights_control(row, mix, clock, schedule, extra, slowdown, activations)
        else:
            return row
        print(f"  ({cell_name(row)}: {why} at x{slowdown:g}; again at x{2 * slowdown:g})", flush=True)
        slowdown *= 2
    raise AssertionError("unreachable")


def frozen_weights_control(row: dict, mix: str, clock: str, schedule: str, extra: list[str],
                           slowdown: float, activations: str = "checkpointed") -> dict:
    """``row`` with ``frozen_weights_rel_error``: the cell's error in the same job with
    :data:`FROZEN_WEIGHTS` (at ``slowdown``, faithful or ``None``). Small there while the
    cell is off: the steps' routing moved away from the one the set-up sampled, the
    simulator did not miss."""
    control = _measure_once(mix, clock, schedule, [*extra, *FROZEN_WEIGHTS], slowdown, activations)
    row["frozen_weights_rel_error"] = control["rel_error"] if control["faithful"] else None
    spread = row.get("batch_spread")
    chance = (f"; one step strays {spread:.1%} from the prediction by its batch's routing alone, a mean of "
              f"{row['timed_steps']} timed steps about {spread / row['timed_steps'] ** 0.5:.1%}") if spread else ""
    # each timed step at its own routing, off the prediction
    by_step = row["at_load_by_step_rel_error"] = [t / row["predicted_s"] - 1
                                                  for t in row.get("at_load_by_step_s") or ()]
    drift = ("; each timed step at its own routing " + ", ".join(f"{e:+.1%}" for e in by_step)
             + " from the prediction") if by_step else ""
    print(f"  ({cell_name(row)}: {row['rel_error']:+.1%} at x{slowdown:g}; the same job with frozen weights: "
          f"{control['rel_error']:+.1%}{'' if control['faithful'] else ', UNFAITHFUL'}{chance}{drift})", flush=True)
    if row.get("record"):
        planned_at_record(row, mix, clock, schedule, extra, slowdown, activations)
    return row


def planned_at_record(row: dict, mix: str, clock: str, schedule: str, extra: list[str], slowdown: float,
                      activations: str = "checkpointed") -> None:
    """The remedy the job's last line names where routing moved: the same job again,
    planned and predicted at the routing its trained steps had (``strategy.expert_load=``,
    the load monitor's record of them), as a next run of it is. Into ``row``: its error
    from that prediction (faithful or ``None``) and how much faster it stepped."""
    with tempfile.TemporaryDirectory(prefix="bench_record_") as tmp:
        path = Path(tmp) / "expert_load.json"
        path.write_text(json.dumps(row["record"]))
        again = _measure_once(mix, clock, schedule, [*extra, f"strategy.expert_load={path}"], slowdown, activations)
    row["planned_at_record_rel_error"] = again["rel_error"] if again["faithful"] else None
    row["planned_at_record_speedup"] = row["measured_s"] / (again["measured_s"] / slowdown)
    print(f"  ({cell_name(row)}: planned at its own steps' recorded routing, as the next run of it is: "
          f"{again['rel_error']:+.1%} from that prediction{'' if again['faithful'] else ', UNFAITHFUL'}, "
          f"{row['planned_at_record_speedup']:.3f}x the steps' speed)", flush=True)


def _measure_once(mix: str, clock: str, schedule: str, extra: list[str], slowdown: float,
                  activations: str = "checkpointed") -> dict:
    steps = run_steps(extra)
    # (a longer run, or one at a slower clock, gets as much longer to finish)
    s = run_job(cell_overrides(mix, clock, schedule, extra, slowdown, activations),
                timeout=300.0 * max(1.0, steps * slowdown / 3))
    row = {"mix": mix, "clock": clock, "schedule": schedule, "activations": activations,
           "measured_s": s["step_time_s"],
           "predicted_s": s["predicted_step_time_s"], "rel_error": s["step_time_rel_error"],
           "predicted_at_load_s": s.get("predicted_step_time_at_measured_load_s"),
           "at_load_by_step_s": s.get("predicted_step_time_at_measured_load_by_step_s"),
           "record": s.get("expert_load_record"),
           "batch_spread": s.get("predicted_step_time_batch_spread"),
           "timed_steps": s["steps"] - s.get("timing_warmup_steps", 1),
           "rel_error_at_load": s.get("step_time_rel_error_at_measured_load"),
           "overrun_fraction": s["emulation"]["overrun_fraction"], "slip_fraction": s["emulation"]["slip_fraction"],
           "faithful": s["emulation"]["faithful"], "wall_s": s["process_wall_s"]}
    if "plan_json" in s and schedule in ("zebra", "distep"):
        p = s["plan_json"]
        row["R"] = p["num_microbatches"] if schedule == "zebra" else p["distep_microbatches"]
        row["roles"] = "".join(r[0] for r in p["roles"])
        row["offloaded"] = sum(1 for layer in p["placement"] for q in layer
                               if q < len(p["zp_groups"][0]["attention_ranks"]))
    return row


def hf_unavailable() -> str:
    """Why the converted Hugging Face Mixtral cannot run here (empty: it can)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[hf]')"
    return ""


def print_row(r: dict) -> None:
    load = (f"{r['predicted_at_load_s']:7.3f} {r['rel_error_at_load']:+6.1%}" if r["rel_error_at_load"] is not None
            else f"{'':>15}")
    extra = f"  R={r['R']} roles={r['roles']} offloaded={r['offloaded']}" if "R" in r else ""
    if r.get("time_scale_x", 1.0) != 1.0:
        extra += f"  x{r['time_scale_x']:g}"
    if r.get("activations", "checkpointed") != "checkpointed":
        extra += f"  {r['activations']}"
    if not r.get("faithful", True):
        extra += "  UNFAITHFUL (left out of max_rel_error)"
    print(f"{r['mix']:13} {r['clock']:>4} {r['schedule']:9} {r['measured_s']:8.3f} {r['predicted_s']:8.3f} "
          f"{r['rel_error']:+6.1%}  {load}  {r['slip_fraction']:5.1%} {r['overrun_fraction']:7.1%}{extra}", flush=True)


def accuracy(rows: list[dict]) -> dict:
    """The worst prediction error over the faithful cells, each beside its cell's name."""
    faithful = [r for r in rows if r["faithful"]]
    out: dict = {"unfaithful_cells": [cell_name(r) for r in rows if not r["faithful"]],
                 "rerun_cells": {cell_name(r): {"x": r["time_scale_x"], "rel_error_faster_clock":
                                                r.get("rel_error_faster_clock"),
                                                **({"frozen_weights_rel_error": r["frozen_weights_rel_error"],
                                                    "batch_spread": r.get("batch_spread"),
                                                    "at_load_by_step_rel_error": r["at_load_by_step_rel_error"],
                                                    "planned_at_record_rel_error": r.get("planned_at_record_rel_error"),
                                                    "planned_at_record_speedup": r.get("planned_at_record_speedup")}
                                                   if "frozen_weights_rel_error" in r else {})}
                                 for r in rows if r["time_scale_x"] != 1.0},
                 "max_slip_fraction": max((r["slip_fraction"] for r in faithful), default=None),
                 "max_overrun_fraction": max((r["overrun_fraction"] for r in faithful), default=None)}
    for key, suffix in (("rel_error", ""), ("rel_error_at_load", "_at_measured_load")):
        scored = [r for r in faithful if r[key] is not None]
        worst = max(scored, key=lambda r: abs(r[key]), default=None)
        out[f"max_rel_error{suffix}"] = abs(worst[key]) if worst else None
        out[f"worst_cell{suffix}"] = cell_name(worst) if worst else None
    return out


def planner_check(activations: str = "checkpointed", extra: list[str] = ()) -> dict:
    """The planner's R and Asym-EA choice against their neighbours, measured (A40+V100, 16K)."""
    mix, clock = "a40+v100 1+2", "16K"
    chosen = measure(mix, clock, "zebra", list(extra), activations=activations)
    R = chosen["R"]
    rows = {f"R={R} (planner)": chosen}
    for r in (R - 1, R + 1):
        if 1 <= r <= GLOBAL_BATCH:  # one sequence per micro-batch at least
            rows[f"R={r}"] = measure(mix, clock, "zebra", [f"strategy.num_microbatches={r}", *extra], activations)
    rows["Asym-EA off"] = measure(mix, clock, "zebra", ["strategy.asym_ea=false", *extra], activations)
    best = min(r["measured_s"] for r in rows.values())
    print(f"\nplanner check on {mix} at {clock} (zebra):")
    for name, r in rows.items():
        print(f"  {name:16} measured {r['measured_s']:.3f} s/step, predicted {r['predicted_s']:.3f}, "
              f"offloaded experts {r.get('offloaded')}")
    within = chosen["measured_s"] <= best * 1.05
    print(f"  planner's choice is {chosen['measured_s'] / best - 1:+.1%} from the best measured: "
          f"{'within' if within else 'NOT within'} 5%")
    return {"mix": mix, "clock": clock, "planner_R": R, "planner_over_best": chosen["measured_s"] / best,
            "within_5pct": within, "measured": {k: v["measured_s"] for k, v in rows.items()}}


def auto_beside_fastest(by: dict) -> dict:
    """Per mix and clock: the fastest schedule measured, the one ``mode=auto`` would choose
    (the fastest predicted), and how much slower that choice measured."""
    print("\nfastest measured beside what mode=auto would choose (the fastest predicted):")
    winners = {}
    for mix in MIXES:
        for clock in CLOCKS:
            cells = {s: by[(mix, clock, s)] for s in SCHEDULES if (mix, clock, s) in by}
            if len(cells) < 2:
                continue
            best = min(cells, key=lambda s: cells[s]["measured_s"])
            chosen = min(cells, key=lambda s: cells[s]["predicted_s"])
            winners[(mix, clock)] = (best, chosen, cells[chosen]["measured_s"] / cells[best]["measured_s"])
            print(f"  {mix:13} {clock:>4}: fastest {best} ({cells[best]['measured_s']:.3f} s); auto would choose "
                  f"{chosen} ({winners[(mix, clock)][2] - 1:+.1%} from the fastest)", flush=True)
    return winners


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one cell: A40+V100 1+1 at the 16K clock, ep and zebra")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of: {', '.join(MIXES)}")
    ap.add_argument("--clocks", default=",".join(CLOCKS), help=f"comma-separated, of: {', '.join(CLOCKS)}")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of: {', '.join(SCHEDULES)}")
    ap.add_argument("--seed", type=int, default=None,
                    help="the runs' seed (model init, warm-up batches, data order; default: the main job's, 1234): "
                         "the routing each prediction is made at, and how it drifts as the model trains")
    ap.add_argument("--steps", type=int, default=GRID_STEPS,
                    help=f"optimizer steps per run, the first of them warm-up (default {GRID_STEPS}): more time "
                         "the routing as it drifts with training (the prediction is made at the initial weights' "
                         "routing)")
    ap.add_argument("--activations", default="checkpointed", choices=list(ACTIVATIONS),
                    help="what the grid's blocks keep for their backward (default: checkpointed, as the paper "
                         "trained); the full grid also runs A40+V100 1+1 16K ep and zebra the other way")
    args = ap.parse_args(argv)
    mixes, clocks, schedules = args.mixes.split(","), args.clocks.split(","), args.schedules.split(",")
    unknown = ([m for m in mixes if m not in MIXES] + [c for c in clocks if c not in CLOCKS]
               + [s for s in schedules if s not in SCHEDULES])
    if unknown:
        ap.error(f"unknown mix, clock or schedule {unknown}: mixes are {list(MIXES)}, clocks {list(CLOCKS)}, "
                 f"schedules {list(SCHEDULES)}")
    subset = (args.mixes != ",".join(MIXES) or args.clocks != ",".join(CLOCKS)
              or args.schedules != ",".join(SCHEDULES))
    started = time.perf_counter()
    if args.steps < 2:
        ap.error(f"--steps={args.steps}: at least 2 (the first step is warm-up, left out of the timing)")
    seeded = ([] if args.seed is None else [f"seed={args.seed}"]) + \
        ([] if args.steps == GRID_STEPS else [f"trainer.max_steps={args.steps}"])
    grid = [("a40+v100 1+1", "16K", s) for s in ("ep", "zebra")] if args.quick else \
        [(m, c, s) for c in clocks for m in mixes for s in schedules]
    print(f"{'mix':13} {'clock':>4} {'schedule':9} {'meas s':>8} {'sim s':>8} {'error':>6}  "
          f"{'sim@load':>7} {'error':>6}  {'slip':>5} {'overran':>7}", flush=True)
    rows = []
    for mix, clock, schedule in grid:
        rows.append(measure(mix, clock, schedule, seeded, activations=args.activations))
        print_row(rows[-1])
    by = {(r["mix"], r["clock"], r["schedule"]): r for r in rows}
    print("\nzebra / ep (speed-up, measured beside predicted):")
    ratios = {}
    for mix in MIXES:
        for clock in CLOCKS:
            z, e, d = (by.get((mix, clock, s)) for s in ("zebra", "ep", "distep"))
            if z and e:
                ratios[(mix, clock)] = (e["measured_s"] / z["measured_s"], e["predicted_s"] / z["predicted_s"])
                line = (f"  {mix:13} {clock:>4}: zebra/ep measured {ratios[(mix, clock)][0]:.2f}x, predicted "
                        f"{ratios[(mix, clock)][1]:.2f}x")
                if d:
                    line += f"; zebra/distep measured {d['measured_s'] / z['measured_s']:.2f}x"
                print(line, flush=True)
    winners = auto_beside_fastest(by)
    if subset:
        print(json.dumps({"cells": len(rows), "seed": args.seed, "steps": args.steps, **accuracy(rows),
                          "winners": {f"{m} {c}": w for (m, c), w in winners.items()},
                          "wall_s": time.perf_counter() - started}), flush=True)
        return {"cells": len(rows), "winners": winners}
    # The headline the other way (zebra and ep each keeping every activation, or each
    # checkpointed): each schedule's faster way gives the best-against-best speed-up, which
    # a user choosing per schedule gets.
    other = "stored" if args.activations == "checkpointed" else "checkpointed"
    control = {s: measure("a40+v100 1+1", "16K", s, seeded, activations=other) for s in ("ep", "zebra")}
    for r in control.values():
        print_row(r)
    pack_ratio = ratios[("a40+v100 1+1", "16K")][0]
    hf_ratio, hf_skipped = None, hf_unavailable()
    if hf_skipped:  # the grid's figures stand without them: say so, and go on to the planner check
        print(f"  converted HF Mixtral rows skipped: {hf_skipped}", flush=True)
    else:
        hf = {s: measure("a40+v100 1+1", "16K", s, ["model.architecture=hf_mixtral", *seeded], args.activations)
              for s in ("ep", "zebra")}
        for s, r in hf.items():
            print_row({**r, "mix": "hf mixtral 1+1"})
        hf_ratio = hf["ep"]["measured_s"] / hf["zebra"]["measured_s"]
        print(f"  converted HF Mixtral, a40+v100 1+1 16K, {args.activations}: zebra/ep measured {hf_ratio:.2f}x "
              f"beside the pack model's {pack_ratio:.2f}x ({hf_ratio / pack_ratio - 1:+.1%}: "
              f"{'within' if abs(hf_ratio / pack_ratio - 1) <= 0.05 else 'NOT within'} 5%)", flush=True)
    check = None if args.quick else planner_check(args.activations, seeded)
    headline = by[("a40+v100 1+1", "16K", "zebra")], by[("a40+v100 1+1", "16K", "ep")]
    best = {s: min(by[("a40+v100 1+1", "16K", s)]["measured_s"], control[s]["measured_s"]) for s in ("ep", "zebra")}
    print(f"  a40+v100 1+1 16K: zebra/ep measured {headline[1]['measured_s'] / headline[0]['measured_s']:.2f}x "
          f"{args.activations}, {control['ep']['measured_s'] / control['zebra']['measured_s']:.2f}x {other}; each "
          f"schedule its faster way: {best['ep'] / best['zebra']:.2f}x", flush=True)
    distep = by.get(("a40+v100 1+1", "16K", "distep"))
    result = {
        **accuracy(rows + list(control.values())),
        "activations": args.activations,
        "seed": args.seed,
        "steps": args.steps,
        "zebra_over_ep_a40_v100_16k": headline[1]["measured_s"] / headline[0]["measured_s"],
        "zebra_over_ep_a40_v100_16k_predicted": headline[1]["predicted_s"] / headline[0]["predicted_s"],
        f"zebra_over_ep_a40_v100_16k_{other}": control["ep"]["measured_s"] / control["zebra"]["measured_s"],
        "zebra_over_ep_a40_v100_16k_best_of_each": best["ep"] / best["zebra"],
        "zebra_over_distep_a40_v100_16k": distep["measured_s"] / headline[0]["measured_s"] if distep else None,
        "hf_mixtral_zebra_over_ep": hf_ratio,
        "hf_mixtral_over_pack_ratio": hf_ratio / pack_ratio if hf_ratio is not None else None,
        "hf_mixtral_skipped": hf_skipped or None,
        "planner_check": check,
        "cells": len(rows),
        "teardown_aborts": len(TEARDOWN_ABORTS),
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
