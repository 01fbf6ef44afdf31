"""The main job starts its other local ranks as soon as its config is checked, beside rank 0's
imports and set-up, not at ``fit`` (lightning_hetermoe/strategy/early_ranks.py): they join at
the launch, and a job that fails or is stopped before it leaves no rank behind and one voice."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers_exit import EXIT_S, Job
from lightning_hetermoe.strategy.early_ranks import JOB_MARK, starts_early


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
