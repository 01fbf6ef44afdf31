"""A small discrete-event engine for task DAGs on exclusive resources.

Each task runs on one resource (a rank's compute stream, or a communication channel) for
a fixed duration once all its dependencies have finished. A resource runs one task at a
time and, whenever it is idle, starts the best *ready* task in its queue:

* ``"priority"`` resources pick the smallest ``priority`` key (a schedule's order; the
  resource never idles while something is ready, so it is work-conserving);
* ``"fifo"`` resources pick the task that became ready first (the order inputs arrive),
  ties broken by priority.

Time advances from one task completion to the next, so the cost is O(n log n).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(slots=True)
class Task:
    name: str
    resource: str
    duration: float
    deps: list[int]
    priority: tuple = ()
    kind: str = ""
    layer: int = 0
    mb: int = 0


@dataclass
class Timeline:
    tasks: list[Task]
    start: list[float]
    end: list[float]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)


def run_dag(tasks: list[Task], policies: dict[str, str] | None = None) -> Timeline:
    """Simulate ``tasks``; ``policies`` maps resource -> "priority" (default) or "fifo"."""
    policies = policies or {}
    n = len(tasks)
    indeg = [len(t.deps) for t in tasks]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            if not 0 <= d < n:
                raise ValueError(f"task {t.name!r} depends on unknown task index {d}")
            children[d].append(i)
    queues: dict[str, list] = {}
    busy: dict[str, bool] = {}
    start = [0.0] * n
    end = [0.0] * n

    def push(i: int, now: float) -> None:
        t = tasks[i]
        key = (now, t.priority, i) if policies.get(t.resource) == "fifo" else (t.priority, i)
        heapq.heappush(queues.setdefault(t.resource, []), (key, i))

    for i in range(n):
        if indeg[i] == 0:
            push(i, 0.0)
    events: list[tuple[float, int]] = []
    now = 0.0
    done = 0
    dirty = set(queues)
    while True:
        for r in dirty:
            q = queues.get(r)
            if q and not busy.get(r, False):
                _, i = heapq.heappop(q)
                busy[r] = True
                start[i] = now
                end[i] = now + tasks[i].duration
                heapq.heappush(events, (end[i], i))
        dirty = set()
        if not events:
            break
        now, i = heapq.heappop(events)
        finished = [i]
        while events and events[0][0] <= now:
            finished.append(heapq.heappop(events)[1])
        for i in finished:
            done += 1
            r = tasks[i].resource
            busy[r] = False
            dirty.add(r)
            for c in children[i]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    push(c, now)
                    dirty.add(tasks[c].resource)
    if done != n:
        stuck = [tasks[i].name for i in range(n) if indeg[i] > 0][:5]
        raise ValueError(f"task graph has a cycle or unreachable tasks, e.g. {stuck}")
    return Timeline(tasks, start, end)
