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
    a_done = []
    for back in prev_e:
        a_end = max(a_end, back) + ta_l
        a_done.append(a_end)
    for j, a in enumerate(a_done):
        e_end = max(e_end, a) + te_l
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


def _side_times(inp: AsymEAInput, counts: list[list[int]]) -> tuple[list[float], list[float]]:
    M = len(inp.attn)
    ta, te = [], []
    for l in range(inp.num_layers):
        ta.append(max(inp.attn[i] + counts[i][l] * inp.attn_exp[i] for i in range(M)))
        te.append(max((counts[M + i][l] * inp.exp[i] for i in range(len(inp.exp))), default=0.0))
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
    # Per layer, a heap of each side's members by the time they would reach with one more
    # expert; a member whose room ran out is dropped when it surfaces (room only shrinks here).
    def cost(p: int, l: int) -> float:
        return (counts[p][l] + 1) * inp.exp[p - M] if p >= M else inp.attn[p] + (counts[p][l] + 1) * inp.attn_exp[p]

    def heaps(members: range) -> list[list[tuple[float, int]]]:
        out = []
        for l in range(L):
            h = [(cost(p, l), p) for p in members]
            heapq.heapify(h)
            out.append(h)
        return out

    def pop_with_room(h: list[tuple[float, int]]) -> int | None:
        while h and used[h[0][1]] >= cap[h[0][1]]:
            heapq.heappop(h)
        return heapq.heappop(h)[1] if h else None

    n_min = 0
    on_experts, on_attention = heaps(range(M, M + N)), None
    for e in range(E):
        for l in range(L):
            p = pop_with_room(on_experts[l])
            if p is None:  # expert ranks are full: this expert must move (counts toward n_min)
                n_min += 1
                on_attention = on_attention or heaps(range(M))
                p = pop_with_room(on_attention[l])
                if p is None:
                    raise ValueError(f"experts exceed total memory: no member of the ZP group has room for expert "
                                     f"{e} of layer {l}; add ranks or use more memory-rich GPUs")
            counts[p][l] += 1
            used[p] += 1
            heapq.heappush(on_experts[l] if p >= M else on_attention[l], (cost(p, l), p))
    return counts, used, n_min


def _chunk(inp: AsymEAInput, col: list[int], used: list[int], cap: list[int]
           ) -> tuple[list[int], list[int], int] | None:
    """One chunk of a layer moved (gather and squeeze) from the layer's member counts
    ``col``: the new counts, members' room used, experts moved; ``None`` where the
    attention members have no room for it."""
    M, N = len(inp.attn), len(inp.exp)
    col = col[:]
    loads = [col[M + i] * inp.exp[i] for i in range(N)]
    top = max(loads)
    if top <= 0:
        return None
    gather = [M + i for i in range(N) if col[M + i] > 0 and loads[i] >= top * (1 - 1e-9)]
    # squeeze: each gathered expert to the attention member whose time grows least
    # (a heap of the members with room: only the receiver's cost changes per move)
    trial_used = used[:]
    room = [(inp.attn[i] + (col[i] + 1) * inp.attn_exp[i], i) for i in range(M) if trial_used[i] < cap[i]]
    heapq.heapify(room)
    for src in gather:
        if not room:
            return None
        dst = heapq.heappop(room)[1]
        col[src] -= 1
        col[dst] += 1
        trial_used[src] -= 1
        trial_used[dst] += 1
        if trial_used[dst] < cap[dst]:
            heapq.heappush(room, (inp.attn[dst] + (col[dst] + 1) * inp.attn_exp[dst], dst))
    return col, trial_used, len(gather)


def _offload(inp: AsymEAInput, counts: list[list[int]], used: list[int], R: int, current: float,
             chunks: list[tuple[int, int]], reuse: bool = True) -> float:
    """Greedily move the chunk that lowers the forward makespan most, until none does;
    ``counts``, ``used`` and ``chunks`` are updated in place. Returns the final makespan.

    A layer's chunk depends on its own column and on the attention members' room only
    where the squeeze ran into it: a member that took ``g`` of the chunk and still had room
    takes the same with any room >= ``g``; one that filled up, only with the same room.
    Where the layer's column is unchanged and every member's room passes, the chunk is the
    one found before (``reuse=False``: found afresh each round, the reference)."""
    L, M, N = inp.num_layers, len(inp.attn), len(inp.exp)
    cap = _capacity(inp)
    ta, te = _side_times(inp, counts)
    cols = [[counts[p][l] for p in range(M + N)] for l in range(L)]
    found: dict[int, tuple] = {}

    # An attention member's room only shrinks here (chunks go from expert members to
    # attention members), so a member that took none of a chunk takes none again: only
    # those that took some are checked.
    def still(took: list[tuple[int, int, bool]], room: list[int]) -> bool:
        return all(room[i] == g if f else room[i] >= g for i, g, f in took)

    while True:
        best_move = None
        room = [max(cap[i] - used[i], 0) for i in range(M)]
        states = pipeline_states(ta, te, R)
        for l in range(L):
            before = cols[l]
            hit = found.get(l) if reuse else None
            if hit is None or hit[0] is not before or not still(hit[2], room):
                moved = _chunk(inp, before, used, cap)
                entry, took = None, []
                if moved is not None:
                    col, _, n = moved
                    took = [(i, col[i] - before[i], room[i] == col[i] - before[i])
                            for i in range(M) if col[i] > before[i]]
                    # only receivers' attention side grows: the layer's max over the others stands
                    entry = (col, n, max([ta[l]] + [inp.attn[i] + col[i] * inp.attn_exp[i] for i, _, _ in took]),
                             max(col[M + i] * inp.exp[i] for i in range(N)))
                found[l] = (before, entry, took)
            entry = found[l][1]
            if entry is None:
                continue
            col, n, ta_l, te_l = entry
            t = _finish(states[l], ta, te, l, ta_l, te_l)
            if t < current * (1 - 1e-9) and (best_move is None or t < best_move[0]):
                best_move = (t, l, col, n, ta_l, te_l)
        if best_move is None:
            return current
        current, l, col, n, ta[l], te[l] = best_move
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
    out = []
    for l in range(L):
        placed = sum(counts[p][l] for p in range(n_members))
        if placed != num_experts:
            raise ValueError(f"layer {l}: counts place {placed} experts, expected {num_experts}")
        row: list[int] = []
        for p in order:
            row += [p] * counts[p][l]
        out.append(row)
    return out
