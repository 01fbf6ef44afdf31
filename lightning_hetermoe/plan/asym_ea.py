"""Asymmetric expert assignment ("gather and squeeze"), derived from first principles.

Setting: one ZP group, M attention members and N expert members, E experts in each of L
layers. Per micro-batch and layer (forward only, as in the paper):

* attention member ``i`` spends ``attn[i]`` on attention+router, plus ``attn_exp[i]``
  per expert it hosts (a hosted expert serves the whole group's tokens for it);
* expert member ``i`` spends ``exp[i]`` per expert it hosts.

The layer's attention-side time is ``Ta_l = max_i(attn[i] + a_il·attn_exp[i])`` and its
expert-side time ``Te_l = max_i(x_il·exp[i])``: every member waits for the slowest one
in its role (the all-to-all gathers from all of them). Zebra overlaps the two sides, so
the attention ranks idle for ``Te_l − Ta_l`` per layer (the bubble) when experts are
slower, and this idle time carries through the pipeline from layer to layer.

*Gather.* ``Te_l`` falls only when **every** expert member at the maximum gives up one
expert. So the unit of offloading (a "chunk") is one expert from each most-loaded expert
member. In the balanced case (E divisible by N, equal devices) that is N experts, one
per expert rank.

*Squeeze.* The chunk's experts go, one at a time, to the attention member whose time
grows least (``attn[i] + (a_il+1)·attn_exp[i]``). With N experts over M attention ranks
each attention rank takes N/M of them when M divides N; otherwise some take ⌈N/M⌉ and
others ⌊N/M⌋. (The paper's printed formula swaps these two numbers: per chunk an expert
rank gives 1 = n2 and an attention rank takes N/M = n1, not the other way round. Neither
M | N nor N | M is needed here.)

*When.* A chunk is worth moving iff the predicted forward time of the step falls: the
bubble it removes on the expert side exceeds the work it adds on the attention side.
Because bubbles carry over, we score a placement by the forward makespan of the zebra
pipeline (a two-machine flow-shop recurrence over layers and micro-batches) and move,
greedily, the chunk that lowers it most, until no chunk helps. If expert ranks are faster
everywhere, no chunk helps and nothing moves; the more the bubble grows, the more chunks
move.

*Memory.* Expert members hold at most ``expert_capacity[i]`` experts (all layers), and
attention members at most ``attn_capacity[i]`` (n_max in total). Experts that do not fit
on expert members (n_min) are placed on attention members first; if they do not fit
there either, the model does not fit the group.
"""

from __future__ import annotations

import heapq

from dataclasses import dataclass, field
from typing import Callable
from operator import mul

import numpy as np


@dataclass
class AsymEAInput:
    num_layers: int
    num_experts: int
    attn: list[float]  # per attention member, attention+router of one micro-batch
    attn_exp: list[float]  # per attention member, one hosted expert on one micro-batch
    exp: list[float]  # per expert member, one expert on one micro-batch
    attn_capacity: list[int]  # per attention member, experts it can hold (all layers)
    expert_capacity: list[int]  # per expert member
    num_microbatches: int = 4

    def __post_init__(self) -> None:
        if len(self.attn) != len(self.attn_exp) or len(self.attn) != len(self.attn_capacity):
            raise ValueError("AsymEAInput: attention member lists differ in length")
        if len(self.exp) != len(self.expert_capacity):
            raise ValueError("AsymEAInput: expert member lists differ in length")
        if not self.attn:
            raise ValueError("AsymEAInput: no attention member")


@dataclass
class AsymEAResult:
    # counts[member][layer]; members are attention members then expert members
    counts: list[list[int]]
    base_counts: list[list[int]]
    n_min: int
    n_max: int
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (layer, experts moved)
    forward_time: float = 0.0
    base_forward_time: float = 0.0

    def offloaded(self, m: int) -> list[int]:
        L = len(self.counts[0]) if self.counts else 0
        return [sum(self.counts[i][l] for i in range(m)) for l in range(L)]


def forward_makespan(ta: list[float], te: list[float], R: int) -> float:
    """Forward time of the zebra pipeline with per-layer side times ``ta``/``te``.

    Attention runs (l, j) after its previous task and after the experts returned (l-1, j);
    experts run (l, j) after their previous task and after attention produced it.
    """
    return _finish((0.0, 0.0, [0.0] * R), ta, te, 0, ta[0], te[0]) if ta else 0.0


# the pipeline's state between layers: attention's and the experts' last end, and when each
# micro-batch's experts returned
_State = tuple[float, float, list[float]]


