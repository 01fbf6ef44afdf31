"""Child ranks started when the job starts, not when it reaches ``fit``.

A Hydra job's launcher (:class:`~.launchers.HydraAwareScriptLauncher`) starts the other
local ranks at ``fit``, after the launching process has imported torch and Lightning and
built its model, data and trainer; each child then does all of that again before it joins
the process group: on a 2-core machine the main job's child joined 4.7 s after it started,
the whole time with rank 0 waiting. Started as soon as the job's config is checked, the
children do their set-up beside rank 0.

Each child is forked from the launching process once that has imported what every rank
imports (torch, Lightning, the pack: 5-6 CPU-s a process on a 2-core machine, done once, not
once a rank), and runs the job from there. A fork is taken only where it is safe: on Linux,
with no CUDA driver loaded in this process and no thread of Python's running but this one
(the imports start neither), and in the process's first job (a job that ran here before
started OpenMP's threads, and GNU OpenMP hangs in a forked child). Elsewhere, or where the
caller gives no job to run, each child is a new interpreter that re-runs this Hydra job,
started before the imports, beside them.

A child started early does everything up to the launch on its own and then waits for its
launcher's word (:func:`await_launch`): the rendezvous address, given only then because
Lightning picks the port at the launch (picked seconds earlier, another process could take
it meanwhile). If the launching process fails or is stopped before the launch (a config
error, a model it refuses, Ctrl-C), its children never join: they are killed, or see the
word's pipe close and leave without a word of their own (:func:`leave_quietly_unless_launched`),
so a mistake is reported once, by rank 0, as before; a Ctrl-C waits in them (blocked) until
the word.

The launcher takes the early children only where it would have started the same ones (the
same Hydra job, the same number of local ranks, one node, Lightning's own environment); a
run whose ranks another program starts (torchrun, SLURM, MPI, Kubeflow, LSF) starts none
early, and any left unclaimed are killed at the launch or when the job ends.

This module imports nothing heavy: the recipe calls it before torch loads (``start`` loads
what its caller names, where it forks).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

LAUNCH_FD = "HETERMOE_LAUNCH_FD"  # in a child started early: the pipe its launcher's word comes on
LAUNCHER_PID = "HETERMOE_LAUNCHER_PID"
# set where another program starts the ranks (Lightning's cluster environments detect these)
# or where this process is already a rank: no child is started early there
_STARTED_ELSEWHERE = ("LOCAL_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID",
                      "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")
# what a launch sets in its own process, and the Hydra job it set them for: a sweep's next job
# in the same process finds them there until its own launch drops them
LAUNCH_VARS = (*_RENDEZVOUS, "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
JOB_MARK = "HETERMOE_HYDRA_JOB"


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command that re-runs *this one Hydra job* in a child process.

    Lightning's default re-runs ``sys.argv``, which under ``-m`` re-runs the whole sweep in
    every child. Here the child gets the current job's own overrides (``overrides.task``),
    no ``-m``, and the job's output directory as its run dir.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hc = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    if hc.job.config_name:
        command += [f"--config-name={hc.job.config_name}"]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line":
            command += [f"--config-dir={source.path}"]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name={hc.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    return command, get_original_cwd()


def runs_a_sweep() -> bool:
    """This process runs a Hydra multirun's jobs one after another: its local rank 0 (the
    other ranks run one job each). Hydra is not imported to ask: a multirun imported it."""
    hydra_config = sys.modules.get("hydra.core.hydra_config")
    if os.environ.get("LOCAL_RANK", "0") != "0" or hydra_config is None:
        return False
    from hydra.types import RunMode

    return hydra_config.HydraConfig.initialized() and hydra_config.HydraConfig.get().mode == RunMode.MULTIRUN


def _hydra_job() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir


@dataclass
class _Early:
    job: str  # the Hydra job's output directory
    num_processes: int
    procs: dict[int, subprocess.Popen | ForkedRank] = field(default_factory=dict)  # local rank -> process
    words: dict[int, int] = field(default_factory=dict)  # local rank -> the write end of its pipe


_early: list[_Early] = []  # at most one: this job's
# A job trains in the process that runs it: once one has, OpenMP's worker threads exist, and a
# child forked then hangs in its first parallel loop (GNU OpenMP does not survive a fork). So
# only a process's first job forks its ranks (a sweep's later jobs start new interpreters).
_ran = {"job": False}


def starts_early(trainer: dict[str, Any], job: str | None = None) -> int:
    """How many local ranks the launcher of Hydra job ``job``, run with these Trainer
    arguments, would start (``devices - 1``) where it is this process that starts them; 0
    where none would be."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2 or nodes != 1:
        return 0
    earlier_job = os.environ.get(JOB_MARK) not in (None, job)
    left_by_earlier_job = LAUNCH_VARS if earlier_job else ()
    if any(var in os.environ for var in _STARTED_ELSEWHERE if var not in left_by_earlier_job):
        return 0
    return devices - 1


