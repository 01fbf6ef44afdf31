"""The stuck-rank watchdog's reasoning, on published progress (the end-to-end runs, one per
mode with a rank asleep inside a step, are in test_failures.py)."""

from __future__ import annotations

import pytest

from lightning_hetermoe.strategy import progress
from lightning_hetermoe.strategy.progress import Seen, StepProgress, stuck_report


def describe(rank: int) -> str:
    return f"rank{rank}"


def test_the_rank_computing_past_the_bound_is_named_not_the_ones_waiting_for_it():
    seen = [Seen(0, 7, 40.0, 12, "zebra.answers"), Seen(1, 7, 40.0, 15, ""), Seen(2, 7, 39.0, 12, "zebra.rows")]
    rank, report = stuck_report(seen, 30.0, describe)
    assert rank == 1 and "not inside a collective while its peers wait" in report
    assert "rank 0 (rank0): in step 7 for 40 s, 12 collectives issued in it, waiting in zebra.answers" in report


def test_when_every_rank_waits_the_one_behind_is_named_once_all_have_published():
    seen = [Seen(0, 7, 40.0, 12, "zebra.answers"), Seen(1, 7, 40.0, 9, "zebra.rows")]
    assert stuck_report(seen, 30.0, describe, complete=False) is None  # a peer may not have published yet
    rank, report = stuck_report(seen, 30.0, describe)
    assert rank == 1 and "issued the fewest (9)" in report


def test_nothing_is_reported_inside_the_bound_or_outside_a_step():
    seen = [Seen(0, 7, 29.0, 12, ""), Seen(1, 7, -1.0, 0, "")]
    assert stuck_report(seen, 30.0, describe) is None
    assert Seen.parse(0, "") is None and Seen.parse(3, "5|1.5|2|ep.rows") == Seen(3, 5, 1.5, 2, "ep.rows")


def test_the_bound_arms_after_the_warmup_steps_from_the_slowest_measured_one(virtual_clock):
    clock = virtual_clock(progress)
    p = StepProgress(floor_s=0.05, factor=10.0, warmup_steps=2)
    p.started(0)
    clock.advance(0.03)
    p.finished()  # the first step (compilation, autotuning) is not measured
    assert p.bound_s() is None and p.slowest_s == 0.0
    p.started(1)
    clock.advance(0.02)
    p.finished()
    assert p.slowest_s == pytest.approx(0.02) and p.bound_s() == max(0.05, 10 * p.slowest_s)
    p.started(2)
    clock.advance(0.25)
    assert p.snapshot().split("|")[1] == "0.250"
    p.pause()  # validation or a checkpoint: outside a step
    assert p.snapshot().split("|")[1] == "-1.000"
