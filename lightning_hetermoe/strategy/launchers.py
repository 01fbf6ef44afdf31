"""Process launchers: Hydra-multirun safe, checked before any process starts, and loud
about which rank died.

* :class:`HydraAwareScriptLauncher` (``strategy="hetermoe"``) re-runs the script in child
  processes like Lightning's own, but under Hydra each child re-runs only its own job.
* :class:`CheckedSpawnLauncher` (``"hetermoe_spawn"``) is Lightning's spawn launcher.
* Both call ``pre_launch(model, trainer)`` first, so a model (or a callback) the strategy
  cannot run fails in the launching process, before any child exists.
* :class:`RankObserver` replaces Lightning's child-process observer: when a rank exits
  badly it prints which rank, its role and its exit code or signal, then stops the rest.
  Children watch their launcher too (:func:`watch_launcher`): if it dies they exit instead
  of waiting on a collective that will never complete.
* Every thread started here is stopped and joined before the process ends
  (:func:`stop_watching`; an ``atexit`` hook for scripts that never call the strategy's
  ``shutdown``), and :func:`leave_at_exit` leaves the heartbeat and the process group
  before the interpreter's finalization, which ends daemon threads mid-call (the pack's own
  commands run it through :func:`lightning_hetermoe.process_exit.exit_now`).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from .. import process_exit
from . import early_ranks, heartbeat
from .early_ranks import LAUNCHER_PID as _LAUNCHER_PID
from .early_ranks import hydra_job_command

PreLaunch = Callable[[Any, Any], None]  # (model, trainer)
DescribeRank = Callable[[int], str]
JOIN_S = 2.0  # how long stopping a watcher thread waits for it to end


def _hydra_in_use() -> bool:
    # A Hydra job imported Hydra before any launch. Importing it only to ask cost each
    # process of a run without Hydra about 0.08 CPU-s (150 modules) at its first launch.
    hydra_config = sys.modules.get("hydra.core.hydra_config")
    return hydra_config is not None and hydra_config.HydraConfig.initialized()


_JOB_MARK = "HETERMOE_HYDRA_JOB"
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_children_of_job: list[subprocess.Popen] = []
CHILD_EXIT_S = 5.0  # how long a sweep's next job waits for the last one's children before killing them
TAKE_OVER_S = 10.0  # how long a rank observer leaves a dead rank's job to the main thread


def _leave_previous_job() -> None:
    """In the sweep's own process, a new Hydra job must not inherit the last job's world.

    Lightning marks "processes already exist" through LOCAL_RANK & co. in ``os.environ``
    and keeps the process group alive, so that fit-then-validate inside one job reuses
    them. When the Hydra job changes (multirun), those belong to a finished job: reap its
    children, destroy its process group, drop its variables. Children carry the mark of
    their own job, so they never take this path.
    """
    from hydra.core.hydra_config import HydraConfig

    job = HydraConfig.get().runtime.output_dir
    previous = os.environ.get(_JOB_MARK)
    if previous is not None and previous != job:
        # The last job's watchers first (a child stopped below is no rank dying), and its
        # heartbeat (nor is it a rank going silent). A finished job's children are reaped
        # already (the strategy's shutdown waits for them); a failed one's may wait in a
        # collective on this process forever: the sweep waited with them (it hung).
        stop_watching()
        heartbeat.stop()
        deadline = time.monotonic() + CHILD_EXIT_S  # one wait for them all, not one each
        for proc in _children_of_job:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _children_of_job.clear()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for var in _LAUNCH_VARS:
            os.environ.pop(var, None)
    os.environ[_JOB_MARK] = job


_launched: list[subprocess.Popen] = []  # the child ranks this process started (every job)


def end_job_for_silent_peer() -> None:
    """A peer went silent: kill every child rank this process started (stopped ones too:
    SIGKILL reaches them), then exit; a collective may be waiting on the peer forever.

    A sweep's launching process whose heartbeat named one of its child ranks does not exit:
    with that rank killed, the main thread meets it lost in its next collective (gloo: a
    closed connection) and fails the job, whose row says what the heartbeat said, and the
    sweep goes on to its next job. Where the main thread has not taken the failure in hand
    within :data:`TAKE_OVER_S` (a collective that never returns: NCCL), it exits all the same."""
    from .heartbeat import SILENT_PEER_EXIT

    for proc in _launched:
        if proc.poll() is None:
            proc.kill()
    said = heartbeat.reported()
    if said is None or said[0] == 0 or not early_ranks.runs_a_sweep():
        os._exit(SILENT_PEER_EXIT)  # rank 0 stuck itself, or nothing after this job to go on to
    _reported.setdefault(said[0], said[1])
    # the job is left once its heartbeat is stopped (the next job's launch clears the take-over)
    if not _main_thread_took_over(left=lambda: heartbeat.reported() != said):
        os._exit(SILENT_PEER_EXIT)


def _main_thread_took_over(left: Callable[[], bool]) -> bool:
    """Wait (at most :data:`TAKE_OVER_S`) for the main thread to take the job's failure in
    hand, or to leave the job (``left()``): False where it did neither, in a collective that
    may never return (NCCL)."""
    deadline = time.monotonic() + TAKE_OVER_S
    while not (_taken_over.is_set() or left()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def exit_description(code: int) -> str:
    from .heartbeat import SILENT_PEER_EXIT

    if code == SILENT_PEER_EXIT:
        return f"exit code {code} (it saw a silent peer)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# A Ctrl-C at the terminal reaches every rank of the launcher's process group: the children's
# exits that follow are the user's stop, which Lightning's own interrupt handling carries out
# (its callbacks write what they hold, then it kills the children), not a rank failing.
# Set in the SIGINT handler, read by the watcher threads: a plain flag, no lock (a
# ``threading.Event``'s ``set`` takes one, on which a second signal landing inside the first
# one's ``set`` would wait forever).
_interrupted = False


def note_interrupts() -> None:
    """In the main thread: mark a SIGINT before the handler in place (Python's, which raises
    ``KeyboardInterrupt``) runs. Where SIGINT is ignored or handled by a non-Python handler,
    left as it is."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or getattr(previous, "notes_interrupts", False):
        return

    def handler(signum, frame):
        global _interrupted
        _interrupted = True
        previous(signum, frame)

    handler.notes_interrupts = True
    signal.signal(signal.SIGINT, handler)


