"""``bench/gpu.py``, the one script a lent GPU runs: its steps compose, its goals are read
off the rows right, and a step run on the CPU (``--quick``) gives its figures and exits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_script
from helpers_bench import load_bench

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    return load_bench(name)


gpu = _load("gpu")


def _row(**result):
    return {"rc": 0, "result": result}


def test_the_goals_are_read_off_the_training_rows():
    rows = {"train default": _row(step_s=0.160, setup_s=20.0), "train hetermoe": _row(step_s=0.164, setup_s=27.0),
            "train zebra": _row(step_s=0.190, setup_s=30.0)}
    goals = gpu.train_ratios(rows)
    assert goals["hetermoe_over_default_step"] == pytest.approx(0.164 / 0.160, abs=1e-4)
    assert goals["hetermoe_step_within_3pct"] is True
    assert goals["hetermoe_setup_beyond_default_s"] == pytest.approx(7.0)
    assert goals["hetermoe_setup_within_10s"] is True
    assert goals["zebra_loopback_over_single_step"] == pytest.approx(0.190 / 0.164, abs=1e-4)
    assert goals["zebra_loopback_within_10pct"] is False  # 1.16x
    # a row that timed out has no figure: its goals are left out, not guessed
    rows["train hetermoe"] = {"rc": None, "timed_out": True}
    assert gpu.train_ratios(rows) == {}


def test_the_profile_is_set_against_the_cost_model_per_task_kind():
    summary = {"devices": {"h100": {"attention_fwd_ms": 3.0, "cost_model_attention_fwd_ms": 2.0,
                                    "expert_fwd_ms": 1.0, "cost_model_expert_fwd_ms": 4.0}}}
    assert gpu.profile_ratios(summary) == {"h100": {"attention_fwd_measured_over_predicted": 1.5,
                                                    "expert_fwd_measured_over_predicted": 0.25}}


def test_every_step_names_a_script_that_exists_and_the_profile_overrides_compose(tmp_path):
    from helpers_recipe import compose

    names = []
    for name, cmd, deadline, result in gpu.steps(True, tmp_path):
        names.append(name)
        assert deadline > 0 and result is not None
        scripts = [c for c in cmd if c.endswith(".py")]
        assert all(Path(s).exists() for s in scripts), cmd
        if name == "profile":
            overrides = [c for c in cmd[cmd.index(scripts[0]) + 1:] if not c.startswith("hydra.")]
            cfg = compose(*overrides, config_name="profile")
            assert list(cfg.cluster.devices) == ["cpu"] and cfg.model.name == "tiny"
    assert names == ["selfcheck", "kernels", "train default", "train hetermoe", "train zebra", "profile"]
    # under the device tool's 600 s a command, with the wheels' install
    assert sum(gpu.DEADLINES.values()) + 2 * gpu.DEADLINES["train"] <= 560


def test_the_extras_name_scripts_that_exist_with_their_arguments(tmp_path):
    """--extras: each side-by-side run names an existing script and arguments it takes,
    on the GPU and (--quick) on the CPU; together under 6 minutes."""
    for quick in (True, False):
        steps = gpu.extra_steps(quick, tmp_path)
        assert [n for n, *_ in steps] == list(gpu.EXTRA_DEADLINES) == ["ablations", "loss", "norm rotary",
                                                                        "optimizer step", "clip norm", "op overhead"]
        for name, cmd, deadline, result in steps:
            script = next(c for c in cmd if c.endswith(".py"))
            assert Path(script).exists() and deadline > 0 and result is not None, name
            assert ("cuda" in cmd) == (not quick and name != "ablations"), (name, cmd)
    assert sum(gpu.EXTRA_DEADLINES.values()) <= 6 * 60


def test_the_profile_steps_take_zebra_at_two_rs_and_the_single_device_strategy_apart(tmp_path):
    """--profile: bench/gpu_profile.py per (strategy, R), absolute paths, each step's result
    the JSON that script writes into the report's profile folder; under 3.5 minutes."""
    profile = _load("gpu_profile")
    for quick in (True, False):
        steps = gpu.profile_steps(quick, tmp_path / "rel" / ".." / "out-profile")
        assert [n for n, *_ in steps] == list(gpu.PROFILE_DEADLINES)
        for name, cmd, deadline, result in steps:
            script = next(c for c in cmd if c.endswith(".py"))
            assert Path(script) == ROOT / "bench" / "gpu_profile.py" and deadline > 0, name
            strategy, R = cmd[cmd.index("--strategy") + 1], int(cmd[cmd.index("--microbatches") + 1])
            assert strategy in profile.gpu_train.STRATEGIES and (strategy, R) == gpu.PROFILE_RUNS[name]
            out_dir = Path(cmd[cmd.index("--out-dir") + 1])
            assert out_dir.is_absolute() and result.parent == out_dir and ("--quick" in cmd) == quick
            assert result.name == (f"zebra-r{R}.json" if strategy == "zebra" else f"{strategy}.json")
    assert sum(gpu.PROFILE_DEADLINES.values()) <= 4.5 * 60


def test_every_path_a_step_passes_is_absolute(tmp_path):
    """Steps run outside the checkout (so that a wheel installed with --target is what they
    import, not the source tree): every script, result file and run directory they name
    is an absolute path."""
    for quick in (True, False):
        for name, cmd, _, result in [*gpu.steps(quick, tmp_path), *gpu.extra_steps(quick, tmp_path)]:
            paths = [c.split("=", 1)[-1] for c in cmd if c.endswith((".py", ".json")) or "dir=" in c]
            paths += [cmd[i + 1] for i, c in enumerate(cmd) if c == "--json"]
            assert paths and all(Path(p).is_absolute() for p in paths), (name, cmd)
            assert result is None or result.is_absolute()


