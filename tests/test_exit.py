"""Every process exits (issue #38): each entry point ends within a few seconds of its work
ending, with exit code 0, and many short multi-process jobs exit without an abort.

The abort was CPython's finalization ending the heartbeat's daemon thread inside a store
call (``pthread_exit`` unwinding through a noexcept C++ frame: "terminate called without
an active exception", SIGABRT, about one exit in sixty at the default beat); the hang, a
process that keeps its threads or its process group past its work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers_exit import EXIT_S, Job
from lightning_hetermoe.training import PREEMPTED_EXIT

ROOT = Path(__file__).resolve().parents[1]

# Each entry point is timed to its exit once in the suite: a user's script that just ends
# after fit (no shutdown call) is README's first example (test_readme.py), the main job
# test_recipes_train.py's main-job test, recipes/cli.py test_callbacks.py's CLI test, the
# self-check test_selfcheck.py's CPU run.


# Many short 2-rank jobs, each rank a fork of one process that imported torch once (a job
# costs a fraction of a second, not two interpreter starts) and that leaves through the
# interpreter's normal finalization (off the end of the script: atexit, then daemon threads
# ended): a heartbeat beating every 0.05 s (so that a store call is often in flight), a gloo
# group on the TCPStore, a few collectives, and exit without any shutdown call.
MANY_EXITS = '''
import json, os, socket, sys, time, types
from pathlib import Path

root, runs, errdir = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
for name, path in (("lightning_hetermoe", root / "lightning_hetermoe"),
                   ("lightning_hetermoe.strategy", root / "lightning_hetermoe" / "strategy")):
    module = types.ModuleType(name)
    module.__path__ = [str(path)]  # the package's modules without its __init__ (no Lightning)
    sys.modules[name] = module
import torch
import torch.distributed as dist
from lightning_hetermoe.strategy import heartbeat
from lightning_hetermoe.strategy.progress import StepProgress


def rank_main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # with the progress watchdog on, each beat makes four store calls: more often in one. A
    # beat every 0.05 s keeps a store call in flight at exit often; the 5 s silence bound
    # keeps a rank that a loaded 2-core host leaves unscheduled for a moment from being
    # called silent (at 0.3 s, CI once saw that: a false report, not the abort looked for)
    heartbeat.ensure(rank, 2, 5.0, lambda r: f"rank {r}", progress=StepProgress(60.0), period_s=0.05)
    t = torch.ones(1000)
    for _ in range(10):
        dist.all_reduce(t)
        time.sleep(0.01)


results, child = [], None
for run in range(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(2):
        err = errdir / f"run{run}_rank{rank}.err"
        pid = os.fork()
        if pid == 0:
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            child = rank
            break
        pids.append((pid, err))
    if child is not None:
        break
    for pid, err in pids:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        results.append({"run": run, "code": code, "stderr": err.read_text()[-400:] if code else ""})
if child is not None:
    rank_main(child, port)  # and this fork falls off the end of the script: a normal exit
else:
    print(json.dumps(results))
'''


@pytest.mark.slow
def test_many_short_multi_process_jobs_exit_without_an_abort(tmp_path):
    script = tmp_path / "many_exits.py"
    script.write_text(MANY_EXITS)
    runs = 12  # 24 rank exits: the old heartbeat aborted about 1 in 8, so 24 clean ones would be luck (3%)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), str(ROOT), str(runs), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == 2 * runs
    bad = [r for r in results if r["code"] != 0]
    assert not bad, f"{len(bad)} of {len(results)} rank exits failed: {bad[:3]}"


def test_stopping_the_heartbeat_joins_its_thread_and_says_the_rank_finished(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_hetermoe.strategy import heartbeat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    beat = heartbeat.ensure(1, 2, 0.3, lambda r: f"rank {r}", on_silent=lambda: None)
    try:
        assert beat is not None and beat.running and heartbeat.running()
    finally:
        heartbeat.stop()
    assert not beat.running, "stop() returns only once the thread has left the store"
    assert not heartbeat.running()
    assert int(store.get("hetermoe/heartbeat/1")) == -1  # peers stop expecting its beats


@pytest.mark.parametrize("torchrun", [False, True])
def test_a_store_that_stops_answering_is_named_by_who_hosts_it(monkeypatch, capsys, torchrun):
    """Under Lightning's launcher rank 0 hosts the job's store: its silence is rank 0's. Under
    torchrun the agent hosts it (no rank at all): the line names the agent, not rank 0."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_hetermoe.strategy.heartbeat import Heartbeat

    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    else:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    ended = threading.Event()
    beat = Heartbeat(1, 2, 0.5, lambda r: f"role of {r}", "127.0.0.1", store.port, on_silent=ended.set,
                     period_s=0.05).start()
    try:
        del store  # its host is gone: the next beat finds no store
        assert ended.wait(10), "the heartbeat never reported the store's silence"
    finally:
        beat.done(finished=False)
    err = capsys.readouterr().err
    if torchrun:
        assert "[hetermoe] the job's store (torchrun's agent at 127.0.0.1:" in err and "rank 0" not in err, err
    else:
        assert "[hetermoe] rank 0 (role of 0) is silent: the job's store (hosted by rank 0) did not answer" in err, err
    assert "(heartbeat_timeout_s=0.5); rank 1 ends the job" in err


