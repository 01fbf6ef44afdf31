"""Micro-batches as fibers: one thread each, and a baton so that only one runs at a time.

The user's ``training_step`` runs unchanged in a fiber; at every MoE dispatch the fiber
``park()``s and the executor decides what runs next (another micro-batch, a backward
task, hosted experts). To Python and torch this is ordinary sequential execution: exactly
one thread touches the model at any moment, and it never issues a collective (the
executor's own thread issues them all). Thread-local state does not cross threads, so a
fiber sets its own on entry: the rank's CUDA device and compute stream (CUDA keeps both
per thread), then grad mode and autocast (the caller's ``context``).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch

_local = threading.local()


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
        self._resume = threading.Semaphore(0)
        self._parked = threading.Semaphore(0)
        self._abort = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=name or f"hetermoe-mb{mb}")
        self._started = False

    def _run(self) -> None:
        _local.fiber = self
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if self.stream is not None:
                torch.cuda.set_stream(self.stream)
        self._resume.acquire()
        try:
            if self._abort:
                raise FiberAborted()
            with self.context():
                self.result = self.fn()
        except FiberAborted:
            pass
        except BaseException as err:  # handed to the executor, raised there
            self.error = err
        finally:
            self.done = True
            _local.fiber = None
            self._parked.release()

    def resume(self, expect: int | None = None) -> None:
        """Run the fiber until it parks (at MoE layer ``expect``) or finishes (``None``);
        its exception is raised here."""
        self.expect = expect
        if self.done:
            raise RuntimeError(f"micro-batch {self.mb} has already finished")
        if not self._started:
            self._started = True
            self._thread.start()
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
        """Unwind a parked (or unstarted) fiber so its thread ends."""
        if self.done:
            return
        self._abort = True
        if not self._started:
            self._started = True
            self._thread.start()
        self._resume.release()
        self._parked.acquire()
