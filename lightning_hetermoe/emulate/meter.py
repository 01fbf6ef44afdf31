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


_TIMING_STREAMS: dict[Any, Any] = {}  # device -> the stream that only waits for collectives and stamps


class Stopwatch:
    """Time stamps of work on ``device``: CUDA events recorded on the current stream (the
    device's own time, not the host's launch time), ``perf_counter`` on the CPU. Stamps are
    read after one :meth:`sync` on the last of them (stream order: every earlier one is done).

    :meth:`completion` stamps when an asynchronous collective's work completes: on CUDA an
    event on a timing stream of its own, which waits for the work (no stream that carries
    work waits on it, so nothing is serialised); :meth:`settle` orders the current stream
    after it, so a stamp taken after ``settle`` comes after every completion. On the CPU
    the host clock in the work's completion callback (gloo's thread)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timing_stream(self) -> Any:
        if self.device not in _TIMING_STREAMS:
            _TIMING_STREAMS[self.device] = torch.cuda.Stream(device=self.device)
        return _TIMING_STREAMS[self.device]

    def completion(self, work: Any) -> Any:
        """A stamp of when ``work`` (a collective's handle, or ``None``: done already) completes."""
        if work is None:
            return self.now()
        if self.cuda:
            with torch.cuda.stream(self._timing_stream()):
                work.wait()  # orders the timing stream after the work: no host wait
                return self.now()
        future = getattr(work, "get_future", None)
        if future is None:
            return self.now()
        return _Completion(future())

    def settle(self) -> None:
        """Order the current stream after every completion stamped so far (CUDA; no host wait)."""
        if self.cuda and self.device in _TIMING_STREAMS:
            torch.cuda.current_stream(self.device).wait_stream(_TIMING_STREAMS[self.device])

    def sync(self, last: Any) -> None:
        if self.cuda:
            last.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return _host(end) - _host(start)


class _Completion:
    """A collective's completion on the host clock: stamped by a callback in the thread that
    completes it (gloo's), read once that callback ran."""

    def __init__(self, future: Any) -> None:
        self.at: list[float] = []
        self._after = future.then(lambda _: self.at.append(time.perf_counter()))

    def seconds(self) -> float:
        self._after.wait()  # the callback ran (the work itself was waited before the step was read)
        return self.at[0]


def _host(stamp: Any) -> float:
    return stamp.seconds() if isinstance(stamp, _Completion) else stamp


class StepStamps:
    """One step's raw stamps, from its ``origin``: ``tasks`` and ``transfers`` as ``(key,
    start, end)``, ``last`` after all of them. Read on demand, once: one sync on ``last``,
    free where the step's own host sync already passed it (the monitor that asks reads its
    counts first), and none at all where nobody asks."""

    def __init__(self, watch: Stopwatch, origin: Any, tasks: list, transfers: list, last: Any) -> None:
        self.watch, self.origin, self.last = watch, origin, last
        self._raw: tuple[list, list] | None = (tasks, transfers)
        self._read: tuple[list, list] = ([], [])

    def read(self) -> tuple[list[tuple[Any, float, float]], list[tuple[Any, float, float]]]:
        """``(tasks, transfers)`` in seconds from the origin."""
        if self._raw is not None:
            self.watch.sync(self.last)
            w, o = self.watch, self.origin
            self._read = tuple([(k, w.seconds(o, a), w.seconds(o, b)) for k, a, b in spans]  # type: ignore[assignment]
                               for spans in self._raw)
            self._raw = None
        return self._read


def uncovered(spans: Sequence[tuple[float, float]], covered: Sequence[tuple[float, float]]) -> float:
    """Seconds inside the union of ``spans`` and outside the union of ``covered``: the
    exchange a rank waited on, where nothing else ran (``spans`` the transfers in flight,
    ``covered`` its tasks)."""
    return _length(_union(spans)) - _overlap(_union(spans), _union(covered))


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


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

    def needs_matrix(self, ranks: Sequence[int]) -> bool:
        return False  # a real device's exchange is timed, not modelled

    def exchange_seconds(self, ranks: Sequence[int], send: Sequence[float], recv: Sequence[float],
                         rows: Sequence[Sequence[float]] | None = None) -> float:
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
