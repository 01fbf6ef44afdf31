"""A rank that dies or raises ends the whole run quickly, and the output says which rank."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_script
from warm_script import left_behind

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]


# Zebra and DistEP faults are injected into an expert rank and an attention rank: on two
# identical CPUs the planner would let both attend, so these runs keep the paper's roles
ROLES = "strategy.require_expert_ranks=true"


# the fault callbacks (tests/faults.py) on the path of the main job's ranks
FAULTS_PATH = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])


def main_job_command(tmp_path, *overrides: str) -> list[str]:
    """The main job on two CPU ranks (ep unless a mode is given; zebra and distep with the
    paper's roles), running into ``tmp_path``."""
    overrides = overrides if any(o.startswith("strategy.mode=") for o in overrides) else ("strategy.mode=ep",) + overrides
    if any(o in ("strategy.mode=zebra", "strategy.mode=distep") for o in overrides):
        overrides = (ROLES, *overrides)
    return [sys.executable, str(ROOT / "recipes" / "train.py"), "trainer.max_steps=50", "cluster=cpu2",
            f"hydra.run.dir={tmp_path}", *overrides]


def run_main_job(tmp_path, *overrides: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=FAULTS_PATH)
    t0 = time.monotonic()
    proc = warm_script.run(main_job_command(tmp_path, *overrides), cwd=ROOT, env=env, timeout=timeout)
    return proc, time.monotonic() - t0


# A child killed outright is the zebra case below (SIGKILL in the middle of its experts), and
# rank 0, the launching process, raising is its router case: each launcher path runs once.
def test_a_child_rank_raising_is_named_and_everything_stops(tmp_path):
    proc, wall = run_main_job(tmp_path, "+callbacks.fault._target_=faults.RaiseAt", "+callbacks.fault.rank=1",
                              "+callbacks.fault.step=3")
    # a failed job's code, whichever of rank 0's threads met the death first (its watcher
    # used to SIGKILL its own process: 137, which reads as killed from outside)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    expect = "[hetermoe] rank 1 (ep rank, device cpu) exited with exit code 1; stopping the other ranks"
    assert expect in proc.stderr, proc.stderr[-3000:]
    assert "injected failure on rank 1" in proc.stderr  # the dead rank's own error
    # and not rank 0's losing it, in gloo's words, under a traceback of its own
    assert "closed by peer" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    assert wall < 60, f"the run took {wall:.0f} s to end after rank 1 failed"
    assert_no_summary_of_success(tmp_path, "rank 1 (ep rank, device cpu) exited with exit code 1")


@pytest.mark.parametrize("fault,rank,expect", [
    ("faults.KillInExperts", 1, "[hetermoe] rank 1 (expert rank, device cpu) exited with signal SIGKILL (9); "
                                "stopping the other ranks"),
    ("faults.RaiseInRouter", 0, "[hetermoe] rank 0 (attention rank, device cpu) failed: RuntimeError: injected "
                                "failure in a router on rank 0"),
])
def test_zebra_rank_failing_mid_schedule_ends_every_rank(tmp_path, fault, rank, expect, monkeypatch):
    """Every process of the job gone within seconds of the line that names the failure (a
    rank 0 that raised once paused 3 s for a dead child it did not have, then spent seconds
    in the interpreter's finalization while the other rank waited on it)."""
    from helpers_exit import EXIT_S, run_to_exit

    monkeypatch.setenv("PYTHONPATH", FAULTS_PATH)  # run_to_exit passes the environment on
    cmd = main_job_command(tmp_path, "strategy.mode=zebra", f"+callbacks.fault._target_={fault}",
                           f"+callbacks.fault.rank={rank}", "+callbacks.fault.step=2")
    code, out, after_s = run_to_exit(cmd, expect, cwd=ROOT, timeout=120, warm=True)
    assert code == 1, (code, out[-3000:])
    assert after_s < EXIT_S, f"the job's processes ended {after_s:.1f} s after rank {rank} failed:\n{out[-3000:]}"
    assert_no_summary_of_success(tmp_path)


def test_a_sweep_goes_on_past_jobs_that_fail_mid_run_each_a_row_saying_why(tmp_path):
    """Job 0's child raises (a dead child used to end the sweep, or a job later its watcher
    SIGKILLed the sweep), job 1's rank 0 raises (the sweep used to hang: its next job waited
    for job 1's child, which waited in a collective on rank 0), job 2's child raises again
    (named again: its rank 1 is another process under the same number). Every job runs,
    the table has a row for each, and the sweep exits 1 at its end."""
    import csv

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=FAULTS_PATH)
    t0 = time.monotonic()
    proc = warm_script.run([sys.executable, str(ROOT / "recipes" / "train.py"), "-m", "cluster=cpu2",
                            "strategy.mode=ep", "trainer.max_steps=4", f"hydra.sweep.dir={tmp_path}",
                            "+callbacks.fault._target_=faults.RaiseAt", "+callbacks.fault.rank=1,0,1",
                            "+callbacks.fault.step=2"], cwd=ROOT, env=env, timeout=120)
    wall = time.monotonic() - t0
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    dead = "failed at step 2: rank 1 (ep rank, device cpu) exited with exit code 1"
    failed = [dead, "failed at step 2: RuntimeError: injected failure on rank 0 at step 2", dead]
    for job, status in enumerate(failed):
        assert f"[hetermoe] job {tmp_path / str(job)} failed: {status.split(': ', 1)[1]}; the sweep goes on" in \
            proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("exited with exit code 1; stopping the other ranks") == 2, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep_summary.csv")))
    assert [r["status"] for r in rows] == failed and [r["schedule"] for r in rows] == ["ep"] * 3, rows
    assert "closed by peer" not in proc.stderr  # job 1's rank 0 losing its child, not printed again
    assert wall < 90, f"the sweep took {wall:.0f} s"
    left = left_behind(str(tmp_path), session=proc.pid)
    assert not left, f"processes left behind: {left}"


