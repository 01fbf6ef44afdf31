"""A rank alive but stuck inside a step: what the heartbeat cannot see.

The heartbeat (:mod:`.heartbeat`) proves a process lives; a rank whose main thread is
blocked (a device collective that never completes, a hung GPU, a deadlock in user code)
still beats. So each rank also says how far it is: the main thread marks each training
step's start and end here, comm counts the collectives it issues and says which one it
is blocked in, and the heartbeat thread publishes all of it beside the beat and reads
everyone's. A rank that has been inside one step for longer than the bound is stuck.

The bound follows what the steps have shown. The first step compiles (and, on request,
autotunes): it is not bounded and not measured. Until ``warmup_steps`` further steps are
measured, nothing is known of the job's pace, so the bound is the user's
``progress_timeout_s`` (300 s by default: a cold GPU, a first checkpoint). From then on it
is ``max(measured floor, factor x the median measured step)``: a job's steps take what
they take, and only one far slower than the usual means trouble; the measured floor (60 s,
or ``progress_timeout_s`` if that is lower) keeps a fast job's jitter, a garbage collection
or the allocator returning memory from ending it. So a rank stuck in a 0.2 s-step job is
named in about a minute, not five. Only training steps count: validation, testing,
prediction, checkpoint saves and the rebalancer's moves (at step boundaries) pause it.

When every rank is past the bound, most are waiting for the one that is behind: the report
names the ranks that are not inside a collective (computing, sleeping, blocked on the
device) and, where all of them wait in collectives, the one that issued the fewest this
step (the others are waiting for its next one).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

import lightning_hetermoe.comm as comm

FACTOR = 10.0
WARMUP_STEPS = 5  # measured steps (after the first) before the bound follows them
MEASURED_FLOOR_S = 60.0
WINDOW = 256  # the median is over this many latest steps: a job's pace may drift


class StepProgress:
    """This rank's training steps, marked by the main thread and read by the heartbeat's."""

    def __init__(self, floor_s: float, factor: float = FACTOR, warmup_steps: int = WARMUP_STEPS,
                 measured_floor_s: float = MEASURED_FLOOR_S) -> None:
        self.floor_s, self.factor, self.warmup_steps = float(floor_s), float(factor), int(warmup_steps)
        self.measured_floor_s = min(float(measured_floor_s), self.floor_s)
        self.step = -1
        self.finished_steps = 0
        self.measured: deque[float] = deque(maxlen=WINDOW)
        self._since: float | None = None  # inside a step since (monotonic), or None
        self._issued_at_start = 0

    def started(self, step: int) -> None:
        """A training step (or an accumulation's next batch) begins."""
        self.step = int(step)
        self._since = time.monotonic()
        self._issued_at_start = comm.activity()[0]

    def finished(self) -> None:
        """The optimizer stepped: the step is over."""
        if self._since is not None:
            if self.finished_steps:  # the first step compiles: not a measure of the rest
                self.measured.append(time.monotonic() - self._since)
            self.finished_steps += 1
        self._since = None

    def pause(self) -> None:
        """Validation, testing, prediction or a checkpoint: not a training step's time."""
        self._since = None

    def bound_s(self) -> float | None:
        """How long a step may take before this rank calls it stuck (None: not armed, the
        first step); see the module for the rule."""
        if self.finished_steps < 1:
            return None
        if len(self.measured) < self.warmup_steps:
            return self.floor_s
        return max(self.measured_floor_s, self.factor * statistics.median(self.measured))

    def snapshot(self) -> str:
        """What the heartbeat publishes: step, seconds inside it (-1: outside a step),
        collectives issued in it, the one it is blocked in."""
        issued, waiting = comm.activity()
        since = self._since
        elapsed = time.monotonic() - since if since is not None else -1.0
        return f"{self.step}|{elapsed:.3f}|{issued - self._issued_at_start}|{waiting or ''}"


@dataclass
class Seen:
    """One rank's published progress."""

    rank: int
    step: int
    elapsed_s: float
    issued: int
    waiting: str

    @classmethod
    def parse(cls, rank: int, text: str) -> "Seen | None":
        try:
            step, elapsed, issued, waiting = text.split("|", 3)
            return cls(rank, int(step), float(elapsed), int(issued), waiting)
        except ValueError:
            return None  # not published yet


def stuck_report(seen: list[Seen], bound_s: float, describe, complete: bool = True) -> tuple[int, str] | None:
    """The rank to name and the report, when some rank is past ``bound_s`` in a step.
    ``complete``: every live rank's progress is in ``seen``; until it is, a rank that only
    waits is not blamed (the one it waits for may not have published yet)."""
    over = [s for s in seen if s.elapsed_s > bound_s]
    if not over:
        return None
    # A rank inside a step but not inside a collective holds up the ones waiting past the
    # bound, even if its own clock in the step is shorter: on a loaded host it may have
    # entered the step seconds after them (the one asleep in its experts, found late).
    computing = sorted((s for s in seen if s.elapsed_s >= 0 and not s.waiting),
                       key=lambda s: (s.elapsed_s <= bound_s, s.issued, s.rank))
    if not computing and not complete:
        return None
    culprit = computing[0] if computing else min(over, key=lambda s: (s.issued, s.rank))
    lines = []
    for s in sorted(seen, key=lambda s: s.rank):
        if s.elapsed_s < 0:
            where = "outside a training step"
        else:
            where = (f"in step {s.step} for {s.elapsed_s:.0f} s, {s.issued} collectives issued in it, "
                     + (f"waiting in {s.waiting}" if s.waiting else "not inside a collective"))
        lines.append(f"  rank {s.rank} ({_who(describe, s.rank)}): {where}")
    why = ("not inside a collective while its peers wait" if not culprit.waiting else
           f"every rank past the bound waits in a collective; it issued the fewest ({culprit.issued}), so its peers "
           f"wait for its next one")
    past = (f"past the bound of {bound_s:.0f} s" if culprit.elapsed_s > bound_s else
            f"while rank {', '.join(str(s.rank) for s in over)} waited past the bound of {bound_s:.0f} s")
    return culprit.rank, (f"in step {culprit.step} for {culprit.elapsed_s:.0f} s, {past} ({why})\n"
                          + "\n".join(lines))


def _who(describe, rank: int) -> str:
    try:
        return describe(rank)
    except Exception:
        return "?"
