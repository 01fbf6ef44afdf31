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


def test_the_bound_is_the_users_until_steps_are_measured_then_follows_their_median(virtual_clock):
    """The first step compiles: unbounded. Then ``progress_timeout_s`` until ``warmup_steps``
    steps are measured; then max(60 s, 10x the median step): a 0.2 s-step job names a stuck
    rank after a minute, not after the 300 s floor."""
    clock = virtual_clock(progress)
    p = StepProgress(floor_s=300.0, factor=10.0, warmup_steps=3)

    def step(n: int, seconds: float) -> None:
        p.started(n)
        clock.advance(seconds)
        p.finished()

    step(0, 40.0)  # the first step (compilation) is not measured
    assert p.bound_s() == 300.0 and list(p.measured) == []
    step(1, 0.2)
    step(2, 0.3)
    assert p.bound_s() == 300.0  # two measured steps of three: the user's bound still
    step(3, 9.0)  # one slow step (a checkpoint's first write, say) moves the median little
    assert p.bound_s() == max(60.0, 10 * 0.3) == 60.0
    for n in range(4, 40):
        step(n, 8.0)  # the job's pace changed: the median follows
    assert p.bound_s() == pytest.approx(80.0)
    # a user's bound below the measured floor stays the floor (tests, short jobs)
    q = StepProgress(floor_s=3.0, warmup_steps=1)
    q.started(0)
    q.finished()
    q.started(1)
    clock.advance(0.01)
    q.finished()
    assert q.measured_floor_s == 3.0 and q.bound_s() == 3.0


def test_a_step_outside_training_does_not_count(virtual_clock):
    clock = virtual_clock(progress)
    p = StepProgress(floor_s=0.05, factor=10.0, warmup_steps=2)
    p.started(2)
    clock.advance(0.25)
    assert p.snapshot().split("|")[1] == "0.250"
    p.pause()  # validation or a checkpoint: outside a step
    assert p.snapshot().split("|")[1] == "-1.000"


def test_a_rank_computing_inside_the_bound_is_named_when_its_peer_waits_past_it():
    """On a loaded host the rank asleep in its experts may enter the step seconds after its
    peer: the peer, waiting in a collective, passes the bound first; the sleeper is named."""
    seen = [Seen(0, 8, 8.0, 12, "zebra.answers"), Seen(1, 8, 3.0, 16, "")]
    rank, report = stuck_report(seen, 3.0, describe)
    assert rank == 1 and "not inside a collective while its peers wait" in report
    assert "in step 8 for 3 s, while rank 0 waited past the bound of 3 s" in report
    # a rank outside any step is no culprit: the waiting one is named
    rank, _ = stuck_report([Seen(0, 8, 8.0, 12, "zebra.answers"), Seen(1, 8, -1.0, 0, "")], 3.0, describe)
    assert rank == 0


@pytest.mark.parametrize("world", [2, 3, 8, 10_000])
def test_every_rank_is_watched_by_rank_0_and_the_one_before_it_and_the_store_serves_keys_in_the_world_size(world):
    """Who reads whose beat (``Heartbeat.watched``): rank 0 every rank's, every other rank
    rank 0's and the next one's round the ring of ranks 1.. . Every rank is read by rank 0
    and (past two ranks) by one more, so one silent watcher does not hide a rank; the keys read per beat
    grow with the world, not its square (every rank reading every rank: 10,000^2)."""
    from types import SimpleNamespace

    from lightning_hetermoe.strategy.heartbeat import Heartbeat

    reads = {r: Heartbeat.watched(SimpleNamespace(rank=r, world_size=world)) for r in range(world)}
    assert reads[0] == list(range(1, world))
    readers: dict[int, set[int]] = {r: set() for r in range(world)}
    for r, watched in reads.items():
        assert r not in watched and len(set(watched)) == len(watched)
        if r:
            assert watched[0] == 0  # the store's host first: has it finished?
        for w in watched:
            readers[w].add(r)
    for r in range(1, world):
        assert 0 in readers[r] and (world == 2 or len(readers[r]) >= 2), (r, readers[r])
        assert world == 2 or (r - 2) % (world - 1) + 1 in readers[r]  # the one before it, ranks 1.. in a ring
    assert sum(map(len, reads.values())) <= 3 * world
