"""A Hydra multirun over GPU mixes as one result: ``sweep_summary.csv``, ``.md`` and ``sweep.png``.

``SweepSummary`` is a Hydra callback (``hydra.callbacks.sweep_summary`` in ``conf/``). At
the end of a multirun it reads every job's ``summary.json`` in the sweep directory and
writes one table with a row per job (and, for ``recipes/plan.py`` sweeps, a row per job
and schedule): the job's overrides, the mix, the schedule, tokens/s measured beside
predicted, the step times and the prediction's share of the throughput bound. A job that
failed (no summary) gets a row that says so, and a mix the planner refused (nothing fits)
one with the planner's reason. The CSV has every column; the markdown table leaves out the
columns no row fills (a plan sweep measures nothing).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("job", "overrides", "cluster", "devices", "schedule", "tokens_per_s", "predicted_tokens_per_s",
           "workload_tokens_per_s", "step_time_s", "predicted_step_time_s", "predicted_of_bound", "final_loss",
           "status")


def job_rows(job_dir: Path) -> list[dict[str, Any]]:
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = ""
    if overrides_file.is_file():
        from omegaconf import OmegaConf

        overrides = " ".join(str(o) for o in OmegaConf.load(overrides_file))
    base = {"job": job_dir.name, "overrides": overrides}
    path = job_dir / "summary.json"
    if not path.is_file():
        return [{**base, "status": "failed (no summary.json)"}]
    s = json.loads(path.read_text())
    devices = " ".join(s.get("devices", []))
    if "error" in s and not s.get("schedules"):  # recipes/plan.py refused: nothing fits, and why
        return [{**base, "cluster": s.get("cluster"), "devices": devices, "status": s["error"]}]
    if "schedules" in s:  # recipes/plan.py: predictions per schedule, nothing measured
        bound = s.get("bound_tokens_per_s")
        return [{**base, "cluster": s.get("cluster"), "devices": devices, "schedule": name,
                 "predicted_tokens_per_s": r.get("tokens_per_s"), "predicted_step_time_s": r.get("step_time_s"),
                 "predicted_of_bound": r["tokens_per_s"] / bound if bound and r.get("tokens_per_s") else None,
                 "status": "ok" if "error" not in r else r["error"]} for name, r in s["schedules"].items()]
    pred_step = s.get("predicted_step_time_s")
    tokens_per_step = s["tokens_per_s"] * s["step_time_s"] if s.get("step_time_s") else None
    return [{**base, "cluster": s.get("cluster"), "devices": devices,
             # (what ran, as the plan's table names it: a run failed before its prediction has
             # only the strategy's name, "hetermoe:ep")
             "schedule": s.get("predicted_schedule") or (s.get("strategy") or "").removeprefix("hetermoe:") or None,
             "tokens_per_s": s.get("tokens_per_s"),
             "predicted_tokens_per_s": tokens_per_step / pred_step if tokens_per_step and pred_step else None,
             "workload_tokens_per_s": s.get("workload_tokens_per_s"), "step_time_s": s.get("step_time_s"),
             "predicted_step_time_s": pred_step, "predicted_of_bound": s.get("predicted_fraction_of_bound"),
             "final_loss": s.get("final_loss"), "status": s.get("status", "ok")}]


def summarize(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Write the three files into ``sweep_dir``; returns the rows."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows = [row for job in jobs for row in job_rows(job)]
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in COLUMNS})
    (sweep_dir / "sweep_summary.md").write_text(markdown(rows))
    plot(rows, sweep_dir / "sweep.png")
    return rows


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return ""
    if key == "predicted_of_bound":
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


MARKDOWN = ("job", "overrides", "schedule", "tokens_per_s", "predicted_tokens_per_s", "workload_tokens_per_s",
            "step_time_s", "predicted_step_time_s", "predicted_of_bound", "status")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table to read: the columns of :data:`MARKDOWN` that some row fills."""
    shown = [k for k in MARKDOWN if any(r.get(k) is not None for r in rows)]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_fmt(k, r.get(k)) for k in shown) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _bars(row: dict[str, Any]) -> tuple[float, float]:
    """Measured and predicted tokens/s on one basis: the workload's when the run was emulated
    (the prediction scaled by the same step-time ratio), else the run's own."""
    workload, step, pred_step = (row.get(k) for k in ("workload_tokens_per_s", "step_time_s",
                                                       "predicted_step_time_s"))
    if workload and step and pred_step:
        return workload, workload * step / pred_step
    return row.get("tokens_per_s") or 0, row.get("predicted_tokens_per_s") or 0


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    labels = [f"{r['job']}: {r.get('overrides') or r.get('cluster')}\n{r.get('schedule')}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(ok) + 2), 4.5))
    x = range(len(ok))
    pairs = [_bars(r) for r in ok]
    measured, predicted = [m for m, _ in pairs], [p for _, p in pairs]
    if any(measured):
        ax.bar([i - 0.2 for i in x], measured, width=0.4, label="measured (workload tokens/s if emulated)")
    ax.bar([i + 0.2 for i in x], predicted, width=0.4, label="predicted", alpha=0.7)
    ax.set_xticks(list(x), labels, fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("sweep: throughput per job")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            rows = summarize(sweep_dir)
            print(f"[hetermoe] sweep of {len(rows)} row(s): {sweep_dir / 'sweep_summary.md'}", flush=True)
