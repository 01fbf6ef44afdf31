"""Busy time of a rank on real devices: the emulated clock's task boundaries, measured
instead of padded.

:class:`BusyMeter` has the clock interface that :func:`~.hooks.install` drives (``now``,
``pad``, ``transfer_done`` and the modelled durations), but models nothing: every task
keeps its real duration, and the meter only records when it ran. On CUDA the stamps are
CUDA events recorded on the current stream, so a task's span is the device's time, not
the time the host took to launch it; they are resolved once per step (:meth:`take`), one
synchronisation per step. On the CPU the stamps are ``time.perf_counter()``.

A transfer's span runs from the exchange's call to its return, so it includes waiting for
the slowest peer: on real devices that wait is the communication phase as the rank sees it.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

KINDS = ("attention", "head", "experts", "transfer")


class Stopwatch:
    """Time stamps of work on ``device``: CUDA events recorded on the current stream (the
    device's own time, not the host's launch time), ``perf_counter`` on the CPU. Stamps are
    read after one :meth:`sync` on the last of them (stream order: every earlier one is done)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self, last: Any) -> None:
        if self.cuda:
            last.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class BusyMeter:
    """Records the spans of one rank's tasks; :meth:`take` sums them by kind."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._watch = Stopwatch(device)
        self._spans: list[tuple[str, Any, Any]] = []

    def now(self) -> Any:
        return self._watch.now()

    # nothing is modelled: the hooks pad to zero, i.e. not at all
    def attention(self, tokens: float, backward: bool = False) -> float:
        return 0.0

    def head(self, tokens: float, forward_only: bool = False) -> float:
        return 0.0

    def experts(self, counts, backward: bool = False) -> float:
        return 0.0

    def exchange_seconds(self, ranks: Sequence[int], send: Sequence[float], recv: Sequence[float]) -> float:
        return 0.0

    def pad(self, task: str, key: Any, started: Any, modelled: float, *,
            earlier: Sequence[tuple[Any, Any]] = ()) -> float:
        """Record the task's span (``started`` until now) and its ``earlier`` segments."""
        self._spans.append((task, started, self.now()))
        self._spans.extend((task, s, e) for s, e in earlier)
        return 0.0

    def transfer_done(self, key: Any, started: Any, seconds: float) -> None:
        self._spans.append(("transfer", started, self.now()))

    def reset(self) -> None:
        self._spans.clear()

    def elapsed_since(self, start: Any) -> float:
        """Seconds from the stamp ``start`` to now on the same clock as the tasks' spans (CUDA
        events on a GPU: a step timed on the host would set launch time against device time)."""
        end = self.now()
        self._watch.sync(end)
        return self._watch.seconds(start, end)

    def take(self) -> dict[str, float]:
        """Seconds per task kind since the last :meth:`take` or :meth:`reset`; clears."""
        out = {k: 0.0 for k in KINDS}
        if self._spans:
            self._watch.sync(self._spans[-1][2])
        for kind, start, end in self._spans:
            out[kind] += self._watch.seconds(start, end)
        self._spans.clear()
        return out
