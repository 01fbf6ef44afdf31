"""Silent ranks, detected without the communication backend.

On NCCL a peer that stops answering (a frozen or stopped process, a hung host) leaves the
others blocked until the process-group timeout, 30 minutes by default; gloo notices only a
closed connection. So every rank runs a small thread that bumps its own counter in the
job's key-value store (the TCPStore the process group started from: Lightning's rank 0 or
torchrun's agent) every ``timeout / 6`` seconds and reads some others': rank 0 every rank's,
every other rank rank 0's and the next one's (:meth:`Heartbeat.watched`), so the store
serves a number of keys in the world's size, not its square. A rank whose counter has not
moved for ``timeout`` seconds is silent: the first rank to see it prints which rank, its
role and device, and ends the job (under the pack's launcher the launching
rank kills the others, the stopped one included; under torchrun every rank exits and the
agent tears the job down). If the store itself stops answering, its host (rank 0 under
Lightning's launcher) is the silent one.

A counter only says the process is alive (a stopped process, or one whose interpreter
never lets the thread run, is silent). A rank alive but stuck inside a step is the
progress watchdog's (:mod:`.progress`): its state travels beside the beat, rank 0 reads
every rank's, and a step far longer than any before ends the job the same way, naming the
rank. A rank that finished marks itself done first, so a job whose ranks end at different
times is not mistaken for a failure; a rank that sees the store's host finish and the store then go quiet ends its
watch quietly.

The thread is stopped *and joined* before the process group goes and before the interpreter
exits (:func:`stop`, which the strategy's ``shutdown`` calls and an ``atexit`` hook calls
for scripts that never do). Left running, CPython's finalization ends a daemon thread that
wakes inside a store call with ``pthread_exit``; its forced unwind through the C++ frame of
the call (a noexcept destructor releasing the GIL) calls ``std::terminate``: "terminate
called without an active exception", SIGABRT, about one exit in sixty.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from .progress import Seen, StepProgress, stuck_report

SILENT_PEER_EXIT = 75  # a rank that ends the job because a peer went silent exits with this code
_DONE = -1
JOIN_S = 2.0  # how long stop() waits for the thread to leave a store call in flight
WATCHED = 1  # the next ranks round the ring each rank watches beside rank 0 (rank 0: every rank)


class Heartbeat:
    def __init__(self, rank: int, world_size: int, timeout_s: float, describe: Callable[[int], str],
                 host: str, port: int, on_silent: Callable[[], None] | None = None,
                 period_s: float | None = None) -> None:
        if period_s is not None and not 0 < period_s < timeout_s:
            raise ValueError(f"heartbeat period_s={period_s!r} is invalid: must be > 0 and under heartbeat_timeout_s="
                             f"{timeout_s!r} (a beat at least once per timeout)")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.host, self.port = host, port
        self.describe, self.on_silent = describe, on_silent or _exit_job
        # six beats to a timeout, so one late beat (a loaded host) is never a silence
        self.period_s = max(self.timeout_s / 6, 0.05) if period_s is None else float(period_s)
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeout_s),
                                    wait_for_workers=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetermoe-heartbeat")
        self.progress: StepProgress | None = None  # this rank's steps, once the strategy marks them
        self.reported: tuple[int, str] | None = None  # the rank this beat named, and what it said of it

    def _key(self, rank: int) -> str:
        return f"hetermoe/heartbeat/{rank}"

    def start(self) -> "Heartbeat":
        self._store.set(self._key(self.rank) + "/process", f"{socket.gethostname()}:{os.getpid()}")
        self._store.set(self._key(self.rank) + "/progress", "")
        self._store.set(self._key(self.rank), "0")
        self._thread.start()
        return self

    def done(self, join_s: float = JOIN_S, finished: bool = True) -> None:
        """Stop watching and wait (at most ``join_s``) for the thread to end, so that no store
        call is in flight when the process group or the interpreter goes. ``finished``: this
        rank finished its job and says so (peers stop expecting beats); a rank that failed
        does not, so that peers blocked on it see it fall silent."""
        self._stop.set()
        if finished:
            try:
                self._store.set(self._key(self.rank), str(_DONE))
            except Exception:
                pass  # the store's host already left: nobody is watching any more
        self.join(join_s)

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end; True when it has (or never started)."""
        thread = self._thread
        if thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        return not thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def peers_done(self) -> bool:
        """Every other rank has marked itself done (or the store no longer answers)."""
        others = [self._key(r) for r in range(self.world_size) if r != self.rank]
        try:
            if not self._store.check(others):
                return False  # a peer never started beating (a get would wait for it)
            return all(int(v) == _DONE for v in self._store.multi_get(others))
        except Exception:
            return True

    def watched(self) -> list[int]:
        """The ranks whose beats this rank reads: rank 0 reads every other one; the others
        read rank 0's first (the store's host under Lightning's launcher: has it finished?
        ``_run`` reads it at index 0) and their :data:`WATCHED` next ranks round the ring of
        ranks 1 to ``world - 1``, so that every rank is watched by rank 0 and by the one
        before it on that ring. Before, every
        rank read every rank's beat and progress: ``3 x world`` keys a rank a beat, three
        times ``world^2`` at the store, 300 million keys every 5 s on 10,000 ranks at the
        default timeout."""
        if self.rank == 0:
            return list(range(1, self.world_size))
        # the ring of ranks 1..world-1: rank 1 is watched by the last rank, not only by rank 0
        others = self.world_size - 1
        ring = [1 + (self.rank - 1 + i) % others for i in range(1, min(WATCHED, others - 1) + 1)]
        return [0] + ring

    def _run(self) -> None:
        beats = 0
        last: dict[int, tuple[int, float]] = {}
        others = self.watched()
        keys = [self._key(r) for r in others]
        host_done = False  # rank 0 (the store's host under Lightning's launcher) said it finished
        while not self._stop.wait(self.period_s):
            beats += 1
            try:
                self._store.set(self._key(self.rank), str(beats))
                seen = [int(v) for v in self._store.multi_get(keys)]
            except Exception:
                if self._stop.is_set() or host_done:
                    return  # the job is ending: its host finished and took the store with it
                self._report_store()
                return
            now = time.monotonic()
            host_done = host_done or (self.rank != 0 and seen[0] == _DONE)
            for r, count in zip(others, seen):
                if count == _DONE:
                    continue
                before = last.get(r)
                if before is None or before[0] != count:
                    last[r] = (count, now)
                elif now - before[1] > self.timeout_s:
                    self._report(r, f"no heartbeat for {now - before[1]:.0f} s")
                    return
            if self._check_progress(others, seen):
                return

    def _check_progress(self, others: list[int], beats: list[int]) -> bool:
        """Publish this rank's progress; on rank 0, read everyone's. True when a stuck rank
        ended the job. Rank 0 alone judges (its thread runs beside a step stuck on rank 0
        too, and names it): one reader keeps the store's load in the world's size."""
        progress = self.progress
        if progress is None:
            return False
        try:
            self._store.set(self._key(self.rank) + "/progress", progress.snapshot())
            if self.rank != 0:
                return False
            keys = [self._key(r) + "/progress" for r in range(self.world_size)]
            if not self._store.check(keys):
                return False  # a peer has not started its heartbeat yet (a get would wait for it)
            texts = self._store.multi_get(keys)
        except Exception:
            return False  # the store's silence is the beat's to report
        bound = progress.bound_s()
        if bound is None:
            return False
        done = {r for r, count in zip(others, beats) if count == _DONE}
        seen = [x for r, t in enumerate(texts) if r not in done
                for x in [Seen.parse(r, t.decode() if isinstance(t, bytes) else str(t))] if x is not None]
        found = stuck_report(seen, bound, self.describe, complete=len(seen) == self.world_size - len(done))
        if found is None:
            return False
        rank, report = found
        self._report(rank, report, kind="stuck")
        return True

    def _report(self, rank: int, why: str, kind: str = "silent") -> None:
        if self._stop.is_set():
            return
        try:
            who = self.describe(rank)
        except Exception:
            who = "?"
        # kept before the kill below: the launcher's rank observer then finds the rank's exit
        # already said, and a sweep's job takes it as its reason (launchers.report_dead); the
        # first line (a stuck rank's report goes on with every rank's state, printed here)
        self.reported = (rank, f"rank {rank} ({who}) is {kind}: {why.splitlines()[0]}")
        setting = (f"heartbeat_timeout_s={self.timeout_s:g}" if kind == "silent" else
                   f"progress_timeout_s={self.progress.floor_s:g} until {self.progress.warmup_steps} steps are "
                   f"measured, then {self.progress.factor:g}x their median, at least "
                   f"{self.progress.measured_floor_s:g} s")
        self._say(f"rank {rank} ({who}) is {kind}: {why}", setting)
        self._kill_if_local(rank)
        self.on_silent()

    def _say(self, what: str, setting: str) -> None:
        sys.stderr.write(f"[hetermoe] {what}\n({setting}); rank {self.rank} ends the job\n")
        sys.stderr.flush()

    def _report_store(self) -> None:
        """The store stopped answering. Under Lightning's launcher rank 0 hosts it, so rank 0
        is the silent one; under torchrun its agent does (TORCHELASTIC_USE_AGENT_STORE), a
        process that is no rank: naming rank 0 there sent a user to the wrong process."""
        why = f"did not answer for {self.timeout_s:.0f} s"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            self._report(0, f"the job's store (hosted by rank 0) {why}")
            return
        if self._stop.is_set():
            return
        self._say(f"the job's store (torchrun's agent at {self.host}:{self.port}) is silent: it {why}",
                  f"heartbeat_timeout_s={self.timeout_s:g}")
        self.on_silent()

    def _kill_if_local(self, rank: int) -> None:
        """A silent rank on this host is killed here (a stopped process ignores everything
        but SIGKILL), so that no launcher has to wait out its grace period for it."""
        try:
            host, pid = self._store.get(self._key(rank) + "/process").decode().rsplit(":", 1)
            if host == socket.gethostname() and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)
        except Exception:
            pass  # another host, or the store is the silent one: the launcher ends it


