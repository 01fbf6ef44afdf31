"""A virtual clock for tests that check what code decides about time (how long to pad, what
to count as a step), not how long a loaded machine took to do it."""

from __future__ import annotations


class VirtualClock:
    """Stands in for the ``time`` module inside the modules under test: nothing takes time
    but what they sleep, or what the test lets pass (:meth:`advance`)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")  # as time.sleep
        self.now += seconds

    advance = sleep

    def install(self, *modules) -> None:
        """Every module's ``time`` is this clock from now on (in a process of its own)."""
        for module in modules:
            module.time = self