class RankObserver(threading.Thread):
    """Polls the child ranks; on the first bad exit, says who and stops every rank (not after
    a Ctrl-C: see :func:`note_interrupts`)."""

    def __init__(self, procs: list[subprocess.Popen], describe_rank: DescribeRank | None, node_rank_offset: int,
                 period_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="hetermoe-rank-observer")
        self.procs, self.describe_rank, self.offset, self.period_s = procs, describe_rank, node_rank_offset, period_s
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            if all(p.poll() == 0 for p in self.procs):
                return
            dead = first_dead(self.procs)
            if dead is not None and (_interrupted or _taken_over.is_set()):
                # the user's stop, or a failure the main thread has in hand (it named a rank
                # that died first; the ranks after it end on what it met, a config error too)
                return
            if dead is not None:
                report_dead(self.offset + dead[0], dead[1], self.describe_rank)
                self.stop_all()
                return

    def stop_all(self) -> None:
        """Kill the other ranks of the job, then leave it to the main thread, which meets the
        lost ranks in its next collective and ends the job as a failure (a sweep goes on to
        its next job). A main thread that has neither taken the failure in hand nor left the
        job (stopping its watchers) within :data:`TAKE_OVER_S` may wait in a collective that
        never returns (NCCL): the process ends then, at once, with a failed job's code 1 (a
        SIGKILL of its own, 137, reads to a scheduler as the job killed from outside, an
        out-of-memory kill)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        if not _main_thread_took_over(left=self._halt.is_set):
            os._exit(1)

    def stop(self, join_s: float = JOIN_S) -> None:
        self._halt.set()
        if self.ident is not None and self is not threading.current_thread():
            self.join(join_s)


_observers: list[RankObserver] = []
_taken_over = threading.Event()  # the main thread handles this launch's failure (failure_in_hand)
_watcher: dict[str, Any] = {"thread": None, "stop": threading.Event()}


def failure_in_hand() -> None:
    """The main thread (the strategy's ``on_exception``) handles the job's failure: a rank
    observer that found a dead rank leaves the rest to it."""
    _taken_over.set()


def stop_watching(join_s: float = JOIN_S) -> None:
    """Stop and join this process's watcher threads (rank observers, the launcher watch)."""
    while _observers:
        _observers.pop().stop(join_s)
    _watch["armed"] = False
    _watcher["stop"].set()
    thread, _watcher["thread"] = _watcher["thread"], None
    if thread is not None and thread is not threading.current_thread():
        thread.join(join_s)
    _watch["started"] = False  # a later run in this process starts a fresh watch


def leave_at_exit() -> None:
    """At interpreter exit: leave the heartbeat (joined), the watchers and the zebra fibers'
    idle threads (joined) and the process group (a script that never called the strategy's
    ``shutdown``: a user's ``Trainer.fit``, LightningCLI), before finalization ends daemon
    threads inside C++ calls (SIGABRT)."""
    from .backends.zebra import fibers

    heartbeat.leave(failed=heartbeat.exiting_on_error())
    stop_watching()
    fibers.stop_workers()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass  # at exit, nothing is left to do about it
        import lightning_hetermoe.comm as comm

        comm.forget()
    # Finalization then collects garbage over every object torch and Lightning made (about 1 s
    # after a user's Trainer.fit on a 2-core machine). Leaving them out of it (gc.freeze) took
    # 0.25-0.3 s, but kept Triton's bindings' types alive past their module's teardown, which
    # nanobind reports as ~580 leaked objects on every exit: noise that reads as a bug.


# the pack's own commands end through process_exit.exit_now, which leaves first
process_exit.when_leaving(leave_at_exit)
process_exit.when_failing(heartbeat.mark_failed)  # gone on an error: its peers are not told it finished


_exit_hook = {"registered": False}


def register_exit_hook() -> None:
    """Run :func:`leave_at_exit` at interpreter exit (once per process)."""
    if not _exit_hook["registered"]:
        _exit_hook["registered"] = True
        atexit.register(leave_at_exit)


_watch = {"armed": False, "started": False}


def first_dead(procs: list[subprocess.Popen], wait_s: float = 0.0) -> tuple[int, int] | None:
    """``(local rank, exit code)`` of the first child that exited badly, waiting up to
    ``wait_s`` for one (a peer's socket closes a moment before its process is reaped)."""
    deadline = time.monotonic() + wait_s
    while True:
        for local_rank, p in enumerate(procs, start=1):
            code = p.poll()
            if code:
                return local_rank, code
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def lost_peer(error: BaseException) -> bool:
    """``error`` is a collective's on a connection its peer closed (gloo's "connection closed
    by peer", "reset by peer"): the peer is gone, not this rank at fault."""
    text = str(error).lower()
    return "closed" in text or "reset by peer" in text


# what report_dead said of each rank of this process's launch, in order (a sweep's next job
# launches anew: its ranks are other processes under the same numbers)
_reported: dict[int, str] = {}


def failed_for_a_dead_rank(error: BaseException) -> str | None:
    """Where ``error`` is this process losing a peer whose death it has named, what it said
    of the dead rank (``rank 1 (ep rank, device cpu) exited with exit code 1``): its own
    traceback would only repeat it in gloo's words. ``None`` otherwise."""
    return next(iter(_reported.values())) if _reported and lost_peer(error) else None


def report_dead(rank: int, code: int, describe_rank: DescribeRank | None) -> None:
    if rank in _reported:
        return
    said = heartbeat.reported()
    if said is not None and said[0] == rank:  # the heartbeat named it, then killed it: that is its exit
        _reported[rank] = said[1]
        return
    role = ""
    if describe_rank is not None:
        try:
            role = f" ({describe_rank(rank)})"
        except Exception:  # the plan may not exist yet
            role = ""
    _reported[rank] = f"rank {rank}{role} exited with {exit_description(code)}"
    sys.stderr.write(f"[hetermoe] {_reported[rank]}; stopping the other ranks\n")
    sys.stderr.flush()


def watch_launcher(armed: bool = True, period_s: float = 1.0) -> None:
    """In a child started by :class:`HydraAwareScriptLauncher`: while armed (a fit, validate
    or test is running), exit if the launcher dies, instead of waiting on a collective that
    will never complete. Disarmed between runs, so a child may outlive a finished launcher."""
    _watch["armed"] = armed
    launcher = os.environ.get(_LAUNCHER_PID)
    if not armed or _watch["started"] or launcher is None or int(launcher) == os.getpid():
        return
    _watch["started"] = True
    stop = _watcher["stop"] = threading.Event()

    def watch() -> None:
        while not stop.wait(period_s):
            if _watch["armed"] and os.getppid() != int(launcher):
                sys.stderr.write(f"[hetermoe] the launching process (rank 0, pid {launcher}) is gone; "
                                 f"rank {os.environ.get('LOCAL_RANK', '?')} exits\n")
                sys.stderr.flush()
                os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name="hetermoe-launcher-watch")
    _watcher["thread"] = thread
    register_exit_hook()
    thread.start()