def test_a_config_error_the_strategy_finds_in_a_sweep_is_a_row_said_once_and_the_sweep_goes_on(tmp_path):
    """Refused at set-up, where ``mode="auto"`` chose zebra on the emulated mix (its ranks all
    meet it): it used to end the sweep with exit 1, the next job never run, no table (a
    sweep of that one job: its table is written only where the sweep went on)."""
    import csv

    proc = warm_script.run([sys.executable, str(ROOT / "recipes" / "train.py"), "-m",
                            "cluster=emu_a40_v100_d1_4k", "trainer.max_steps=2", f"hydra.sweep.dir={tmp_path}",
                            "+callbacks.prune._target_=lightning.pytorch.callbacks.ModelPruning",
                            "+callbacks.prune.pruning_fn=l1_unstructured", "+callbacks.prune.amount=0.3"],
                           cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # as for a job the config check refuses
    said = "config error: ModelPruning does not work under strategy mode='zebra' on 2 ranks"
    assert proc.stderr.count(said) == 1 and "exited with" not in proc.stderr, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep_summary.csv")))
    assert len(rows) == 1 and rows[0]["status"].startswith(said), rows
    left = left_behind(str(tmp_path), session=proc.pid)
    assert not left, f"processes left behind: {left}"


def test_a_rank_that_goes_silent_in_a_sweep_s_job_fails_that_job_and_the_sweep_goes_on(tmp_path):
    """Rank 1 stops (SIGSTOP) in a sweep's job: the heartbeat names it and used to end the
    whole sweep (exit 75, no table), where its rank 0 waited on it in a collective. The
    stopped rank is killed and rank 0's collective fails: the job is a row saying which rank
    went silent, and the sweep goes on (a sweep of that one job: its table is written only
    where the sweep went on)."""
    import csv

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=FAULTS_PATH)
    proc = warm_script.run([sys.executable, str(ROOT / "recipes" / "train.py"), "-m", "cluster=cpu2",
                            "strategy.mode=ep", "strategy.heartbeat_timeout_s=3", "trainer.max_steps=4",
                            f"hydra.sweep.dir={tmp_path}", "+callbacks.fault._target_=faults.StopInExperts",
                            "+callbacks.fault.rank=1", "+callbacks.fault.step=1"], cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])  # a sweep with a failed job, at its end
    silent = "rank 1 (ep rank, device cpu) is silent: no heartbeat for "
    assert f"[hetermoe] {silent}" in proc.stderr, proc.stderr[-3000:]
    assert f"[hetermoe] job {tmp_path / '0'} failed: {silent}" in proc.stderr, proc.stderr[-3000:]
    assert "the sweep goes on" in proc.stderr and "exited with" not in proc.stderr, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep_summary.csv")))
    assert len(rows) == 1 and rows[0]["status"].startswith(f"failed at step 1: {silent}"), rows
    left = left_behind(str(tmp_path), session=proc.pid)
    assert not left, f"processes left behind: {left}"


def assert_no_summary_of_success(run_dir, why: str = "") -> None:
    """A failed job's summary.json, where rank 0 wrote one before it was stopped, says it failed
    (its steps' figures kept), and ``why`` where given: never one that reads as a finished run."""
    path = run_dir / "summary.json"
    if path.exists():
        status = json.loads(path.read_text()).get("status", "")
        assert status.startswith("failed at step ") and status.endswith(why), status


