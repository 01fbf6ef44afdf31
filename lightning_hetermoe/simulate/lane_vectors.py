"""A disaggregated step's time with all lanes of a role timed at once.

The task graph of :mod:`.step` has a task per lane and position in its list. On thousands
of ranks a ZP group has dozens to hundreds of lanes (ranks that differ only in the layers
whose experts they hold), and a planner's search times hundreds of such graphs: building
and walking them task by task was most of its time.

Here every lane of a role follows one list: an attention lane the list of a member that
holds experts of every layer, an expert lane every round in order. A lane skips the expert
tasks of layers it does not hold (a mask), and each node (a position of a role's list, or a
round on a channel) is timed for all the role's lanes at once with numpy. Whatever a
collective waits for on a rank that skipped tasks is its last expert task before that point
(``last`` below): the expert gates of :class:`~.step._Member`. A late header (an early
round's next receive issued after its experts, see :func:`~.step.run_step_dag`) holds the
lane's next task until the next round's emitters end. The maxima and sums are the task
graph's, in the same order, so the step time is the same to the last bit
(``tests/test_simulator.py`` holds the two together on random plans).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..distinct import distinct
from ..task_order import Round, Task as ScheduleTask, awaited_round, emitted_round
from .step import (StepSetup, TaskTimes, build_tasks, carries_tails, check_setup, disaggregated_step, graph_shape,
                   lane_tail, round_transfer_time, run_step_dag)

# node kinds of a program, in the order a role's list or a channel holds them
ATTN, ATTN_X, EXPERT, DISPATCH, COMBINE, COUNT = range(6)
LATE_PASSES = 4  # as run_step_dag: each pass only adds waits


class _Program:
    """A schedule shape's graph with one list per role: its nodes in a topological order,
    and what each waits for. Worked out once per shape (a search times thousands of graphs
    of a few shapes)."""

    def __init__(self, shape) -> None:
        sched = shape.sched
        L, nR = sched.num_layers, shape.n_rounds
        self.n_rounds = nR
        self.full = sched.member_tasks(True, (True,) * L)
        self.n_attention = len(sched.attention)
        self.round_layer = shape.round_layer
        self.round_kind = ["expert_fwd" if r.phase == "fwd" else "expert_bwd" for r in sched.rounds]
        self.round_mb = [r.mb for r in sched.rounds]
        self.early = shape.early
        count_index = {key: c for c, key in enumerate(shape.count_rounds)}
        self.n_counts = len(shape.count_rounds)
        # combines go out in round order (combine points never fall back), so what an expert
        # lane waits on at a collective is its last expert task up to the last combine before it
        combines = [k for is_combine, k, _ in shape.issue if is_combine]
        # An attention member holding some layers runs the full list less the other layers'
        # expert tasks where the points at which it answers never fall back: a holder answers
        # a round it holds at the same point whatever else it holds (right after the round's
        # emitter, or layered where the run's answers go), and keeps round order on its rank.
        points = sched.combine_points((True,) * L)
        self.valid = combines == sorted(combines) and points == sorted(points)
        last_combine, gate = -1, [-1] * nR
        for is_combine, k, _ in shape.issue:
            if is_combine:
                last_combine = k
            else:
                gate[k] = last_combine
        self.dispatch_gate = gate
        self.emitter = [(e[0] if e else -1) for e in shape.emitters]
        self.posted = shape.posted
        # per attention task: its kind and micro-batch, the combine it awaits, the count it
        # waits for, the round it emits (-1: none)
        self.attention = []
        for n, t in enumerate(sched.attention):
            need = awaited_round(t, L)
            await_k = shape.position[need] if need is not None and need in shape.position else -1
            c = -1
            g = sched.balance_group(t.mb)
            if g is not None and t.kind in ("attn_fwd", "head") and (t.kind == "head" or t.layer > 0):
                c = count_index.get((L - 1 if t.kind == "head" else t.layer - 1, g), -1)
            out = emitted_round(t, L)
            self.attention.append((t.kind, t.mb, await_k, c, shape.position.get(out, -1) if out else -1))
        self.count_deps = [[shape.attention_index[ScheduleTask("attn_fwd", l, j)] for j in sched.balance_groups[g]]
                           for l, g in shape.count_rounds]
        nodes = [(ATTN_X, shape.position[Round("fwd" if t.kind == "expert_fwd" else "bwd", t.layer, t.mb)])
                 if t.kind in ("expert_fwd", "expert_bwd") else (ATTN, shape.attention_index[t]) for t in self.full]
        self.order = self._topological(nodes)

    def _topological(self, attention_list: list[tuple[int, int]]) -> list[tuple[int, int]]:
        nR = self.n_rounds
        deps: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for prev, node in zip(attention_list, attention_list[1:]):
            deps[node].append(prev)
        for node in attention_list:
            kind, i = node
            if kind == ATTN_X:
                deps[node].append((DISPATCH, i))
            else:
                _, _, await_k, c, _ = self.attention[i]
                if await_k >= 0:
                    deps[node].append((COMBINE, await_k))
                if c >= 0:
                    deps[node].append((COUNT, c))
        at_x = {i for kind, i in attention_list if kind == ATTN_X}
        for k in range(nR):
            for chan in (EXPERT, DISPATCH, COMBINE):
                if k:
                    deps[(chan, k)].append((chan, k - 1))
            deps[(EXPERT, k)].append((DISPATCH, k))
            if self.emitter[k] >= 0:
                deps[(DISPATCH, k)].append((ATTN, self.emitter[k]))
            if self.dispatch_gate[k] >= 0:
                deps[(DISPATCH, k)].append((EXPERT, self.dispatch_gate[k]))
            if k:
                deps[(DISPATCH, k)].append((EXPERT, k - 1))  # a late header's wait
            deps[(COMBINE, k)] += [(ATTN, n) for n in self.posted[k]] + [(EXPERT, k)]
            if k in at_x:
                deps[(COMBINE, k)].append((ATTN_X, k))
        for c, need in enumerate(self.count_deps):
            deps[(COUNT, c)] += [(ATTN, n) for n in need] + ([(COUNT, c - 1)] if c else [])
        nodes = attention_list + [(chan, k) for chan in (EXPERT, DISPATCH, COMBINE) for k in range(nR)]
        nodes += [(COUNT, c) for c in range(self.n_counts)]
        waiting = {node: len(deps[node]) for node in nodes}
        children: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for node in nodes:
            for d in deps[node]:
                children[d].append(node)
        ready = [node for node in reversed(nodes) if waiting[node] == 0]
        order = []
        while ready:
            node = ready.pop()
            order.append(node)
            for c in children[node]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    ready.append(c)
        if len(order) != len(nodes):
            raise ValueError("lane_vectors: the schedule's graph has a cycle")
        return order

def _program(shape) -> _Program:
    prog = getattr(shape, "lane_vectors", None)
    if prog is None:
        prog = shape.lane_vectors = _Program(shape)
    return prog


def simulate_step_time(setup: StepSetup, timer) -> float:
    """:func:`~.step.simulate_step`'s step time alone, for a zebra or DistEP setup: what a
    planner's search compares, without the per-rank breakdown it does not read. Timed with
    every lane of a role at once (the same time to the last bit, a tenth of the work on
    hundreds of lanes); from the task graph where that cannot be done."""
    if setup.schedule is None:
        raise ValueError("simulate_step_time: EP's step needs each rank's last task; use simulate_step")
    fast = step_time(setup, timer)
    if fast is not None:
        return fast
    tasks, policies, tails, late = build_tasks(setup, timer)
    return disaggregated_step(run_step_dag(tasks, policies, late).makespan, tails, setup.waves, carries_tails(setup))


def step_time(setup: StepSetup, timer) -> float | None:
    """The step time of a zebra, DistEP or forward-only setup, as the task graph gives it;
    ``None`` where the lanes cannot share a list (the caller builds the task graph)."""
    sched = setup.schedule
    m = setup.model
    L, R, E = m.n_layers, setup.num_microbatches, m.moe.num_experts
    if sched is None or sched.num_layers != L or sched.num_microbatches != R:
        return None  # the task graph names what is wrong
    check_setup(setup)
    lanes = setup.lanes
    att = [i for i, lane in enumerate(lanes) if lane.role == "attention"]
    exp = [i for i, lane in enumerate(lanes) if lane.role != "attention"]
    attention_holds = tuple(any(lanes[i].experts[l] for i in att) for l in range(L))
    shape = graph_shape(sched, attention_holds)
    prog = _program(shape)
    if not prog.valid:
        return None
    durations = _Durations(setup, timer, sched.kind == "forward", prog, att, exp)
    by_mb = [[t[j] for t in durations.tokens] for j in range(R)]
    leg = {}  # a round's legs follow its layer and micro-batch: forward and backward alike
    for r in sched.rounds:
        if (r.layer, r.mb) not in leg:
            leg[(r.layer, r.mb)] = round_transfer_time(setup, timer, r.layer, by_mb[r.mb])
    legs = [leg[(r.layer, r.mb)] for r in sched.rounds]
    dense = timer.allreduce(E * 8, setup.attention_dp, setup.dense_link()) if prog.n_counts else 0.0
    # an expert lane's early rounds it holds: where a late header may hold its next task
    late = [(k, durations.exp_holders[k]) for k in range(prog.n_rounds - 1)
            if prog.early[k] and len(durations.exp_holders[k]) and att and prog.emitter[k + 1] >= 0]
    moved = np.zeros((len(exp), prog.n_rounds), dtype=bool)
    tails = {}
    if sched.kind != "forward":
        tails = {i: lane_tail(timer, setup, lane) for i, lane in enumerate(lanes)}
    carried = carries_tails(setup)
    # where each lane starts: the end of its own tail of the step before, where carried
    free = (np.array([tails[i] if carried else 0.0 for i in att]), np.array([tails[i] if carried else 0.0 for i in exp]))
    makespan, starts, emitted = _run(prog, durations, legs, dense, moved, late, free)
    for _ in range(LATE_PASSES):
        came = False
        for k, idx in late:
            new = ~moved[idx, k] & (emitted[k + 1] > starts[k] + 1e-12)
            if new.any():
                moved[idx[new], k] = True
                came = True
        if not came:
            break
        makespan, starts, emitted = _run(prog, durations, legs, dense, moved, late, free)
    return disaggregated_step(makespan, tails, setup.waves, carried)


class _Durations:
    """Each node's durations, per lane of its role: attention tasks by (kind, micro-batch),
    expert tasks by round for the lanes that hold its layer."""

    def __init__(self, setup: StepSetup, timer, forward_only: bool, prog: _Program, att: list[int],
                 exp: list[int]) -> None:
        times = TaskTimes(setup, timer, forward_only=forward_only)
        self.tokens = times.tokens
        lanes = setup.lanes
        L, R, nR = setup.model.n_layers, setup.num_microbatches, prog.n_rounds
        memo: dict[tuple, float] = {}

        def attention(i: int, kind: str, mb: int) -> float:
            key = (id(lanes[i].device), kind, self.tokens[i][mb])
            if key not in memo:
                memo[key] = times(i, kind, L - 1, mb)
            return memo[key]

        self.attention = {(kind, mb): np.array([attention(i, kind, mb) for i in att])
                          for kind in {a[0] for a in prog.attention} for mb in range(R)}
        # even routing: an expert task's time follows the lane's device and its experts in the
        # layer, looked up per round for all holders at once; at a measured routing each
        # expert costs its own, and every holder's sum is formed at once per round
        even = setup.expert_load is None

        def holders(members: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
            counts = np.array([lanes[i].experts for i in members], dtype=np.intp).reshape(len(members), L)
            by_layer = [np.flatnonzero(counts[:, l]) for l in range(L)]
            idx = [by_layer[prog.round_layer[k]] for k in range(nR)]
            if setup.measured_by_id():
                # every layer's holders in one array, priced once per kind of round
                lane_of = np.array(members, dtype=np.intp)
                rows = np.concatenate(by_layer) if L else np.zeros(0, dtype=np.intp)
                layer_of = np.repeat(np.arange(L), [len(b) for b in by_layer])
                cut = np.cumsum([len(b) for b in by_layer])[:-1]
                per = {key: np.split(times.held_experts(lane_of[rows], layer_of, *key), cut)
                       for key in set(zip(prog.round_kind, prog.round_mb))}
                return idx, [per[(prog.round_kind[k], prog.round_mb[k])][prog.round_layer[k]] for k in range(nR)]
            if not even:
                return idx, [np.array([times(members[p], prog.round_kind[k], prog.round_layer[k], prog.round_mb[k])
                                       for p in idx[k]]) for k in range(nR)]
            codes, kinds = distinct([lanes[i].device for i in members])
            code = np.array(codes, dtype=np.intp)
            width = int(counts.max(initial=0)) + 1
            # the first lane and layer (members in order, layers within) of each (device,
            # experts held): where its times are asked
            pair, at = np.unique((code[:, None] * width + counts).ravel(), return_index=True)
            first = [(int(c), int(n), members[int(q) // L], int(q) % L)
                     for c, n, q in zip(pair // width, pair % width, at) if n]
            tables = {}
            for kind in set(prog.round_kind):
                for mb in range(R):
                    table = np.zeros((len(kinds), width))
                    for c, n, i, l in first:
                        table[c, n] = times(i, kind, l, mb)
                    tables[(kind, mb)] = table
            # each layer's (device code, experts held) per holder, looked up once a layer, not a round
            at_layer = [(code[by_layer[l]], counts[by_layer[l], l]) for l in range(L)]
            dur = [tables[(prog.round_kind[k], prog.round_mb[k])][at_layer[prog.round_layer[k]]] for k in range(nR)]
            return idx, dur

        self.att_holders, self.att_expert = holders(att)
        self.exp_holders, self.exp_expert = holders(exp)
        self.n_att, self.n_exp = len(att), len(exp)


TOP_BY_LIST = 32  # below this many lanes a list's max is quicker than numpy's (0.8 against 1.0 us at 32)


def _top(a: np.ndarray) -> float:
    """The largest of the lanes' values: at even routing a lane per kind of rank, a few, where
    numpy's reduction costs more than the list's (hundreds of calls a simulated step); a
    measured routing keeps a lane per rank, hundreds, where numpy's is quicker."""
    return max(a.tolist()) if a.size < TOP_BY_LIST else float(a.max())