def _layer(a_end: float, e_end: float, prev_e: list[float], ta_l: float, te_l: float) -> tuple[float, float]:
    """One layer of :func:`forward_makespan`; ``prev_e`` is advanced in place."""
    # ``y if y > x else x`` is ``max(x, y)`` (the first on ties) without the builtin's call
    a_done = [(a_end := (back if back > a_end else a_end) + ta_l) for back in prev_e]
    for j, a in enumerate(a_done):
        e_end = (a if a > e_end else e_end) + te_l
        prev_e[j] = e_end
    return a_end, e_end


def pipeline_states(ta: list[float], te: list[float], R: int) -> list[_State]:
    """The state before each layer, so that a change at layer ``l`` is priced from there
    (:func:`_finish`) with the same sums as from layer 0."""
    a_end, e_end, prev_e = 0.0, 0.0, [0.0] * R
    out = []
    for ta_l, te_l in zip(ta, te):
        out.append((a_end, e_end, prev_e[:]))
        a_end, e_end = _layer(a_end, e_end, prev_e, ta_l, te_l)
    return out


def _finish(state: _State, ta: list[float], te: list[float], l: int, ta_l: float, te_l: float) -> float:
    """The forward makespan from ``state`` before layer ``l``, with layer ``l``'s side times
    ``ta_l``/``te_l`` in place of ``ta[l]``/``te[l]``."""
    a_end, e_end, prev_e = state[0], state[1], state[2][:]
    a_end, e_end = _layer(a_end, e_end, prev_e, ta_l, te_l)
    for k in range(l + 1, len(ta)):
        a_end, e_end = _layer(a_end, e_end, prev_e, ta[k], te[k])
    return e_end


def finish_each(ta: list[float], te: list[float], ta_c: list[float], te_c: list[float], R: int) -> np.ndarray:
    """``out[c] = _finish(pipeline_states(ta, te, R)[c], ta, te, c, ta_c[c], te_c[c])`` for
    every layer ``c`` at once, to the last bit.

    Row ``c`` is the pipeline with layer ``c``'s side times changed; before layer ``c`` it
    runs the base times, so it reaches layer ``c`` in ``states[c]`` without being started
    there. Each step is :func:`_layer`'s IEEE operations in its order, elementwise (float64
    ``maximum`` and ``+`` round as Python's floats do)."""
    L = len(ta)
    if not L:
        return np.zeros(0)
    diag = np.arange(L)
    side_a = np.empty((L, L))
    side_a[:] = np.asarray(ta, dtype=float)[:, None]
    side_a[diag, diag] = ta_c
    side_e = np.empty((L, L))
    side_e[:] = np.asarray(te, dtype=float)[:, None]
    side_e[diag, diag] = te_c
    # done[j]: when attention finished micro-batch j of the layer; back[j]: when its experts
    # returned. A row's attention end is done[R-1], its experts' end back[R-1], as in _layer.
    done, back = list(np.zeros((R, L))), list(np.zeros((R, L)))
    maximum, add = np.maximum, np.add
    for ta_k, te_k in zip(side_a, side_e):
        a = done[-1]
        for d, b in zip(done, back):
            a = add(maximum(a, b, out=d), ta_k, out=d)
        e = back[-1]
        for d, b in zip(done, back):
            e = add(maximum(e, d, out=b), te_k, out=b)
    return back[-1]


def _side_times(inp: AsymEAInput, counts: list[list[int]]) -> tuple[list[float], list[float]]:
    M = len(inp.attn)
    attn, attn_exp, exp = inp.attn, inp.attn_exp, inp.exp
    ta, te = [], []
    for l in range(inp.num_layers):
        col = [row[l] for row in counts]
        ta.append(max([a + c * x for a, c, x in zip(attn, col, attn_exp)]))
        te.append(max(map(mul, col[M:], exp), default=0.0))
    return ta, te


def assign_experts(inp: AsymEAInput, *, asym: bool = True) -> AsymEAResult:
    """Whole-expert counts per member and layer; see the module docstring for the rule."""
    counts, used, n_min = _base_counts(inp)
    base = [row[:] for row in counts]
    R = max(1, inp.num_microbatches)
    base_time = forward_makespan(*_side_times(inp, counts), R)
    n_max = sum(max(c, 0) for c in inp.attn_capacity)
    result = AsymEAResult(
        counts=counts, base_counts=base, n_min=n_min, n_max=n_max, forward_time=base_time, base_forward_time=base_time
    )
    if not asym or not inp.exp:
        return result
    result.forward_time = _offload(inp, counts, used, R, base_time, result.chunks)
    return result


def _capacity(inp: AsymEAInput) -> list[int]:
    return list(inp.attn_capacity) + list(inp.expert_capacity)


