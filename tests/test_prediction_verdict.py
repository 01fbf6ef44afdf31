"""The main job's last line about its prediction: measured against predicted, and what a
difference points to (the routing moving, the clock, the emulation)."""

from __future__ import annotations

from lightning_hetermoe.training import VERDICT_TOLERANCE, prediction_verdict

FAITHFUL = {"faithful": True}


def summary(measured, predicted, at_load=None, emulation=FAITHFUL, **extra):
    out = {"step_time_s": measured, "predicted_step_time_s": predicted, "emulation": emulation, **extra}
    if at_load is not None:
        out["predicted_step_time_at_measured_load_s"] = at_load
    return out


def test_nothing_to_say_without_a_prediction_or_a_measured_step(tmp_path):
    assert prediction_verdict({"step_time_s": 1.0}, tmp_path) is None
    assert prediction_verdict({"predicted_step_time_s": 1.0}, tmp_path) is None


def test_a_step_on_its_prediction_says_so_with_both_errors(tmp_path):
    line = prediction_verdict(summary(1.02, 1.0, at_load=1.01), tmp_path)
    assert line == ("[hetermoe] prediction: step 1.02 s measured, 1 s predicted at set-up (+2.0%); at the routing the timed "
                    "steps had, 1.01 s (+1.0%): on the prediction")
    assert prediction_verdict(summary(0.98, 1.0), tmp_path).endswith("(-2.0%): on the prediction")
    # no routing measured (the load monitor left out): off, and where to look
    assert prediction_verdict(summary(1.2, 1.0), tmp_path).endswith(
        "(+20.0%): more than 5% off; the load monitor (callbacks.load_monitor) records the routing that would say why")


def test_a_miss_the_steps_routing_explains_names_the_routing_and_the_record_to_plan_at(tmp_path):
    record = tmp_path / "expert_load.json"
    s = summary(4.62, 4.03, at_load=4.59)
    line = prediction_verdict(s, tmp_path)
    assert "(+14.6%)" in line and "4.59 s (+0.7%)" in line
    assert line.endswith("(+0.7%): the routing moved from the one the set-up planned at")
    record.write_text("{}")  # the load monitor wrote the run's routing: the next run can plan at it
    assert prediction_verdict(s, tmp_path).endswith(f"planned at; strategy.expert_load={record} plans the next run at it")


def test_a_miss_at_the_steps_own_routing_points_at_the_clock(tmp_path):
    off = 1.0 + 2 * VERDICT_TOLERANCE
    real = prediction_verdict(summary(off, 1.0, at_load=1.0, emulation=None), tmp_path)
    assert real.endswith("the clock prices these devices off: a measured profile (recipes/profile_devices.py, then "
                         "strategy.profile=<its JSON>) prices them as they run")
    late = prediction_verdict(summary(off, 1.0, at_load=1.0, emulation={"faithful": False}), tmp_path)
    assert late.endswith("the emulated clock was not faithful (summary.json's emulation.warning)")
    missed = prediction_verdict(summary(off, 1.0, at_load=1.0), tmp_path)
    assert missed.endswith("the simulator misses this run at its steps' own routing")
    # within the tolerance at set-up, off at the steps' routing: still the clock's miss
    assert prediction_verdict(summary(1.0, 1.0, at_load=1.0 / off), tmp_path).endswith("own routing")


def test_a_gpu_cluster_run_on_cpu_processes_says_so_not_that_the_clock_prices_its_devices_off(tmp_path):
    """``cluster=o1`` trained on this machine: CPU processes, a prediction for the cluster's
    GPUs, no emulated clock. The miss is neither the routing's nor the cost model's."""
    off = 1.0 + 2 * VERDICT_TOLERANCE
    cpus = summary(off, 1.0, at_load=1.0, emulation=None, ran_on="cpu", devices=["a40", "a40", "v100"])
    assert prediction_verdict(cpus, tmp_path).endswith(
        "the ranks ran on the CPU and the prediction is for the cluster's devices (2 a40, 1 v100): cluster.emulate=true "
        "plays their clock on CPU processes (the emu_* clusters do)")
    # on the devices it priced (the GPUs themselves, or CPUs priced as CPUs), the clock is what is left
    for ran_on, devices in (("cuda", ["a40", "a40", "v100"]), ("cpu", ["cpu", "cpu"])):
        line = prediction_verdict(dict(cpus, ran_on=ran_on, devices=devices), tmp_path)
        assert line.endswith("strategy.profile=<its JSON>) prices them as they run"), line