def _exit_job() -> None:
    """End this process now: a collective may be waiting on the silent peer forever."""
    os._exit(SILENT_PEER_EXIT)


_current: Heartbeat | None = None
_at_exit_registered = False


def ensure(rank: int, world_size: int, timeout_s: float | None, describe: Callable[[int], str],
           on_silent: Callable[[], None] | None = None, progress: StepProgress | None = None,
           period_s: float | None = None) -> Heartbeat | None:
    """Start this process's heartbeat for the running job (once; a new job replaces it).
    ``on_silent`` ends the job (default: this process exits; a launcher also kills what it started);
    ``progress``: this rank's steps, for the progress watchdog (None: no watchdog);
    ``period_s``: seconds between beats (default a sixth of the timeout)."""
    global _current
    if not timeout_s or world_size < 2:
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host is None or port is None:
        return None  # no store to beat into (a process group made some other way)
    if _current is None or (_current.host, _current.port) != (host, int(port)):
        stop()
        _register_at_exit()
        _current = Heartbeat(rank, world_size, timeout_s, describe, host, int(port), on_silent, period_s).start()
    _current.progress = progress
    return _current


def stop(join_s: float = JOIN_S, finished: bool = True) -> None:
    """This rank is done with its job: the thread is stopped and joined (at most ``join_s``);
    ``finished=False``: it failed, and does not tell its peers it finished."""
    global _current
    current, _current = _current, None
    if current is not None:
        current.done(join_s, finished)