class HydraAwareScriptLauncher(_SubprocessScriptLauncher):
    """Subprocess launcher that re-runs only the current Hydra job in each child, starts
    every job of a multirun sweep from a clean slate, checks the model before starting any
    child and reports a dead rank by rank and role."""

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int,
                 pre_launch: PreLaunch | None = None, describe_rank: DescribeRank | None = None) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.pre_launch, self.describe_rank = pre_launch, describe_rank

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        early_ranks.await_launch()  # a child started with the job: its launcher's word first
        if self.pre_launch is not None and args:
            self.pre_launch(args[0], trainer)
        if _hydra_in_use():
            _leave_previous_job()
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment.creates_processes_externally:
            early_ranks.release()  # (none were started early where this was foreseen)
        else:
            os.environ[_LAUNCHER_PID] = str(os.getpid())
            _taken_over.clear()
            _reported.clear()
            self._call_children_scripts()
            _launched.extend(self.procs)
            if self.procs:
                note_interrupts()
                observer = RankObserver(self.procs, self.describe_rank,
                                        self.cluster_environment.node_rank() * self.num_processes)
                _observers.append(observer)
                register_exit_hook()
                observer.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def kill(self, signum: int) -> None:
        """Pass ``signum`` to the children. Called from a SIGTERM handler
        (:mod:`.sigterm`), which must not log: Lightning's ``kill`` logs each child at debug
        level, and a log line written in a handler can land inside the same stream's write."""
        for proc in self.procs:
            proc.send_signal(signum)  # an exited child's is skipped

    def report_dead_children(self, wait_s: float = 3.0) -> bool:
        """After a failed collective on rank 0: say which launched rank died, if one did (after
        a Ctrl-C, every rank stopping is the user's stop: nothing to say)."""
        dead = first_dead(self.procs, wait_s) if self.procs and not _interrupted else None
        if dead is not None:
            report_dead(self.cluster_environment.node_rank() * self.num_processes + dead[0], dead[1],
                        self.describe_rank)
        return dead is not None

    def _call_children_scripts(self) -> None:
        if not _hydra_in_use():
            return super()._call_children_scripts()
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        # children the job started with its config checked (early_ranks), where they are this
        # launch's: the same job and world on one node; told where to join, not started again
        early = early_ranks.take(self.num_processes) if self.num_nodes == 1 and env.node_rank() == 0 else {}
        if not early:
            early_ranks.release()
        rendezvous = {"MASTER_ADDR": os.environ["MASTER_ADDR"], "MASTER_PORT": os.environ["MASTER_PORT"]}
        for local_rank in range(1, self.num_processes):
            if local_rank in early:
                proc = early[local_rank]
                early_ranks.launch(local_rank, rendezvous)
            else:
                child_env = os.environ.copy()
                child_env["LOCAL_RANK"] = str(local_rank)
                command, cwd = hydra_job_command(local_rank)
                proc = subprocess.Popen(command, env=child_env, cwd=cwd)
            self.procs.append(proc)
            _children_of_job.append(proc)


class CheckedSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, with the model checked before any process starts."""

    def __init__(self, strategy: Any, start_method: str, pre_launch: PreLaunch | None = None) -> None:
        super().__init__(strategy, start_method=start_method)
        self.pre_launch = pre_launch

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.pre_launch is not None and args:
            self.pre_launch(args[0], trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)
