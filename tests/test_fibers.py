"""The zebra fibers' threads: kept from one step to the next (CUDA libraries keep
per-thread state, cuDNN's attention plans among it), one per micro-batch in flight,
and a fiber's failure or abort leaves its thread free for the next."""

from __future__ import annotations

import threading

import pytest

from lightning_hetermoe.strategy.backends.zebra import fibers


def _step(n: int, parks: int = 1) -> list[threading.Thread]:
    """Run ``n`` fibers the way a zebra step does (each parks, then each finishes); the
    thread each ran on (the objects: a new thread may reuse an ended one's ident)."""
    seen: dict[int, threading.Thread] = {}

    def body(mb: int):
        def run():
            seen[mb] = threading.current_thread()
            for _ in range(parks):
                fibers.current().park()
            assert threading.current_thread() is seen[mb]
            return mb
        return run

    fs = [fibers.Fiber(body(mb), mb=mb) for mb in range(n)]
    for _ in range(parks):
        for f in fs:
            f.resume(expect=0)
    for f in fs:
        f.resume(expect=None)
        assert f.done and f.result == f.mb
    return [seen[mb] for mb in range(n)]


def test_threads_are_kept_from_step_to_step():
    first = _step(3)
    assert len(set(first)) == 3, "fibers in flight together run on threads of their own"
    assert threading.current_thread() not in first
    for _ in range(3):
        assert set(_step(3)) == set(first), "a later step runs on the same threads"
    assert set(_step(2)) <= set(first)


def test_a_failed_or_aborted_fiber_frees_its_thread():
    threads = set(_step(2))

    def fails():
        fibers.current().park()
        raise ValueError("user code")

    f = fibers.Fiber(fails, mb=0)
    f.resume(expect=0)
    with pytest.raises(ValueError, match="user code"):
        f.resume(expect=None)
    parked = fibers.Fiber(lambda: fibers.current().park(), mb=1)
    parked.resume(expect=0)
    parked.abort()
    never = fibers.Fiber(lambda: None, mb=2)
    never.abort()  # never started: takes no thread
    assert parked.done and never.done and never.result is None
    assert set(_step(2)) == threads


def test_stop_workers_ends_the_idle_threads():
    threads = {t for t in threading.enumerate() if t.name.startswith("hetermoe-")}
    _step(2)
    workers = [t for t in threading.enumerate() if t.name.startswith("hetermoe-mb") and t not in threads]
    fibers.stop_workers()
    assert all(not t.is_alive() for t in workers)
    assert len(set(_step(2))) == 2, "a later step starts new threads"


def _threads_seen(monkeypatch, setting) -> tuple[int, int, int]:
    """A fresh worker's intra-op threads, the creator's after it, and a plain thread's
    started after it, with the rank at 2 threads and ``INTRAOP_THREADS`` at ``setting``."""
    import torch

    monkeypatch.setattr(fibers, "INTRAOP_THREADS", setting)
    before = torch.get_num_threads()
    fibers.stop_workers()  # the next fiber starts a worker of its own
    torch.set_num_threads(2)
    try:
        f = fibers.Fiber(torch.get_num_threads, mb=0)
        f.resume(expect=None)
        plain: list[int] = []
        t = threading.Thread(target=lambda: plain.append(torch.get_num_threads()))
        t.start()
        t.join()
        return f.result, torch.get_num_threads(), plain[0]
    finally:
        fibers.stop_workers()
        torch.set_num_threads(before)


@pytest.mark.skipif(not fibers._openmp_backend(), reason="ATen's parallel backend here is not OpenMP")
def test_a_worker_runs_one_intraop_thread_and_leaves_the_rank_its_own(monkeypatch):
    # one OpenMP team per worker slept and woke as the baton passed (bench/fiber_threads.py)
    assert _threads_seen(monkeypatch, 1) == (1, 2, 2)
    assert _threads_seen(monkeypatch, None) == (2, 2, 2), "None leaves a worker at the rank's count"
