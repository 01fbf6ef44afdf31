"""The main job starts its other local ranks as soon as its config is checked, not at ``fit``
(lightning_hetermoe/strategy/early_ranks.py): forked once rank 0 has imported torch and
Lightning where that is safe, they set up beside rank 0 and join at the launch, and a job
that fails or is stopped before it leaves no rank behind and one voice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers_exit import EXIT_S, Job
from lightning_hetermoe.strategy.early_ranks import JOB_MARK, ForkedRank, starts_early


@pytest.mark.parametrize("trainer, env, count", [
    ({"devices": 2, "num_nodes": 1}, {}, 1),
    ({"devices": 4}, {}, 3),
    ({"devices": 1}, {}, 0),
    ({"devices": "auto"}, {}, 0),
    ({"devices": [0, 1]}, {}, 0),
    ({"devices": True}, {}, 0),
    ({"devices": 2, "num_nodes": 2}, {}, 0),  # each node's launcher starts its own
    ({"devices": 2}, {"LOCAL_RANK": "1"}, 0),  # this process is a rank already
    ({"devices": 2}, {"TORCHELASTIC_RUN_ID": "x"}, 0),  # torchrun starts the ranks
    ({"devices": 2}, {"SLURM_NTASKS": "2"}, 0),
    ({"devices": 2}, {"OMPI_COMM_WORLD_SIZE": "2"}, 0),
    # a sweep's next job, in the process whose launch of the job before set these
    ({"devices": 2}, {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "0", JOB_MARK: "/sweep/0"}, 1),
    ({"devices": 2}, {"LOCAL_RANK": "0", "WORLD_SIZE": "2", JOB_MARK: "/sweep/1"}, 0),  # this job's own launch
    ({"devices": 2}, {"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x", JOB_MARK: "/sweep/0"}, 0),
])
def test_ranks_start_early_only_where_this_process_would_start_them(monkeypatch, trainer, env, count):
    for var in ("LOCAL_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LSB_JOBID",
                "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", JOB_MARK):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert starts_early(trainer, job="/sweep/1") == count


# (that a child rank starts early and its job trains: test_exit.py's Ctrl-C test, on its job)


@pytest.mark.slow
def test_a_config_error_after_the_start_is_said_once_and_leaves_no_rank_behind(tmp_path):
    """Lightning's Trainer refuses the precision (only its own check knows): rank 0 says so
    on one line; the child, started before, fails the same way and says nothing."""
    job = Job(tmp_path, "trainer.precision=fp77")
    job.watch_children(until=time.monotonic() + 60)
    code, out = job.finish()
    assert code == 1, out[-3000:]
    assert job.children, "no child rank was started early"
    assert out.count("config error") == 1 and "Traceback" not in out, out[-3000:]
    assert "trainer: Precision 'fp77' is invalid" in out
    assert not job.alive_children()


@pytest.mark.slow
def test_a_ctrl_c_during_start_up_ends_every_rank_with_one_report(tmp_path):
    """Ctrl-C (SIGINT to the job's process group) while the ranks import: the child started
    early holds it (blocked until its launcher's word), rank 0 acts on it and kills it."""
    job = Job(tmp_path, "trainer.max_steps=2")
    job.watch_children(until=time.monotonic() + 60, done=lambda: job.child_seen is not None)
    assert job.child_seen is not None
    time.sleep(0.5)  # into their imports
    os.killpg(job.proc.pid, signal.SIGINT)
    signalled = time.monotonic()
    code, out = job.finish(timeout=60)
    gone_s = time.monotonic() - signalled
    assert code == 1 and gone_s < EXIT_S, (code, gone_s, out[-3000:])
    # rank 0's report at most (a traceback, where the interrupt landed in an import: one
    # chain, whose last line names it once, however many exceptions it chains); none of the child's
    reports = [line for line in out.splitlines() if line.strip() == "KeyboardInterrupt"]
    assert len(reports) <= 1, out[-3000:]
    assert not job.alive_children()


def _forked(then) -> ForkedRank:
    pid = os.fork()
    if pid == 0:
        try:
            then()
        finally:
            os._exit(0)
    return ForkedRank(pid, 1)


@pytest.mark.slow
def test_a_forked_rank_reads_as_a_popen_does_for_the_launcher():
    """The launcher polls, waits for, signals and kills its children; a forked rank answers
    each as subprocess.Popen answers for a child started from a command."""
    exits = _forked(lambda: os._exit(3))
    popen_exits = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    assert exits.wait(timeout=30) == popen_exits.wait(timeout=30) == 3
    assert exits.poll() == exits.returncode == 3
    exits.kill()  # gone already: nothing to signal, no error, as Popen's

    sleeps = _forked(lambda: time.sleep(60))
    popen_sleeps = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert sleeps.poll() is None and popen_sleeps.poll() is None
    for proc in (sleeps, popen_sleeps):
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
    sleeps.kill()
    popen_sleeps.kill()
    assert sleeps.wait(timeout=30) == popen_sleeps.wait(timeout=30) == -signal.SIGKILL

    stopped = _forked(lambda: time.sleep(60))
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=30) == -signal.SIGTERM


SIGNALLED_IN_POLL = """
import os, signal, time
from lightning_hetermoe.strategy.early_ranks import ForkedRank
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
rank = ForkedRank(pid, 1)
signal.signal(signal.SIGUSR1, lambda signum, frame: rank.send_signal(signal.SIGTERM))
with rank._lock:  # the main thread inside rank.poll() when the handler runs
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
print("code", rank.wait(timeout=20))
"""


@pytest.mark.slow
def test_a_forked_rank_takes_a_signal_from_a_handler_that_ran_inside_its_poll():
    """The strategy's SIGTERM handler passes the signal to the child ranks; it runs in the
    main thread, between any two of its steps, also inside the launcher's own poll of a
    forked rank: the signal still goes through (a blocking lock there waited on itself)."""
    run = subprocess.run([sys.executable, "-c", SIGNALLED_IN_POLL], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.split() == ["code", str(-signal.SIGTERM)], (run.stdout, run.stderr)


@pytest.mark.slow
def test_a_fork_is_taken_only_with_no_other_python_thread_running():
    """A lock another thread held at the fork stays held in the child: a fresh interpreter
    may fork, the same one with a thread running may not."""
    probe = ("import threading, time\n"
             "from lightning_hetermoe.strategy.early_ranks import fork_hazard\n"
             "alone = fork_hazard()\n"
             "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
             "print(repr(alone), fork_hazard())\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "'' 1 other Python thread(s) running", out.stdout + out.stderr