def _base_counts(inp: AsymEAInput) -> tuple[list[list[int]], list[int], int]:
    """The base placement: expert e of every layer in turn (so forced moves spread over
    layers) to the expert member whose layer time grows least and that still has room; where
    expert members are full, to an attention member (counted in n_min). Returns the counts,
    each member's experts over all layers, and n_min."""
    L, E = inp.num_layers, inp.num_experts
    M, N = len(inp.attn), len(inp.exp)
    counts = [[0] * L for _ in range(M + N)]
    used = [0] * (M + N)
    cap = _capacity(inp)
    if sum(max(c, 0) for c in cap) < L * E:
        raise ValueError(
            f"experts exceed total memory: {L * E} experts ({L} layers x {E}) but the ZP group holds at most "
            f"{sum(max(c, 0) for c in cap)} ({sum(max(c, 0) for c in inp.expert_capacity)} on expert ranks, "
            f"{sum(max(c, 0) for c in inp.attn_capacity)} on attention ranks); add ranks or use more memory-rich GPUs"
        )
    # Per layer, each side's members are picked by the time they would reach with one more
    # expert (a heap; a member whose room ran out is dropped when it surfaces, room only
    # shrinks here). A member's times grow by its own holdings alone, so every layer's heap
    # gives the members in one merged order, less those found full: one order per side
    # (made as far as some layer needs it) and a place in it per layer.
    exp, attn, attn_exp = inp.exp, inp.attn, inp.attn_exp
    heapreplace = heapq.heapreplace

    def merged(members: range, cost) -> tuple[list[int], Callable[[], None]]:
        heap = [(cost(p, 1), p) for p in members]
        heapq.heapify(heap)
        n = [1] * (M + N)
        order: list[int] = []

        def more() -> None:
            p = heap[0][1]
            order.append(p)
            c = n[p] = n[p] + 1
            heapreplace(heap, (cost(p, c), p))

        return order, more

    def pick(order: list[int], more, at: list[int], l: int) -> int:
        i = at[l]
        while True:
            if i == len(order):
                more()
            p = order[i]
            i += 1
            if used[p] < cap[p]:
                at[l] = i
                return p

    sides = {}  # per side: its merged order, how to make more, each layer's place in it
    if N:
        # Where no expert member fills up, every layer takes the same first E of the merged
        # order (a member skipped for want of room is what makes layers differ): E picks
        # instead of L x E, and the same counts (planning 1,024 GPUs places thousands of
        # times, each group of 61 expert members 6,144 experts)
        order, more = merged(range(M, M + N), lambda p, c: c * exp[p - M])
        while len(order) < E:
            more()
        per = [0] * N
        for p in order[:E]:
            per[p - M] += 1
        if all(L * n <= cap[M + i] for i, n in enumerate(per)):
            for i, n in enumerate(per):
                counts[M + i] = [n] * L
                used[M + i] = L * n
            return counts, used, 0
        sides["expert"] = (order, more, [0] * L)
    n_min = 0
    room = {"expert": sum(used[p] < cap[p] for p in range(M, M + N)), "attention": sum(used[p] < cap[p] for p in range(M))}
    for e in range(E):
        for l in range(L):
            side = "expert" if room["expert"] else "attention"
            if side == "attention":  # expert ranks are full: this expert must move (counts toward n_min)
                n_min += 1
                if not room[side]:
                    raise ValueError(f"experts exceed total memory: no member of the ZP group has room for expert "
                                     f"{e} of layer {l}; add ranks or use more memory-rich GPUs")
            if side not in sides:  # the expert side's order is made above, wherever it has members
                sides[side] = (*merged(range(M), lambda p, c: attn[p] + c * attn_exp[p]), [0] * L)
            p = pick(*sides[side], l)
            counts[p][l] += 1
            used[p] += 1
            if used[p] >= cap[p]:
                room[side] -= 1
    return counts, used, n_min


def _chunk(inp: AsymEAInput, col: list[int], used: list[int], cap: list[int]) -> tuple[list[int], int] | None:
    """One chunk of a layer moved (gather and squeeze) from the layer's member counts
    ``col``: the new counts and the experts moved; ``None`` where the attention members
    have no room for it."""
    M = len(inp.attn)
    attn, attn_exp = inp.attn, inp.attn_exp
    on_experts = col[M:]
    loads = list(map(mul, on_experts, inp.exp))
    top = max(loads)
    if top <= 0:
        return None
    near = top * (1 - 1e-9)
    # (a member with a load this near the top holds an expert: times are positive)
    gather = [M + i for i, load in enumerate(loads) if load >= near]
    # squeeze: each gathered expert to the attention member whose time grows least
    # (a heap of the members with room: only the receiver's cost changes per move; it goes
    # back by heapreplace, as the keys are distinct the pops do not depend on the arrangement)
    col = col[:]
    room = [(attn[i] + (col[i] + 1) * attn_exp[i], i) for i in range(M) if used[i] < cap[i]]
    heapq.heapify(room)
    heappop, heapreplace = heapq.heappop, heapq.heapreplace
    took: dict[int, int] = {}  # only receivers' room changes (they are attention members)
    for src in gather:
        if not room:
            return None
        dst = room[0][1]
        col[src] -= 1
        c = col[dst] = col[dst] + 1
        t = took[dst] = took.get(dst, 0) + 1
        if used[dst] + t < cap[dst]:
            heapreplace(room, (attn[dst] + (c + 1) * attn_exp[dst], dst))
        else:
            heappop(room)
    return col, len(gather)