def start(trainer: dict[str, Any], job: Callable[[], Any] | None = None, load: Sequence[str] = ()) -> int:
    """In a Hydra job's launching process, with its config checked: start the local ranks its
    launcher would start at ``fit`` now, each to wait for the launcher's word before it joins
    (see the module's docstring). Returns how many were started.

    With ``job`` (what this process goes on to run: the rest of the Hydra job), the modules
    ``load`` names are imported first and each child is forked from here to run ``job`` and
    end, where forking is safe and this is the process's first job; otherwise each child
    re-runs the Hydra job in a new interpreter."""
    release()
    first_job, _ran["job"] = not _ran["job"], True
    hydra_job = _hydra_job()
    count = starts_early(trainer, hydra_job)
    if not count:
        return 0
    fork_job = job if first_job and _forks() else None
    if fork_job is not None:
        for name in load:
            importlib.import_module(name)
        if fork_hazard():
            fork_job = None
    early = _Early(job=hydra_job, num_processes=count + 1)
    _early.append(early)
    _leave_hooks()
    # what a new interpreter started for a child gets, and a forked child takes: the rendezvous
    # only with the word (a child must not use any other)
    env = {**{k: v for k, v in os.environ.items() if k not in _RENDEZVOUS},
           "NODE_RANK": "0", "WORLD_SIZE": str(count + 1), LAUNCHER_PID: str(os.getpid()), JOB_MARK: hydra_job}
    # A Ctrl-C before the launch is this process's to act on (it kills them): they start with
    # SIGINT blocked (the mask is inherited) until the word, so none of them prints a
    # KeyboardInterrupt from the middle of its set-up. Blocked here meanwhile, not ignored:
    # one that comes now is delivered when the mask is restored.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for local_rank in range(1, count + 1):
            read, write = os.pipe()
            child_env = {**env, "LOCAL_RANK": str(local_rank), LAUNCH_FD: str(read)}
            try:
                if fork_job is not None:
                    proc: subprocess.Popen | ForkedRank = _fork(local_rank, child_env, fork_job, write)
                else:
                    command, cwd = hydra_job_command(local_rank)
                    proc = subprocess.Popen(command, cwd=cwd, pass_fds=(read,), env=child_env)
            except BaseException:
                os.close(write)
                raise
            finally:
                os.close(read)
            early.procs[local_rank], early.words[local_rank] = proc, write
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return count


def _forks() -> bool:
    # macOS's system libraries are not fork-safe, Windows has no fork
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def fork_hazard() -> str:
    """Why forking this process now would be unsafe ('' where it is safe): a CUDA driver
    loaded (a forked child could not use the device; torch's own check misses a driver another
    library loaded), or another Python thread running (a lock it held stays held in the child)."""
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} other Python thread(s) running"
    try:
        with open("/proc/self/maps") as maps:
            if any("libcuda.so" in line for line in maps):
                return "a CUDA driver is loaded"
    except OSError as err:
        return f"cannot read /proc/self/maps: {err}"
    return ""


def _fork(local_rank: int, child_env: dict[str, str], job: Callable[[], Any], write: int) -> ForkedRank:
    """Fork local rank ``local_rank``; in the child, become that rank (its environment, as a
    new interpreter would have it) and run ``job`` to the end of the process."""
    _flush()  # else what is buffered is written twice
    pid = os.fork()
    if pid:
        return ForkedRank(pid, local_rank)
    try:
        os.close(write)
        for other in _early[0].words.values():
            os.close(other)  # the earlier children's: each must see its pipe close when rank 0 goes
        _early.clear()
        os.environ.clear()
        os.environ.update(child_env)
        _take_rank(local_rank)
        from .. import process_exit

        process_exit.run_and_exit(job)  # never returns
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)  # (only where becoming the rank failed)


