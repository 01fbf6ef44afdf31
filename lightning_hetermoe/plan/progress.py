"""What a long plan is doing, said while it runs.

A plan of a few GPUs takes well under a second; one of 1,024 takes up to 10 s and one of
10,000 at a skewed routing up to a minute, silent until it ends. :func:`watched` wraps a
planning call and says, every ``every_s`` seconds while it runs, how long it has run, how
many layouts it has simulated and which part of the search it is in::

    with watched(every_s=10):
        plan = make_plan(cluster, model, seq_len=4096, global_batch_tokens=...)

The search reports through :func:`simulated` (each zebra step it simulates) and
:func:`stage` (where it is); both do nothing unless a watch is on, and a watch only reads
what they wrote, from its own thread, so the search itself is not slowed.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


class _Watch:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.simulated = 0
        self.stage = "starting"


_watch: _Watch | None = None  # the plan being watched: the planner runs on one thread at a time


def simulated(n: int = 1) -> None:
    """``n`` more layouts simulated."""
    if _watch is not None:
        _watch.simulated += n


def stage(what: str) -> None:
    """The search is now at ``what`` (a phrase: "a copy of 256 GPUs", "2 waves")."""
    if _watch is not None:
        _watch.stage = what


def line(w: _Watch) -> str:
    return f"[plan] {time.perf_counter() - w.start:.0f} s: {w.simulated:,} layouts simulated; {w.stage}"


@contextmanager
def watched(every_s: float = 10.0, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Say :func:`line` every ``every_s`` seconds while the block runs (``say``: print, flushed).
    Nested watches: the outer one keeps watching."""
    global _watch
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s <= 0:
        raise ValueError(f"every_s={every_s!r} is invalid: must be a number of seconds > 0")
    if _watch is not None:
        yield
        return
    say = say or (lambda text: print(text, flush=True))
    w, done = _Watch(), threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            say(line(w))

    _watch = w
    ticker = threading.Thread(target=tick, name="plan-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        _watch = None
        done.set()
        ticker.join()