def _run(prog: _Program, d: _Durations, legs: list[float], dense: float, moved: np.ndarray,
         late: list[tuple[int, np.ndarray]], free: tuple[np.ndarray, np.ndarray]
         ) -> tuple[float, dict[int, np.ndarray], np.ndarray]:
    """One pass over the program with these late headers (``moved[lane, round]``), each
    attention and expert lane free from ``free``'s time: the makespan, the start of each
    early round's experts per holder, each round's emission."""
    nR = prog.n_rounds
    busy = free[0].copy()  # each attention lane's last end
    last = np.zeros(d.n_exp)  # each expert lane's last expert task's end (what its collectives wait for)
    free_exp = free[1]  # ... and when its first may start
    # a late header's wait for the lane's next task: the round whose emission it waits for
    # (nR: none; read when that task starts, once the emission is timed)
    hold = np.full(d.n_exp, nR, dtype=np.intp)
    any_moved = bool(moved.any())
    early = {k for k, _ in late}
    attn_end = [0.0] * prog.n_attention  # the latest end over attention lanes, per attention task
    emitted = np.zeros(nR + 1)
    att_x = [0.0] * nR
    last_max = [0.0] * nR
    late_max = [0.0] * nR
    dispatch = [0.0] * nR
    combine = [0.0] * nR
    counts = [0.0] * prog.n_counts
    starts: dict[int, np.ndarray] = {}
    for kind, i in prog.order:
        if kind == ATTN:
            task_kind, mb, await_k, c, out = prog.attention[i]
            wait = combine[await_k] if await_k >= 0 else 0.0
            if c >= 0 and counts[c] > wait:
                wait = counts[c]
            busy = np.maximum(busy, wait) + d.attention[(task_kind, mb)]
            attn_end[i] = end = _top(busy) if d.n_att else 0.0
            if out >= 0:
                emitted[out] = end
        elif kind == ATTN_X:
            idx = d.att_holders[i]
            if len(idx):
                done = np.maximum(busy[idx], dispatch[i]) + d.att_expert[i]
                busy[idx] = done
                att_x[i] = _top(done)
        elif kind == EXPERT:
            idx = d.exp_holders[i]
            if len(idx):
                start = np.maximum(np.maximum(last[idx], free_exp[idx]), dispatch[i])
                if any_moved:
                    start = np.maximum(start, emitted[hold[idx]])
                done = start + d.exp_expert[i]
                last[idx] = done
                if i in early:
                    starts[i] = start
                if any_moved:
                    now = moved[idx, i]
                    hold[idx] = np.where(now, i + 1, nR)
                    if now.any():
                        late_max[i] = _top(done[now])
            last_max[i] = _top(last) if d.n_exp else 0.0
        elif kind == DISPATCH:
            s = dispatch[i - 1] if i else 0.0
            if prog.emitter[i] >= 0 and attn_end[prog.emitter[i]] > s:
                s = attn_end[prog.emitter[i]]
            g = prog.dispatch_gate[i]
            if g >= 0 and last_max[g] > s:
                s = last_max[g]
            if i and late_max[i - 1] > s:
                s = late_max[i - 1]
            dispatch[i] = s + legs[i]
        elif kind == COMBINE:
            s = combine[i - 1] if i else 0.0
            for n in prog.posted[i]:
                if attn_end[n] > s:
                    s = attn_end[n]
            if att_x[i] > s:
                s = att_x[i]
            if last_max[i] > s:
                s = last_max[i]
            combine[i] = s + legs[i]
        else:
            s = counts[i - 1] if i else 0.0
            for n in prog.count_deps[i]:
                if attn_end[n] > s:
                    s = attn_end[n]
            counts[i] = s + dense
    ends = [dispatch[-1], combine[-1]] + counts[-1:]
    if d.n_att:
        ends.append(busy.max())
    if d.n_exp:
        ends.append(max(last.max(), free_exp.max()))
    return float(max(ends)), starts, emitted