def _take_rank(local_rank: int) -> None:
    # Lightning read this process's rank when it was imported (rank 0's); a new interpreter
    # would have read this one, and printed nothing that only rank 0 prints
    for name in ("lightning_utilities.core.rank_zero", "torchmetrics.utilities.prints"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "rank_zero_only"):
            module.rank_zero_only.rank = local_rank


class ForkedRank:
    """A child rank forked from this process, with the part of :class:`subprocess.Popen`'s
    interface the launcher uses (``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``,
    ``pid``, ``returncode``). Waiting polls: a rank observer's thread polls the same child."""

    POLL_S = 0.02

    def __init__(self, pid: int, local_rank: int) -> None:
        self.pid, self.args = pid, f"<rank {local_rank}, forked>"
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        # Not blocking, as Popen's: a SIGTERM handler passes the signal on through here
        # (send_signal), and it runs in the main thread, which may be inside this very call
        # with the lock held; another thread's poll under way: its answer is not in yet.
        if not self._lock.acquire(blocking=False):
            return self.returncode
        try:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its code is lost, as Popen says
                    self.returncode = 0
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(self.POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def take(num_processes: int) -> dict[int, subprocess.Popen | ForkedRank]:
    """For the launcher about to start ``num_processes - 1`` local ranks of this Hydra job:
    the ones started early for it, still alive and not yet told (to be told with
    :func:`launch`), by local rank; none where they were started for another job or world
    (those are killed)."""
    if not _early:
        return {}
    early = _early[0]
    if early.job != _hydra_job() or early.num_processes != num_processes:
        release()
        return {}
    return {rank: proc for rank, proc in early.procs.items() if rank in early.words}


def launch(local_rank: int, rendezvous: dict[str, str]) -> None:
    """Tell the early child ``local_rank`` to join at ``rendezvous`` (``MASTER_ADDR`` and
    ``MASTER_PORT``); from then on it is the launcher's, as a child it started itself."""
    early = _early[0]
    write = early.words.pop(local_rank)
    try:
        os.write(write, (json.dumps(rendezvous) + "\n").encode())
    except BrokenPipeError:
        pass  # it died before the word: the launcher's observer reports its exit
    finally:
        os.close(write)
    del early.procs[local_rank]
    if not early.words:
        _early.clear()


def release() -> None:
    """Kill the early children nobody launched (the job failed or ended before its launch,
    or its ranks turned out to be started otherwise), and reap them."""
    while _early:
        early = _early.pop()
        for rank, proc in early.procs.items():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            write = early.words.pop(rank, None)
            if write is not None:
                os.close(write)


_hooked = {"done": False}


def _leave_hooks() -> None:
    # the recipe ends through process_exit (no atexit); a script that ends otherwise has atexit
    if _hooked["done"]:
        return
    import atexit

    from .. import process_exit

    _hooked["done"] = True
    process_exit.when_leaving(release)
    atexit.register(release)


# -- in a child started early --------------------------------------------------------------

def _read_word() -> dict[str, str] | None:
    """Block until the launcher's word (``None``: its pipe closed without one)."""
    fd = int(os.environ.pop(LAUNCH_FD))
    with os.fdopen(fd, "rb") as pipe:
        line = pipe.readline()
    if not line.strip():
        return None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a rank of the job from here on
    return json.loads(line)


def await_launch() -> None:
    """In a child started early, at its launch: wait for the launcher's word and take the
    rendezvous it names; leave quietly if the launcher ended without launching. Elsewhere
    (and in a later fit of the same child) nothing to do."""
    if LAUNCH_FD not in os.environ:
        return
    word = _read_word()
    if word is None:
        _leave_quietly()
    os.environ.update({var: str(word[var]) for var in _RENDEZVOUS})


def leave_quietly_unless_launched() -> None:
    """In a child started early that failed before its launch: the launching process runs
    the same job, so it fails the same way and says why. Wait for its word: none (it ended
    without launching) ends this process without a word of its own; a launch means this
    rank alone failed, and the caller goes on to report it."""
    if LAUNCH_FD not in os.environ:
        return
    if _read_word() is None:
        _leave_quietly()


def _leave_quietly() -> None:
    _flush()
    os._exit(0)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