@pytest.mark.parametrize("period", [0.0, -1.0, 0.3, 5.0])
def test_a_heartbeat_period_that_cannot_beat_within_the_timeout_is_refused(period):
    from lightning_hetermoe.strategy.heartbeat import Heartbeat

    with pytest.raises(ValueError, match=rf"period_s={period!r} is invalid: must be > 0 and under heartbeat_timeout_s=0.3"):
        Heartbeat(0, 2, 0.3, lambda r: f"rank {r}", "127.0.0.1", 1, period_s=period)


def test_leaving_at_exit_leaves_the_garbage_collector_as_it_found_it():
    """Finalization must still collect what torch, Lightning and Triton made: objects frozen
    out of it stay alive past their modules' teardown, and Triton's bindings (nanobind) then
    print ~580 "leaked" objects on every exit of a user's script."""
    import gc

    from lightning_hetermoe.strategy.launchers import leave_at_exit

    before = gc.get_freeze_count(), gc.isenabled()
    leave_at_exit()
    assert (gc.get_freeze_count(), gc.isenabled()) == before


def main_job_signalled_at_step_3(tmp_path, send, *overrides: str) -> tuple[int, float, str, Job]:
    """The main job (two CPU ranks, ep) in a process group of its own, as a terminal's
    foreground job or a scheduler's task: once rank 0 logged step 3, ``send(launcher)``
    signals it; its exit code, the seconds from the signal until every process of the job is
    gone (the pipe's end-of-file), its output, and the job (when its lines came, when its
    child rank was seen)."""
    job = Job(tmp_path, "trainer.max_steps=100000", "trainer.log_every_n_steps=1", *overrides, warm=True)
    job.watch_children(until=time.monotonic() + 120, done=lambda: job.first("[hetermoe] step 3/") is not None)
    if job.first("[hetermoe] step 3/") is None:
        code, out = job.finish(timeout=5)
        raise AssertionError(f"no step 3 (exit {code}):\n{out[-3000:]}")
    send(job.proc)
    signalled = time.monotonic()
    code, out = job.finish(timeout=60)  # to end-of-file: every process holding the pipe is gone
    return code, time.monotonic() - signalled, out, job


