"""A small discrete-event engine for task DAGs on exclusive resources.

Each task runs on one resource (a rank's compute stream, or a communication channel) for
a fixed duration once all its dependencies have finished. A resource runs one task at a
time and, whenever it is idle, starts the best *ready* task in its queue:

* ``"priority"`` resources pick the smallest ``priority`` key (a schedule's order; the
  resource never idles while something is ready, so it is work-conserving);
* ``"fifo"`` resources pick the task that became ready first (the order inputs arrive),
  ties broken by priority;
* ``"order"`` resources run their tasks strictly in ``priority`` order, waiting for the
  next one even when a later one is ready (a fixed schedule, as the executor follows it).

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
    if policies and all(policies.get(t.resource) == "order" for t in tasks):
        return _run_ordered(tasks)
    return _run_events(tasks, policies)


def _run_events(tasks: list[Task], policies: dict[str, str]) -> Timeline:
    """:func:`run_dag` event by event: each free resource takes a ready task by its policy."""
    n = len(tasks)
    children, indeg = _dependents(tasks)
    queues: dict[str, list] = {}
    busy: dict[str, bool] = {}
    start = [0.0] * n
    end = [0.0] * n

    # "order" resources: the tasks in their fixed sequence, and how far along it they are
    sequence: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        if policies.get(t.resource) == "order":
            sequence.setdefault(t.resource, []).append(i)
    for r in sequence:
        sequence[r].sort(key=lambda i: (tasks[i].priority, i))
    position = {r: 0 for r in sequence}
    ready_set: dict[str, set[int]] = {r: set() for r in sequence}

    def push(i: int, now: float) -> None:
        t = tasks[i]
        if t.resource in sequence:
            ready_set[t.resource].add(i)
            return
        key = (now, t.priority, i) if policies.get(t.resource) == "fifo" else (t.priority, i)
        heapq.heappush(queues.setdefault(t.resource, []), (key, i))

    def next_ready(r: str) -> int | None:
        if r in sequence:
            seq, k = sequence[r], position[r]
            if k < len(seq) and seq[k] in ready_set[r]:
                position[r] += 1
                ready_set[r].discard(seq[k])
                return seq[k]
            return None
        q = queues.get(r)
        return heapq.heappop(q)[1] if q else None

    for i in range(n):
        if indeg[i] == 0:
            push(i, 0.0)
    events: list[tuple[float, int]] = []
    now = 0.0
    done = 0
    finished_flags = [False] * n
    dirty = set(queues) | set(sequence)
    while True:
        for r in dirty:
            if busy.get(r, False):
                continue
            i = next_ready(r)
            if i is not None:
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
            finished_flags[i] = True
            r = tasks[i].resource
            busy[r] = False
            dirty.add(r)
            for c in children[i]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    push(c, now)
                    dirty.add(tasks[c].resource)
    if done != n:
        raise _stuck(tasks, [i for i in range(n) if not finished_flags[i]])
    return Timeline(tasks, start, end)


def _dependents(tasks: list[Task]) -> tuple[list[list[int]], list[int]]:
    """Each task's dependents and its number of dependencies; an unknown index raises."""
    n = len(tasks)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            if not 0 <= d < n:
                raise ValueError(f"task {t.name!r} depends on unknown task index {d}")
            children[d].append(i)
    return children, [len(t.deps) for t in tasks]


def _stuck(tasks: list[Task], unfinished: list[int]) -> ValueError:
    stuck = [f"{tasks[i].name}@{tasks[i].resource}" for i in unfinished[:5]]
    return ValueError(f"task graph has a cycle, unreachable tasks or an impossible fixed order, e.g. {stuck}")


def _run_ordered(tasks: list[Task]) -> Timeline:
    """:func:`run_dag` where every resource runs its tasks in a fixed order (zebra and
    DistEP): nothing is left to choose, so each task starts when its dependencies and its
    resource's previous task have ended, taken in a topological order instead of event by
    event. The same sums as the event loop's, so the same times to the last bit."""
    n = len(tasks)
    children, indeg = _dependents(tasks)
    sequence: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        sequence.setdefault(t.resource, []).append(i)
    prev = [-1] * n
    for seq in sequence.values():
        # tasks are mostly added in their order already: sort only where they are not
        if any(tasks[a].priority > tasks[b].priority for a, b in zip(seq, seq[1:])):
            seq.sort(key=lambda i: (tasks[i].priority, i))
        for a, b in zip(seq, seq[1:]):
            prev[b] = a
            children[a].append(b)
            indeg[b] += 1
    start = [0.0] * n
    end = [0.0] * n
    ready = [i for i in range(n) if indeg[i] == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        s = end[prev[i]] if prev[i] >= 0 else 0.0
        for d in tasks[i].deps:
            if end[d] > s:
                s = end[d]
        start[i] = s
        end[i] = s + tasks[i].duration
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if done != n:
        raise _stuck(tasks, [i for i in range(n) if indeg[i] > 0])
    return Timeline(tasks, start, end)
