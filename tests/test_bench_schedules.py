"""``bench/schedules.py``'s verdict per cell: re-run at a slower clock, then the control run
with frozen weights that tells routing drift from a simulator error. The runs themselves
are real jobs (minutes each); here one cell's run is replaced by its figures."""

from __future__ import annotations

import pytest

from helpers_bench import BENCH, load_bench


RECORD = {"model": "tiny", "mean_share": [[0.5, 0.5]], "steps": 2, "choices_per_step": 8.0}


def schedules_bench(monkeypatch, errors: dict[tuple[bool, float], float]):
    """The bench with each run answering ``errors[(frozen weights, slowdown)]``; the calls made."""
    monkeypatch.syspath_prepend(str(BENCH))  # its scripts import their shared module by name
    bench = load_bench("schedules")
    calls = []

    def run_once(mix, clock, schedule, extra, slowdown, activations):
        frozen = all(o in extra for o in bench.FROZEN_WEIGHTS)
        # planned at a record of the routing the steps had: the record the runs return
        at = next((o.split("=", 1)[1] for o in extra if o.startswith("strategy.expert_load=")), None)
        if at is not None:
            import json

            assert json.loads(open(at).read()) == RECORD
            frozen = "record"
        calls.append((frozen, slowdown) if activations == "checkpointed" else (frozen, slowdown, activations))
        err = errors[(frozen, slowdown)]
        return {"mix": mix, "clock": clock, "schedule": schedule, "activations": activations,
                "measured_s": slowdown * (1 + err),
                "predicted_s": slowdown * 1.0, "rel_error": err, "predicted_at_load_s": None,
                "rel_error_at_load": None, "overrun_fraction": 0.0, "slip_fraction": 0.0, "faithful": True,
                "wall_s": 1.0, "at_load_by_step_s": [slowdown * 1.048, slowdown * 1.052], "record": RECORD}

    monkeypatch.setattr(bench, "_measure_once", run_once)
    return bench, calls


def test_a_cell_still_off_at_the_slower_clock_gets_its_frozen_weights_control(monkeypatch):
    bench, calls = schedules_bench(monkeypatch, {(False, 1.0): 0.061, (False, 2.0): 0.055, (True, 2.0): 0.016,
                                                 ("record", 2.0): 0.029})
    row = bench.measure("l40s+t4 1+3", "16K", "zebra")
    assert calls == [(False, 1.0), (False, 2.0), (True, 2.0), ("record", 2.0)]
    # the verdict stays the trained run's, at the slower clock; the control stands beside it
    assert row["rel_error"] == 0.055 and row["time_scale_x"] == 2.0 and row["measured_s"] == 1.055
    assert row["rel_error_faster_clock"] == 0.061 and row["frozen_weights_rel_error"] == 0.016
    summary = bench.accuracy([row])
    assert summary["max_rel_error"] == 0.055
    assert summary["rerun_cells"]["l40s+t4 1+3 16K zebra"]["frozen_weights_rel_error"] == 0.016
    # each timed step priced at its own routing, on the grid's clock: the drift step by step
    assert summary["rerun_cells"]["l40s+t4 1+3 16K zebra"]["at_load_by_step_rel_error"] == \
        pytest.approx([0.048, 0.052])
    # and once more planned at the record of its steps' routing, as its next run would be
    rerun = summary["rerun_cells"]["l40s+t4 1+3 16K zebra"]
    assert rerun["planned_at_record_rel_error"] == 0.029
    assert rerun["planned_at_record_speedup"] == pytest.approx(1.055 / 1.029)


def test_a_cell_within_reach_at_the_slower_clock_runs_no_control(monkeypatch):
    bench, calls = schedules_bench(monkeypatch, {(False, 1.0): 0.061, (False, 2.0): 0.03})
    row = bench.measure("l40s+t4 1+3", "16K", "zebra")
    assert calls == [(False, 1.0), (False, 2.0)]
    assert row["rel_error"] == 0.03 and "frozen_weights_rel_error" not in row
    assert "frozen_weights_rel_error" not in bench.accuracy([row])["rerun_cells"]["l40s+t4 1+3 16K zebra"]


def test_the_grid_checkpoints_its_blocks_and_a_stored_cell_keeps_them_through_its_reruns(monkeypatch):
    bench, calls = schedules_bench(monkeypatch, {(False, 1.0): 0.061, (False, 2.0): 0.055, (True, 2.0): 0.016,
                                                 ("record", 2.0): 0.01})
    assert "model.activation_checkpointing=true" in bench.cell_overrides("a40+v100 1+1", "16K", "zebra")
    assert not any("activation_checkpointing" in o
                   for o in bench.cell_overrides("a40+v100 1+1", "16K", "zebra", activations="stored"))
    row = bench.measure("a40+v100 1+1", "16K", "ep", activations="stored")
    assert calls == [(False, 1.0, "stored"), (False, 2.0, "stored"), (True, 2.0, "stored"),
                     ("record", 2.0, "stored")]
    assert bench.cell_name(row) == "a40+v100 1+1 16K ep stored"


def test_steps_replace_the_grid_s_three_and_a_longer_run_gets_longer_to_finish(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = load_bench("schedules")
    steps = [o for o in bench.cell_overrides("l40s+t4 1+3", "16K", "zebra") if o.startswith("trainer.max_steps=")]
    assert steps == ["trainer.max_steps=3"]
    longer = bench.cell_overrides("l40s+t4 1+3", "16K", "zebra", ["trainer.max_steps=41"])
    assert [o for o in longer if o.startswith("trainer.max_steps=")] == ["trainer.max_steps=41"]
    timeouts = []

    def run_job(overrides, timeout=300.0):
        timeouts.append(timeout)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench, "run_job", run_job)
    for extra, slowdown in (([], 1.0), (["trainer.max_steps=41"], 2.0)):
        try:
            bench._measure_once("l40s+t4 1+3", "16K", "zebra", extra, slowdown)
        except RuntimeError:
            pass
    assert timeouts == [300.0, 300.0 * 41 * 2 / 3]