def reported() -> tuple[int, str] | None:
    """The rank this process's heartbeat named silent or stuck in the running job, and the
    words it said of it (``None``: none)."""
    return None if _current is None else _current.reported


def running() -> bool:
    """A heartbeat thread of this process is alive."""
    return _current is not None and _current.running


HOST_WAIT_S = 5.0  # how long the store's host waits at exit for its peers to say they finished


def leave(failed: bool = False) -> None:
    """The process ends: stop and join the thread. A rank that finished says so, and rank 0
    (the store's host under Lightning's launcher) first waits, at most ``HOST_WAIT_S``, for
    its peers to say so too, so that no peer's beat finds the store gone and calls it silent."""
    current = _current
    if current is None:
        return
    if current.rank == 0 and not failed:
        deadline = time.monotonic() + HOST_WAIT_S
        while time.monotonic() < deadline and not current.peers_done():
            time.sleep(0.05)
    stop(finished=not failed)


def _register_at_exit() -> None:
    """A script that never calls the strategy's ``shutdown`` still stops and joins the thread:
    atexit hooks run before finalization ends daemon threads."""
    global _at_exit_registered
    if not _at_exit_registered:
        _at_exit_registered = True
        atexit.register(lambda: leave(failed=exiting_on_error()))


_failed = {"seen": False}


def mark_failed() -> None:
    """A run of this process failed (the strategy's ``on_exception``): at exit it does not
    tell its peers it finished, nor wait for them."""
    _failed["seen"] = True


def exiting_on_error() -> bool:
    """At exit: a run failed, or the interpreter is ending on an uncaught exception (it sets
    ``sys.last_value`` when it prints one; ``SystemExit`` and ``os._exit`` do not)."""
    return _failed["seen"] or getattr(sys, "last_value", None) is not None