@pytest.mark.parametrize("launch", ["pack", "torchrun"])
def test_a_stopped_rank_is_named_and_every_other_process_ends(tmp_path, launch):
    """SIGSTOP on the expert rank mid-step: nothing dies, no connection closes, the attention
    rank waits on a collective forever (on NCCL: for the 30-minute process-group timeout).
    The heartbeat names the stopped rank and ends the job, stopped rank included."""
    from harness import free_port

    overrides = ["cluster=cpu2", "strategy.mode=zebra", ROLES, "strategy.heartbeat_timeout_s=3", "trainer.max_steps=50",
                 "+callbacks.fault._target_=faults.StopInExperts", "+callbacks.fault.rank=1", "+callbacks.fault.step=1",
                 f"hydra.run.dir={tmp_path}"]
    script = str(ROOT / "recipes" / "train.py")
    cmd = [sys.executable, script] if launch == "pack" else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", script]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=FAULTS_PATH)
    t0 = time.monotonic()
    start = warm_script.WarmPopen if launch == "pack" else subprocess.Popen  # torchrun's agent: a new interpreter
    proc = start(cmd + overrides, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        os.killpg(proc.pid, 9) if proc.poll() is None else None
    wall = time.monotonic() - t0
    assert proc.returncode != 0
    assert "[hetermoe] rank 1 (expert rank, device cpu) is silent: no heartbeat for" in err, err[-3000:]
    assert wall < 60, f"the job took {wall:.0f} s to end after rank 1 stopped"
    # nothing of the job is left: the stopped rank was killed too
    left = left_behind(str(tmp_path), session=proc.pid)
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("fault,kind,step", [("StopInExperts", "silent: no heartbeat for", 1),
                                             ("SleepInExperts", "stuck: in step 8 for", 8)])
def test_on_three_ranks_a_rank_that_stops_or_sticks_is_named_though_not_every_rank_reads_it(tmp_path, fault, kind,
                                                                                            step):
    """Past two ranks, not every rank reads every other's beat (rank 0 reads all, the others
    rank 0's and the next one's; only rank 0 reads progress): the last rank, stopped or
    asleep in its experts, is still named and the job ends, nothing left behind."""
    proc, wall = run_main_job(tmp_path, "cluster=cpu4", "cluster.devices=[cpu,cpu,cpu]", "cluster.name=cpu3",
                              "strategy.heartbeat_timeout_s=3", "strategy.progress_timeout_s=3",
                              f"+callbacks.fault._target_=faults.{fault}", "+callbacks.fault.rank=2",
                              f"+callbacks.fault.step={step}", timeout=90)
    assert proc.returncode != 0
    assert f"[hetermoe] rank 2 (ep rank, device cpu) is {kind}" in proc.stderr, proc.stderr[-3000:]
    if fault == "SleepInExperts":  # ep's case of the next test, on three ranks
        assert_stuck_report(proc.stderr)
    assert wall < 60, f"the job took {wall:.0f} s to end after rank 2 stopped"
    left = left_behind(str(tmp_path), session=proc.pid)
    assert not left, f"processes left behind: {left}"


def assert_stuck_report(stderr: str) -> None:
    """The watchdog's report of a rank stuck in its step: the bound it held, that the rank is
    not inside a collective, and what its peer does meanwhile."""
    assert "until 5 steps are measured, then 10x their median, at least 3 s" in stderr, stderr[-3000:]
    assert "not inside a collective while its peers wait" in stderr
    assert "rank 0 (" in stderr and "waiting in " in stderr


# ep's case is the test above's (on three ranks: one launch fewer in the suite)
@pytest.mark.parametrize("mode,who", [("zebra", "expert rank"), ("distep", "expert rank"),
                                      ("datacentric", "datacentric rank")])
def test_a_rank_alive_but_stuck_in_a_step_is_named_and_the_job_ends(tmp_path, mode, who):
    """Rank 1 sleeps inside its experts at step 8, after the warm-up steps were measured: its
    process and heartbeat live on, its peer waits in a collective. The watchdog's bound is
    then max(3 s, 10x the median step) (the measured floor is 60 s, or progress_timeout_s
    where lower: 3 s here, so the test is quick; the 60 s floor is test_progress.py's), so
    the job ends within seconds of it, naming rank 1, where NCCL would wait 30 minutes."""
    proc, wall = run_main_job(tmp_path, f"strategy.mode={mode}", "strategy.progress_timeout_s=3",
                              "+callbacks.fault._target_=faults.SleepInExperts", "+callbacks.fault.rank=1",
                              "+callbacks.fault.step=8")
    assert proc.returncode != 0
    assert f"[hetermoe] rank 1 ({who}, device cpu) is stuck: in step 8 for" in proc.stderr, proc.stderr[-3000:]
    assert_stuck_report(proc.stderr)
    assert wall < 60, f"the job took {wall:.0f} s to end after rank 1 got stuck"

