"""Python's garbage collector in a training job: left alone, or run between steps by the strategy.

    python bench/gc_pauses.py               # about 5 minutes on 2 cores
    python bench/gc_pauses.py --steps 300 --repeats 2

Runs the main job's zebra training, side by side, with ``strategy.gc_every_n_steps=null``
(Python collects whenever it likes) and with the default (50: the strategy collects between
steps, on every rank at once, and freezes what is alive after the first), alternating,
``--repeats`` times each, on two clusters:

* ``cpu2``: two CPU processes computing for real, so a collection's pause is in the step
  time;
* the main job's emulated A40 + V100, where each task is padded to its modelled time: a
  pause that fits inside a task's padding is hidden there, as it would be on a GPU whose
  host runs ahead of its kernels, and shows only where it does not fit.

Per run and rank (a callback, :class:`GcPauses`, times every collection with
``gc.callbacks``): collections inside a step (from the module's first ``training_step`` of a
batch to the batch's end) and between steps, with their seconds and the longest; and per
run, each step's wall time from one batch's start to the next (what the job pays: the
collections between steps included), mean and worst, after the first two steps. Then the
ratios of the default's to Python's own. The last line is JSON with every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L

from runs import TEARDOWN_ABORTS, run_job

CLUSTERS = {"cpu2": ["cluster=cpu2", "strategy.mode=zebra"], "emulated a40+v100": []}
SETTINGS = {"python": ["strategy.gc_every_n_steps=null"], "strategy": []}
SKIP = 2  # steps left out of the step times: the first compiles and warms up


class GcPauses(L.Callback):
    """Every collection of this rank with its seconds and whether it ran inside a step, and
    each step's wall time; written to ``out/rank<r>.json`` when training ends."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.events: list[tuple[int, float, bool]] = []  # (generation, seconds, inside a step)
        self.starts: list[float] = []  # each batch's start
        self.in_step = self.training = False
        self._t = 0.0

    def setup(self, trainer, pl_module, stage: str) -> None:
        gc.callbacks.append(self._timed)
        watch = self

        def training_step(*args, **kwargs):
            watch.in_step = True
            return type(pl_module).training_step(pl_module, *args, **kwargs)

        pl_module.training_step = training_step

    def on_train_start(self, trainer, pl_module) -> None:
        self.training = True  # set-up's collections are not training's

    def _timed(self, phase: str, info: dict) -> None:
        if not self.training:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.events.append((info["generation"], time.perf_counter() - self._t, self.in_step))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.in_step = False

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())
        self.training = False
        os.makedirs(self.out, exist_ok=True)
        with open(Path(self.out) / f"rank{trainer.global_rank}.json", "w") as f:
            json.dump({"events": self.events, "starts": self.starts}, f)


def pauses(rank: dict) -> dict:
    def part(inside: bool) -> dict:
        s = [dt for _, dt, i in rank["events"] if i == inside]
        return {"n": len(s), "s": round(sum(s), 3), "max_s": round(max(s, default=0.0), 3)}

    full = [dt for g, dt, i in rank["events"] if g == 2]
    return {"inside_steps": part(True), "between_steps": part(False), "full": len(full),
            "full_s": round(sum(full), 3)}


def run(cluster: str, setting: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gc_") as out:
        summary = run_job([*CLUSTERS[cluster], *SETTINGS[setting], f"trainer.max_steps={steps}",
                           "+callbacks.gc_pauses._target_=gc_pauses.GcPauses", f"+callbacks.gc_pauses.out={out}"],
                          timeout=120 + 10 * steps)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    walls = [b - a for a, b in zip(ranks[0]["starts"][SKIP:], ranks[0]["starts"][SKIP + 1:])]
    return {"cluster": cluster, "setting": setting, "ranks": [pauses(r) for r in ranks],
            "wall_per_step_s": statistics.fmean(walls), "worst_step_s": max(walls),
            "step_time_s": summary["step_time_s"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps per run (the main job's)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each setting per cluster, alternating")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rows, out = [], {}
    print(f"{'cluster':<18} {'collector':<9} {'rank':>4} {'in steps':>16} {'between':>16} {'full':>4} "
          f"{'wall/step':>10} {'worst':>7}", flush=True)
    for cluster in CLUSTERS:
        for _ in range(args.repeats):
            for setting in SETTINGS:
                row = run(cluster, setting, args.steps)
                rows.append(row)
                for r, p in enumerate(row["ranks"]):
                    i, b = p["inside_steps"], p["between_steps"]
                    print(f"{cluster:<18} {setting:<9} {r:>4} {i['n']:>4} {i['s']:>6.3f}s {i['max_s']:>4.2f} "
                          f"{b['n']:>4} {b['s']:>6.3f}s {b['max_s']:>4.2f} {p['full']:>4} "
                          f"{row['wall_per_step_s']:>9.3f}s {row['worst_step_s']:>6.2f}s", flush=True)
        mean = {s: {k: statistics.fmean(r[k] for r in rows if r["cluster"] == cluster and r["setting"] == s)
                    for k in ("wall_per_step_s", "worst_step_s")} for s in SETTINGS}
        out[cluster] = {"strategy_over_python_wall_per_step": mean["strategy"]["wall_per_step_s"]
                        / mean["python"]["wall_per_step_s"],
                        "strategy_over_python_worst_step": mean["strategy"]["worst_step_s"]
                        / mean["python"]["worst_step_s"],
                        "inside_steps_s": {s: statistics.fmean(sum(p["inside_steps"]["s"] for p in r["ranks"])
                                                               for r in rows
                                                               if r["cluster"] == cluster and r["setting"] == s)
                                           for s in SETTINGS}}
        print(f"{cluster}: wall per step, strategy/python {out[cluster]['strategy_over_python_wall_per_step']:.3f}; "
              f"worst step {out[cluster]['strategy_over_python_worst_step']:.3f}; collections' seconds inside "
              f"steps (all ranks, per run): python {out[cluster]['inside_steps_s']['python']:.3f}, strategy "
              f"{out[cluster]['inside_steps_s']['strategy']:.3f}", flush=True)
    result = {"steps": args.steps, "repeats": args.repeats, "by_cluster": out, "rows": rows,
              "teardown_aborts": len(TEARDOWN_ABORTS), "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