def _offload(inp: AsymEAInput, counts: list[list[int]], used: list[int], R: int, current: float,
             chunks: list[tuple[int, int]], reuse: bool = True) -> float:
    """Greedily move the chunk that lowers the forward makespan most, until none does;
    ``counts``, ``used`` and ``chunks`` are updated in place. Returns the final makespan.

    A layer's chunk depends on its own column and on the attention members' room only
    where the squeeze ran into it: a member that took ``g`` of the chunk and still had room
    takes the same with any room >= ``g``; one that filled up, only with the same room.
    Where the layer's column is unchanged and every member's room passes, the chunk is the
    one found before, and layers of one column share the round's chunk (``reuse=False``:
    each layer's found afresh each round, the reference)."""
    L, M, N = inp.num_layers, len(inp.attn), len(inp.exp)
    cap = _capacity(inp)
    ta, te = _side_times(inp, counts)
    cols = [[counts[p][l] for p in range(M + N)] for l in range(L)]
    found: dict[int, tuple] = {}

    # An attention member's room only shrinks here (chunks go from expert members to
    # attention members), so a member that took none of a chunk takes none again: only
    # those that took some are checked.
    def still(took: list[tuple[int, int, bool]], room: list[int]) -> bool:
        for i, g, filled in took:
            if (room[i] != g) if filled else (room[i] < g):
                return False
        return True

    # Every layer's candidate is priced in one vectorised pass (finish_each); a layer without
    # a chunk keeps the base times and is masked out.
    exp = inp.exp
    while True:
        room = [r if (r := cap[i] - used[i]) > 0 else 0 for i in range(M)]
        trial_a, trial_e = ta[:], te[:]
        moves: list = [None] * L
        # layers of one column this round have one chunk (a layer's side times are its
        # column's): found once
        alike: dict[tuple[int, ...] | int, tuple] = {}
        for l in range(L):
            before = cols[l]
            hit = found.get(l) if reuse else None
            if hit is None or hit[0] is not before or not still(hit[2], room):
                key = tuple(before) if reuse else l
                if key not in alike:
                    moved = _chunk(inp, before, used, cap)
                    entry, took = None, []
                    if moved is not None:
                        col, n = moved
                        took = [(i, col[i] - before[i], room[i] == col[i] - before[i])
                                for i in range(M) if col[i] > before[i]]
                        # only receivers' attention side grows: the layer's max over the others stands
                        entry = (col, n, max([ta[l]] + [inp.attn[i] + col[i] * inp.attn_exp[i] for i, _, _ in took]),
                                 max(map(mul, col[M:], exp)))
                    alike[key] = (entry, took)
                entry, took = alike[key]
                found[l] = (before, entry, took)
            entry = found[l][1]
            if entry is not None:
                moves[l] = entry
                trial_a[l], trial_e[l] = entry[2], entry[3]
        if not any(moves):
            return current
        t = finish_each(ta, te, trial_a, trial_e, R)
        t[[k for k in range(L) if moves[k] is None]] = np.inf
        # argmin is the first smallest, as the strict ``<`` over layers in order picked it
        l = int(np.argmin(t))
        if not t[l] < current * (1 - 1e-9):
            return current
        current = float(t[l])
        col, n, ta[l], te[l] = moves[l]
        for p in range(M + N):
            used[p] += col[p] - counts[p][l]  # each expert moved frees its source, fills its receiver
            counts[p][l] = col[p]
        cols[l] = col[:]  # a new object: the layer's chunk is found afresh
        chunks.append((l, n))


def placement_from_counts(counts: list[list[int]], num_experts: int, num_attention: int) -> list[list[int]]:
    """``placement[layer][expert] -> member`` from ``counts[member][layer]``.

    Expert members take the lowest expert ids in contiguous blocks (as EP would place
    them); attention members take the highest ids: the offloaded experts.
    """
    n_members = len(counts)
    L = len(counts[0]) if counts else 0
    order = list(range(num_attention, n_members)) + list(range(num_attention))
    ordered = [counts[p] for p in order]
    out = []
    for l in range(L):
        col = [c[l] for c in ordered]
        placed = sum(col)
        if placed != num_experts:
            raise ValueError(f"layer {l}: counts place {placed} experts, expected {num_experts}")
        row: list[int] = []
        for p, c in zip(order, col):
            if c > 0:
                row += [p] * c
        out.append(row)
    return out
