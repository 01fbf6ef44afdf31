"""Shared by the benchmarks that start gloo processes of their own (not the main job):
``world`` spawned processes on a free local port, their results through a queue, and a
rank that dies ending the wait instead of leaving it for ever."""

from __future__ import annotations

import queue as queues
import socket
from typing import Any, Callable


def run_ranks(target: Callable[..., None], world: int, *args: Any, results: int | None = None,
              timeout_s: float = 1800.0) -> list[Any]:
    """Start ``target(rank, world, port, queue, *args)`` in ``world`` spawned processes and
    return what they put on ``queue``, in the order it came: ``results`` items (default one a
    rank).
    The caller sets ``MASTER_ADDR``/``MASTER_PORT`` from ``port`` in its processes."""
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, queue, *args)) for r in range(world)]
    for p in procs:
        p.start()
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < (world if results is None else results):
            try:
                got.append(queue.get(timeout=5))
            except queues.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise SystemExit("a rank failed or the ranks ran past the deadline (tracebacks above)") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got
