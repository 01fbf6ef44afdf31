"""The table a multirun ends with (``SweepSummary``): rows from each job's summary.json, the
prediction's share of the throughput bound, and a markdown table of the filled columns."""

from __future__ import annotations

import csv
import json

from lightning_hetermoe.sweep import COLUMNS, summarize


def job(sweep, n: int, overrides: list[str], summary: dict | None) -> None:
    d = sweep / str(n)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))


def test_a_plan_sweep_shows_each_schedule_s_share_of_the_bound_and_no_empty_measured_columns(tmp_path):
    job(tmp_path, 0, ["cluster=o1"], {"cluster": "o1", "devices": ["a40", "v100"], "bound_tokens_per_s": 400.0,
                                     "schedules": {"zebra": {"tokens_per_s": 300.0, "step_time_s": 2.0},
                                                   "ep": {"tokens_per_s": 100.0, "step_time_s": 6.0},
                                                   "ep_ideal": {"error": "EP does not fit"}}})
    job(tmp_path, 1, ["cluster=c1"], None)  # a job that died before its summary
    rows = summarize(tmp_path)
    assert [(r["job"], r.get("schedule"), r.get("predicted_of_bound"), r["status"]) for r in rows] == [
        ("0", "zebra", 0.75, "ok"), ("0", "ep", 0.25, "ok"), ("0", "ep_ideal", None, "EP does not fit"),
        ("1", None, None, "failed (no summary.json)")]
    with open(tmp_path / "sweep_summary.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == COLUMNS  # the CSV keeps every column
    md = (tmp_path / "sweep_summary.md").read_text().splitlines()
    assert md[0] == "| job | overrides | schedule | predicted_tokens_per_s | predicted_step_time_s | predicted_of_bound " \
                    "| status |"
    assert md[2] == "| 0 | cluster=o1 | zebra | 300 | 2 | 75.0% | ok |"


def test_a_training_sweep_keeps_measured_beside_predicted_and_the_run_s_share_of_the_bound(tmp_path):
    job(tmp_path, 0, ["cluster=emu"], {"cluster": "emu", "devices": ["a40", "v100"], "strategy": "hetermoe:zebra",
                                      "predicted_schedule": "zebra", "tokens_per_s": 700.0, "step_time_s": 1.4,
                                      "predicted_step_time_s": 1.3, "predicted_fraction_of_bound": 0.879,
                                      "workload_tokens_per_s": 190000.0, "final_loss": 2.2})
    rows = summarize(tmp_path)
    assert rows[0]["predicted_of_bound"] == 0.879 and rows[0]["predicted_tokens_per_s"] == 700.0 * 1.4 / 1.3
    md = (tmp_path / "sweep_summary.md").read_text().splitlines()
    assert md[0] == ("| job | overrides | schedule | tokens_per_s | predicted_tokens_per_s | workload_tokens_per_s "
                     "| step_time_s | predicted_step_time_s | predicted_of_bound | status |")
    assert md[2].endswith("| 87.9% | ok |")


def test_a_training_job_that_ended_early_says_how_in_its_row(tmp_path):
    """summary.json of a fit interrupted or failed: its steps' figures and how it ended."""
    job(tmp_path, 0, ["cluster=emu"], {"cluster": "emu", "devices": ["a40", "v100"], "strategy": "hetermoe:zebra",
                                      "tokens_per_s": 700.0, "step_time_s": 1.4, "status": "interrupted at step 14"})
    job(tmp_path, 1, ["cluster=emu"], {"cluster": "emu", "devices": ["a40", "v100"], "strategy": "hetermoe:zebra",
                                      "tokens_per_s": 700.0, "step_time_s": 1.4})
    rows = summarize(tmp_path)
    assert [(r["job"], r["tokens_per_s"], r["status"]) for r in rows] == [("0", 700.0, "interrupted at step 14"),
                                                                          ("1", 700.0, "ok")]
    # without a prediction, what ran as the plan's table names it (not "hetermoe:zebra")
    assert [r["schedule"] for r in rows] == ["zebra", "zebra"]