@pytest.mark.slow
def test_a_ctrl_c_ends_the_job_at_once_and_keeps_what_its_steps_measured(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the launcher's whole process group) while the main job
    trains: every rank gone within seconds, exit code 1, no rank reported as failed (the
    children's exits are the user's stop), and the run directory keeps the steps so far:
    summary.json saying it was interrupted, the routing record and its figure.

    The same job shows its child rank started early (lightning_hetermoe/strategy/early_ranks.py):
    forked from rank 0 (the same command line: not a new interpreter re-running the job, whose
    imports cost seconds, as a child the launcher starts at fit is), and launched into the
    job it trains."""
    import signal

    code, gone_s, out, job = main_job_signalled_at_step_3(tmp_path, lambda p: os.killpg(p.pid, signal.SIGINT))
    # the ranks are the children running at step 3: on a fresh machine matplotlib's first font
    # scan runs fc-list from rank 0, and CI once caught it exited, with no command line left
    assert list(job.running.values()) == [job.own_command], (job.commands, job.own_command)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out
    assert code == 1 and gone_s < EXIT_S, (code, gone_s, out[-3000:])
    assert "exited with" not in out and "stopping the other ranks" not in out, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"].startswith("interrupted at step ") and summary["steps"] >= 3, summary
    assert summary["step_time_s"] > 0 and summary["strategy"] == "hetermoe:ep", summary
    assert (tmp_path / "expert_load.json").is_file() and (tmp_path / "expert_load.png").is_file()


def assert_stopped_at_once(code: int, gone_s: float, out: str, summary: dict) -> None:
    assert gone_s < EXIT_S and "Traceback" not in out and "silent" not in out, (code, gone_s, out[-3000:])
    assert code == PREEMPTED_EXIT, (code, out[-3000:])  # not 0: the run did not finish
    assert summary["status"].startswith("stopped at step ") and summary["status"].endswith("the job got SIGTERM")
    assert summary["steps"] >= 3, summary


@pytest.mark.slow
def test_a_sigterm_to_one_child_rank_stops_every_rank_before_one_batch_and_the_job_ends_at_once(tmp_path):
    """A preemption's SIGTERM to one child rank alone: every rank stops before the same batch
    and the job is gone within seconds, its summary saying it was stopped (a child's SIGTERM
    alone once stopped that child and left rank 0 waiting on it). The scheduler's SIGTERM
    to every process of the job is the test below's."""
    import signal

    def send(proc) -> None:
        child = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(child) == 1, child
        os.kill(int(child[0]), signal.SIGTERM)

    code, gone_s, out, _ = main_job_signalled_at_step_3(tmp_path, send)
    assert_stopped_at_once(code, gone_s, out, json.loads((tmp_path / "summary.json").read_text()))


@pytest.mark.slow
def test_a_preempted_main_job_saves_where_it_stopped_and_run_again_goes_on_from_there(tmp_path):
    """A scheduler's SIGTERM to every process of the job (Lightning's own question, a
    broadcast from each rank's signal handler paired with whatever the other rank was at,
    ended the job 35 s later by the heartbeat's verdict in 3 of 7 such SIGTERMs): every
    rank stops before the same batch, the job is gone within seconds, and with
    ``save_checkpoint`` it saves the step it stopped at. Its ``ckpt_path=last`` found
    nothing to resume (a first run): the fit started afresh. The same command again, in the
    same run directory as a requeued job is, resumes from that save: every step counted on
    from there, planned at the routing the checkpoint's steps had."""
    import signal

    job = ("save_checkpoint=true", "ckpt_path=last")
    code, gone_s, out, _ = main_job_signalled_at_step_3(tmp_path, lambda p: os.killpg(p.pid, signal.SIGTERM), *job)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert_stopped_at_once(code, gone_s, out, summary)
    saved = tmp_path / "last.ckpt"
    assert summary["checkpoint"] == str(saved) and saved.exists(), summary
    assert "Restored all states" not in out
    stopped = summary["steps"]

    from helpers_recipe import train_in_ranks

    again, printed = train_in_ranks(2, tmp_path, "cluster=cpu2", "strategy.mode=ep", f"trainer.max_steps={stopped + 2}",
                                    "trainer.limit_val_batches=1", "logger=none", *job)
    assert again["resumed_from"] == str(saved) and "resume" not in again, again
    assert again["steps"] == stopped + 2 and again["timed_steps"] == 1, again
    # (the record leaves the first step out, as the load monitor's does: its warm-up)
    assert again["predicted_at_routing"] == f"the checkpoint's last {stopped - 1} recorded steps", again
    assert "named no checkpoint" not in printed


@pytest.mark.slow
def test_the_launcher_passes_a_signal_to_its_children_without_logging():
    """The strategy's SIGTERM handler passes the signal on through the launcher's ``kill``:
    a handler that logs can land inside a write to the same stream (a "reentrant call"
    traceback in the job's log, CI 2026-12-07); Lightning's own ``kill`` logs each child."""
    import logging
    import signal

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning_hetermoe.strategy.launchers import HydraAwareScriptLauncher

    launcher = HydraAwareScriptLauncher(LightningEnvironment(), 2, 1)
    child = subprocess.Popen(["sleep", "30"])
    launcher.procs.append(child)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    root = logging.getLogger("lightning.pytorch")  # a user debugging Lightning's launch (Lightning sets this logger's level itself)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        launcher.kill(signal.SIGTERM)
        assert child.wait(10) == -signal.SIGTERM
        launcher.kill(signal.SIGTERM)  # an exited child: nothing to do, nothing raised
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        if child.poll() is None:
            child.kill()
    assert records == [], [r.getMessage() for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("returns, code, says", [("3", 3, ""), ("None", 0, ""), ("{'rows': 1}", 0, ""), ("True", 0, ""),
                                                 ("sys.exit('refused: x')", 1, "refused: x")])
def test_a_command_run_to_its_exit_keeps_the_code_its_main_returns(returns, code, says):
    """Recipes and benches end through process_exit.run_and_exit (no finalization): a main
    returning an exit code exits with it, as under ``sys.exit(main())``; other returns are 0."""
    script = ("import sys\nfrom lightning_hetermoe.process_exit import run_and_exit\n"
              f"def main():\n    return {returns}\nrun_and_exit(main)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code and says in proc.stderr, (proc.returncode, proc.stderr)


def test_a_preemption_saves_after_a_step_of_the_fit_and_a_fault_or_a_failed_save_does_not_stop_the_ending(capsys):
    """SaveOnPreemption's choices: a SIGTERM in the fit after a step saves; before the fit's
    first step (in its sanity check, fresh, or just resumed), in the validation after it, or
    a fault saves nothing; a save that fails is said, not raised over the preemption."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_hetermoe.callbacks.preemption import SaveOnPreemption

    saves: list[str] = []

    def trainer(step, fn=TrainerFn.FITTING, fails=False):
        def save(path):
            if fails:
                raise OSError(28, "No space left on device")
            saves.append(path)
        return SimpleNamespace(state=SimpleNamespace(fn=fn), global_step=step, global_rank=0, save_checkpoint=save)

    def outcome(t, exception, resumed_at=0, training=True):
        cb = SaveOnPreemption("run/last.ckpt")
        cb.on_fit_start(t, None)
        if training:  # (a fresh fit's training starts at step 0, a resumed one's at its restored step)
            cb.on_train_start(trainer(resumed_at), None)
        saves.clear()
        cb.on_exception(t, None, exception)
        return cb.saved, list(saves)

    assert outcome(trainer(5), SIGTERMException()) == ("run/last.ckpt", ["run/last.ckpt"])
    assert outcome(trainer(0), SIGTERMException()) == (None, [])
    assert outcome(trainer(21), SIGTERMException(), resumed_at=21) == (None, [])
    assert outcome(trainer(23), SIGTERMException(), resumed_at=21) == ("run/last.ckpt", ["run/last.ckpt"])
    # a resumed fit's sanity check (its training not started): the checkpoint it loaded is not written again
    assert outcome(trainer(21), SIGTERMException(), training=False) == (None, [])
    assert outcome(trainer(5, TrainerFn.VALIDATING), SIGTERMException()) == (None, [])
    assert outcome(trainer(5), RuntimeError("a rank's fault")) == (None, [])
    assert outcome(trainer(5, fails=True), SIGTERMException()) == (None, [])
    said = capsys.readouterr().err
    assert "the preempted fit's checkpoint was not saved to run/last.ckpt: OSError" in said