HANGS = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
def waits_for_a_collective():
    time.sleep(600)
threading.Thread(target=waits_for_a_collective, name="rank-worker").start()
print("started", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_step_past_its_deadline_reports_its_stacks_and_leaves_no_process(tmp_path):
    """A hung step costs its deadline and no more: the report says where each of its
    threads was (faulthandler's dump on SIGABRT) and none of its processes, children
    included, is left running to slow the next step."""
    import os

    pid_file = tmp_path / "child.pid"
    cmd = [sys.executable, "-X", "faulthandler", "-c", HANGS, str(pid_file)]
    row = gpu.run_step("hangs", cmd, 3.0, None, dict(os.environ), tmp_path)
    assert row["timed_out"] is True and row["rc"] is None and row["seconds"] < 3.0 + gpu.STACK_DUMP_S + 5
    assert "started" in row["stdout_tail"]
    assert "waits_for_a_collective" in row["stacks"] and "Thread 0x" in row["stacks"]
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # the step's child went with it (reaped: init adopts it)
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)
        os.kill(child, 0)


@pytest.mark.slow
def test_the_device_session_script_says_what_it_needs(tmp_path):
    """``bench/device_session.sh``: no command, or ``run`` before ``prepare`` made wheels,
    ends with exit 2 and says what to do (``prepare`` itself needs PyPI: not run here)."""
    script = ROOT / "bench" / "device_session.sh"
    env = {"PATH": "/usr/bin:/bin", "HETERMOE_DEVICE_DIR": str(tmp_path / "device")}
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert usage.returncode == 2 and "prepare | run" in usage.stderr
    run = subprocess.run(["bash", str(script), "run", "--quick"], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 2 and "run 'bash bench/device_session.sh prepare' first" in run.stderr
    assert str(tmp_path / "device") in run.stderr


@pytest.mark.slow
def test_a_training_step_runs_on_the_cpu_and_its_process_exits_promptly(tmp_path):
    out = tmp_path / "gpu.json"
    proc = warm_script.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick", "--only", "train zebra",
                            "--out", str(out)], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["steps"]["train zebra"]
    result = row["result"]
    assert result["schedule"] == "zebra" and result["step_s"] > 0 and result["setup_s"] >= 0
    assert result["final_loss"] == result["final_loss"]  # a number, not nan
    assert 0 <= row["exit_after_work_s"] < 5


def test_the_profiles_busy_time_is_the_union_of_the_kernels_spans():
    """Overlapping kernels count once, gaps not at all, and the annotation ranges that CUDA
    events also carry (the optimizer's step spans the whole step under Lightning) not."""
    import torch
    from types import SimpleNamespace

    profile = _load("gpu_profile")
    # loaded by path: bench/ stays off sys.path
    assert str(ROOT / "bench") not in sys.path
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [ev("gemm", 0, 100), ev("copy", 50, 150), ev("norm", 300, 350), ev("host op", 0, 1000, device=cpu),
              ev("Optimizer.step#AdamW.step", 0, 1000, annotation=True), ev("ProfilerStep#3", 0, 1000)]
    prof = SimpleNamespace(events=lambda: events)
    assert profile.device_busy_s(prof) == pytest.approx(200e-6)
    assert [e.name for e in profile.device_work(prof)] == ["gemm", "copy", "norm"]


@pytest.mark.slow
def test_the_profile_of_a_zebra_step_runs_on_the_cpu(tmp_path):
    # a new interpreter: a fit in a process forked from the tests' fork server ran 1.5-2x
    # slower in the full suite (the fiber-threads bench's 3x), though not alone
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--strategy", "zebra", "--quick",
                           "--out-dir", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "zebra-r2.json").read_text())
    assert set(report["step_s"]) == {"plain", "python", "torch", "sync"} and min(report["step_s"].values()) > 0
    assert report["host_syncs_per_step"] == 0 and report["device_busy_s_per_step"] is None  # no CUDA here
    assert report["device_ops_per_step"] is None
    text = (tmp_path / "zebra-r2.txt").read_text()
    assert "executor.py" in text and "torch profiler, by self CPU time" in text  # the zebra executor was profiled


def test_the_paired_verdict_is_the_median_of_one_process_alternating(tmp_path):
    """--alternate N: one step, gpu_train.py alternating in one process; the goals take its
    median ratio beside the separate processes' ratio."""
    (name, cmd, deadline, result), = gpu.alternate_step(False, tmp_path, 3)
    assert name == "train alternate" and cmd[cmd.index("--rounds") + 1] == "3" and result.is_absolute()
    assert deadline == gpu.DEADLINES["train"] * 4
    rows = {"train default": _row(step_s=0.082), "train hetermoe": _row(step_s=0.091),
            "train alternate": _row(median_hetermoe_over_default=1.012)}
    goals = gpu.train_ratios(rows)
    assert goals["hetermoe_step_within_3pct"] is False  # 1.11x between processes
    assert goals["hetermoe_over_default_median_alternate"] == 1.012
    assert goals["hetermoe_step_within_3pct_alternate"] is True


@pytest.mark.slow
def test_alternating_fits_run_in_one_process_on_the_cpu(tmp_path):
    out = tmp_path / "alt.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--strategy", "alternate", "--rounds",
                           "2", "--quick", "--json", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # a new interpreter: as the profile's above
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert len(r["default_step_s"]) == len(r["hetermoe_step_s"]) == len(r["hetermoe_over_default"]) == 2
    assert r["median_hetermoe_over_default"] in r["hetermoe_over_default"] and all(x > 0 for x in r["default_step_s"])
