"""Micro-batches as fibers: one thread each, and a baton so that only one runs at a time.

The user's ``training_step`` runs unchanged in a fiber; at every MoE dispatch the fiber
``park()``s and the executor decides what runs next (another micro-batch, a backward
task, hosted experts). To Python and torch this is ordinary sequential execution: exactly
one thread touches the model at any moment, and it never issues a collective (the
executor's own thread issues them all). Thread-local state does not cross threads, so a
fiber sets its own on entry: the rank's CUDA device and compute stream (CUDA keeps both
per thread), then grad mode and autocast (the caller's ``context``).

The threads are kept from step to step (a pool of idle workers, one per micro-batch in
flight at most): CUDA libraries keep per-thread state that a new thread builds again.
cuDNN's attention keeps its execution plans per thread; on an H200 a fresh thread per
micro-batch and step rebuilt them, ~45 ms a micro-batch, a quarter of a zebra step.

A worker runs with one intra-op CPU thread (``INTRAOP_THREADS``). Under OpenMP every thread
that enters a parallel region leads a team of its own, so a rank with n intra-op threads
and R micro-batches kept R + 1 teams whose members slept and woke as the baton passed: on
a 2-core CPU, one zebra rank at 2 threads stepped in 95 ms (R = 1) and 151 ms (R = 2) with
the workers at the rank's count, 62 and 114 ms at one (``bench/fiber_threads.py``: 1.52x,
1.32x); with more work per op the two even out (d_model 128 and 2,048 tokens a step 1.06x,
d_model 512 0.99x). The executor's own thread keeps the rank's count for the experts it
runs. On a GPU a worker's CPU work is launches.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch

_local = threading.local()


def _baton() -> threading.Lock:
    """A hand-off signal held closed: ``release`` opens it for one ``acquire``. A plain lock,
    not a ``threading.Semaphore``, whose every call runs a ``Condition`` in Python: a
    round trip between two threads on one core took 19-20 us through semaphores, 11-12
    through locks. The hand-offs strictly alternate, so a lock is never released twice."""
    lock = threading.Lock()
    lock.acquire()
    return lock
_idle: list["_Worker"] = []  # workers between fibers, reused last-in first-out
_idle_lock = threading.Lock()

INTRAOP_THREADS: int | None = 1  # a worker's intra-op CPU threads; None: the rank's own count


class _Worker:
    """A daemon thread that runs fibers one after another."""

    def __init__(self) -> None:
        self._job: Fiber | None = None
        self._wake = _baton()
        threads = _intraop_threads()
        ready = _baton()
        self.thread = threading.Thread(target=self._loop, args=(threads, ready), daemon=True, name="hetermoe-fiber")
        self.thread.start()
        ready.acquire()
        if threads is not None:
            # torch.set_num_threads also sets the count a thread started later begins with:
            # the worker's call lowered it for the whole process; this puts the rank's back
            torch.set_num_threads(torch.get_num_threads())

    def give(self, fiber: "Fiber | None") -> None:
        """Run ``fiber`` next (``None``: end the thread)."""
        self._job = fiber
        self._wake.release()

    def _loop(self, threads: int | None, ready: threading.Lock) -> None:
        if threads is not None:
            torch.get_num_threads()  # torch's first-use set-up of this thread, which would undo the next call
            torch.set_num_threads(threads)
        ready.release()
        while True:
            self._wake.acquire()
            fiber, self._job = self._job, None
            if fiber is None:
                return
            fiber._run(self)


def _intraop_threads() -> int | None:
    """What a new worker sets its intra-op threads to, or ``None`` to leave them as they are
    (also where ATen's parallel backend is not OpenMP: its native pool is one per process)."""
    if INTRAOP_THREADS is None or INTRAOP_THREADS == torch.get_num_threads():
        return None
    return INTRAOP_THREADS if _openmp_backend() else None


@functools.cache
def _openmp_backend() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _take_worker() -> _Worker:
    with _idle_lock:
        if _idle:
            return _idle.pop()
    return _Worker()


def _return_worker(worker: _Worker) -> None:
    with _idle_lock:
        _idle.append(worker)


def stop_workers(join_s: float = 5.0) -> None:
    """End the idle workers' threads (at interpreter exit; a later fiber starts a new one)."""
    with _idle_lock:
        workers = list(_idle)
        _idle.clear()
    for w in workers:
        w.give(None)
    for w in workers:
        if w.thread is not threading.current_thread():
            w.thread.join(join_s)


def _forget_workers_in_child() -> None:
    # a forked child has none of its parent's threads: its workers are new ones
    global _idle_lock
    _idle.clear()
    _idle_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_workers_in_child)


class FiberAborted(BaseException):
    """Raised inside a parked fiber when the step is abandoned (another task failed)."""


def current() -> "Fiber | None":
    """The fiber running on this thread, if any (hooks use it to know their micro-batch)."""
    return getattr(_local, "fiber", None)


class Fiber:
    def __init__(self, fn: Callable[[], Any], *, mb: int, context: Callable[[], AbstractContextManager] | None = None,
                 owner: Any = None, device: torch.device | None = None, stream: Any = None, name: str = "") -> None:
        self.fn, self.mb = fn, mb
        self.owner = owner  # the step run this micro-batch belongs to (the model's hooks call it)
        self.device, self.stream = device, stream
        self.expect: int | None = None  # the MoE layer the schedule lets this fiber reach next
        self.context = context or nullcontext
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._resume = _baton()
        self._parked = _baton()
        self._abort = False
        self.name = name or f"hetermoe-mb{mb}"
        self._started = False

    def _run(self, worker: _Worker) -> None:
        _local.fiber = self
        threading.current_thread().name = self.name
        self._resume.acquire()
        try:
            if self._abort:
                raise FiberAborted()
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                if self.stream is not None:
                    torch.cuda.set_stream(self.stream)
            with self.context():
                self.result = self.fn()
        except FiberAborted:
            pass
        except BaseException as err:  # handed to the executor, raised there
            self.error = err
        finally:
            self.done = True
            _local.fiber = None
            _return_worker(worker)  # before the baton: the next fiber may take this thread
            self._parked.release()

    def resume(self, expect: int | None = None) -> None:
        """Run the fiber until it parks (at MoE layer ``expect``) or finishes (``None``);
        its exception is raised here."""
        self.expect = expect
        if self.done:
            raise RuntimeError(f"micro-batch {self.mb} has already finished")
        if not self._started:
            self._started = True
            _take_worker().give(self)
        self._resume.release()
        self._parked.acquire()
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def park(self) -> None:
        """Inside the fiber: hand the baton back and wait to be resumed."""
        self._parked.release()
        self._resume.acquire()
        if self._abort:
            raise FiberAborted()

    def abort(self) -> None:
        """Unwind a parked (or unstarted) fiber, so that its thread is free again."""
        if self.done:
            return
        if not self._started:  # never ran: nothing to unwind
            self._started = self.done = True
            return
        self._abort = True
        self._resume.release()
        self._parked.acquire()
