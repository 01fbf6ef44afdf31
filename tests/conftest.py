"""Fixtures shared by the test modules. Plain helpers live beside them: the naive
reference and its builders in ``reference.py``, real multi-process runs in ``harness.py``,
the rest in ``helpers_*.py``; no test module imports another."""

from __future__ import annotations

import pytest

from helpers_clock import VirtualClock


@pytest.fixture
def virtual_clock(monkeypatch):
    """``virtual_clock(module, ...)``: a :class:`VirtualClock` standing in for those
    modules' ``time`` for the test's duration."""

    def install(*modules) -> VirtualClock:
        clock = VirtualClock()
        for module in modules:
            monkeypatch.setattr(module, "time", clock)
        return clock

    return install
