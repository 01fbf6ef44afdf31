"""Expert placement from measured loads: balance predicted *time*, not token counts.

A layer's expert phase lasts as long as its slowest holder: ``max_r sum_{e on r}
cost(device_r, tokens_e)``, where ``cost`` is the device's time for one expert on that
many tokens (the cost model or a profile). :func:`balance_layer` minimises that maximum:

1. **Replicate** what moving cannot balance: while the expert with the most work per copy
   carries more than a fair share of the layer's work (work / holders) and a redundant
   slot is left, it gets one more copy (EPLB's rule: one copy at a time to the largest
   load per copy). Tokens of a replicated expert split evenly over its copies.
2. **Pack** copies, heaviest first, each onto the holder whose finish time grows to the
   smallest value (longest-processing-time on machines of different speeds), within each
   holder's capacity; ties keep a copy where it is (fewer moves), then the lowest holder.
3. **Keep** the current placement unless the new one is predicted faster: the result is
   never predicted worse than what runs now.

:func:`eplb_layer` is DeepSeek's published policy, written here from its description, as
the baseline: replicate by load per copy, then ``balanced_packing`` (sort by load, each
into the lightest holder that has room, every holder the same number of copies). It
balances token counts and knows nothing of device speed.

A layer's placement is a list, one entry per holder, of the expert ids it holds (an id may
appear on several holders: replicas). Everything is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..copy_routing import holders_of, routes_to_targets
from ..placement import moved_copies

Cost = Callable[[int, float], float]  # (holder index, tokens) -> seconds for one expert
POLICIES = ("time", "time_fill", "eplb")


@dataclass
class LayerResult:
    placement: list[list[int]]  # per holder, expert ids (replicas repeat an id)
    time: float  # predicted expert-phase time of the layer
    current_time: float
    moved: int  # expert copies that land on a holder that did not hold that expert

    @property
    def gain(self) -> float:
        return self.current_time - self.time


def copies_of(placement: list[list[int]], num_experts: int) -> list[int]:
    n = [0] * num_experts
    for held in placement:
        for e in held:
            n[e] += 1
    return n


def layer_time(placement: list[list[int]], tokens: Sequence[float], cost: Cost) -> float:
    """Expert-phase time of a layer: its slowest holder (replicas split their expert's tokens)."""
    n = copies_of(placement, len(tokens))
    return max((sum(cost(h, tokens[e] / n[e]) for e in held) for h, held in enumerate(placement)), default=0.0)


def _replicate(work: list[float], slots: int, holders: int, fill: bool = False) -> list[int]:
    """Copies per expert: one more copy at a time to the largest work per copy, while it is
    above a fair share of the layer's work (``fill``: regardless, since under local-first
    dispatch a copy also keeps its holder's own tokens at home) and redundant slots remain."""
    n = [1] * len(work)
    fair = sum(work) / max(holders, 1)
    for _ in range(slots):
        e = max(range(len(work)), key=lambda i: (work[i] / n[i] if n[i] < holders or not fill else -1.0, -i))
        if (work[e] / n[e] <= fair and not fill) or n[e] >= holders:
            break
        n[e] += 1
    return n


def balance_layer(tokens: Sequence[float], current: list[list[int]], cost: Cost, capacity: Sequence[int],
                  redundant: int = 0, fill: bool = False) -> LayerResult:
    """Time-balanced placement of one layer (see the module docstring).

    ``tokens[e]``: tokens routed to expert ``e`` per step; ``current``: what runs now;
    ``capacity[h]``: most expert copies holder ``h`` may hold; ``redundant``: extra copies
    allowed beyond one per expert (0: move only); ``fill``: spend every redundant slot."""
    H, E = len(current), len(tokens)
    if len(capacity) != H:
        raise ValueError(f"capacity has {len(capacity)} entries for {H} holders")
    if sum(capacity) < E:
        raise ValueError(f"{E} experts do not fit holders with capacity {list(capacity)}")
    now = layer_time(current, tokens, cost)
    # Work of an expert on the fastest holder: what replication weighs.
    fastest = min(range(H), key=lambda h: cost(h, max(max(tokens), 1.0)))
    work = [cost(fastest, t) for t in tokens]
    n = _replicate(work, min(redundant, sum(capacity) - E), H, fill)
    copies = sorted(((tokens[e] / n[e], e) for e in range(E) for _ in range(n[e])), key=lambda x: (-x[0], x[1]))
    load = [0.0] * H
    held: list[list[int]] = [[] for _ in range(H)]
    for t, e in copies:
        options = [h for h in range(H) if len(held[h]) < capacity[h] and e not in held[h]]
        if not options:
            return LayerResult([list(c) for c in current], now, now, 0)  # cannot place: keep what runs
        h = min(options, key=lambda h: (load[h] + cost(h, t), e not in current[h], h))
        held[h].append(e)
        load[h] += cost(h, t)
    placement = [sorted(x) for x in held]
    t_new = layer_time(placement, tokens, cost)
    if t_new >= now * (1 - 1e-9):
        return LayerResult([list(c) for c in current], now, now, 0)
    return LayerResult(placement, t_new, now, moved_copies(placement, current))


def eplb_layer(tokens: Sequence[float], current: list[list[int]], cost: Cost, redundant: int = 0) -> LayerResult:
    """DeepSeek EPLB's policy for one layer: replicate by load per copy, then balanced packing
    by token counts with the same number of copies on every holder (device speed ignored)."""
    H, E = len(current), len(tokens)
    total = E + redundant
    per_holder = math.ceil(total / H)
    n = [1] * E
    for _ in range(min(redundant, H * per_holder - E)):
        e = max(range(E), key=lambda i: (tokens[i] / n[i], -i))
        if n[e] >= H:
            break
        n[e] += 1
    copies = sorted(((tokens[e] / n[e], e) for e in range(E) for _ in range(n[e])), key=lambda x: (-x[0], x[1]))
    load = [0.0] * H
    held: list[list[int]] = [[] for _ in range(H)]
    for t, e in copies:
        options = [h for h in range(H) if len(held[h]) < per_holder and e not in held[h]]
        h = min(options, key=lambda h: (load[h], h))
        held[h].append(e)
        load[h] += t
    placement = [sorted(x) for x in held]
    now = layer_time(current, tokens, cost)
    return LayerResult(placement, layer_time(placement, tokens, cost), now, moved_copies(placement, current))


def rebalance(load_share: Sequence[Sequence[float]], tokens_per_step: float, current: list[list[list[int]]],
              cost: Cost, capacity: Sequence[int], redundant: int = 0, policy: str = "time"
              ) -> tuple[list[list[list[int]]], float, float, int]:
    """Every layer: ``(placement [layer][holder] -> ids, predicted time, current time, moves)``.

    ``load_share[l][e]`` is expert ``e``'s share of layer ``l``'s routed choices,
    ``tokens_per_step`` the choices a layer routes per step (tokens x top_k); ``policy``:
    ``time``, ``time_fill`` (every redundant slot spent) or ``eplb``."""
    if policy not in POLICIES:
        raise ValueError(f"rebalance policy={policy!r} is invalid: must be one of {POLICIES}")
    out, t_new, t_now, moves = [], 0.0, 0.0, 0
    for l, share in enumerate(load_share):
        tokens = [s * tokens_per_step for s in share]
        res = eplb_layer(tokens, current[l], cost, redundant) if policy == "eplb" \
            else balance_layer(tokens, current[l], cost, capacity, redundant, fill=policy == "time_fill")
        out.append(res.placement)
        t_new += res.time
        t_now += res.current_time
        moves += res.moved
    return out, t_new, t_now, moves


def copy_targets(held: list[list[int]], tokens: Sequence[float], cost: Cost, steps: int = 32
                 ) -> list[list[float] | None]:
    """For each expert with copies, the share of its tokens each copy (in holder order)
    serves so that the layer's slowest holder finishes earliest: the experts with one copy
    fix each holder's time, then every copied expert's tokens (largest first) are poured in
    ``steps`` equal parts, each onto the copy whose holder then finishes first (ties: the
    lowest holder). ``None`` for an expert with one copy."""
    have = holders_of(held, len(tokens))
    busy = [sum(cost(h, tokens[e]) for e in ids if len(have[e]) == 1) for h, ids in enumerate(held)]
    out: list[list[float] | None] = [None] * len(tokens)
    for e in sorted((e for e in range(len(tokens)) if len(have[e]) > 1), key=lambda e: (-tokens[e], e)):
        got = [0.0] * len(have[e])
        if tokens[e] <= 0:
            out[e] = [1.0 / len(got)] * len(got)
            continue
        part = tokens[e] / steps
        for _ in range(steps):
            grow = [cost(h, got[c] + part) - cost(h, got[c]) for c, h in enumerate(have[e])]
            c = min(range(len(got)), key=lambda c: (busy[have[e][c]] + grow[c], have[e][c]))
            busy[have[e][c]] += grow[c]
            got[c] += part
        out[e] = [g / tokens[e] for g in got]
    return out


def balanced_routes(held: list[list[int]], tokens: Sequence[float], cost: Cost, supply: Sequence[float],
                    nodes: Sequence[int] | None = None) -> list[list[list[float]] | None]:
    """Routes for one layer (:class:`~lightning_hetermoe.placement.Placement`'s ``routes``):
    each copied expert's :func:`copy_targets` reached local first, then the least loaded,
    when holder ``h`` routes ``supply[h]`` of every expert's choices
    (:func:`~lightning_hetermoe.copy_routing.routes_to_targets`)."""
    have = holders_of(held, len(tokens))
    total = sum(supply)
    share = [s / total for s in supply] if total > 0 else [1.0 / len(supply)] * len(supply)
    return [None if t is None else routes_to_targets(have[e], t, share, nodes)
            for e, t in enumerate(copy_targets(held, tokens, cost))]


def refine(placement: list[list[list[int]]], score: Callable[[list[list[list[int]]]], float],
           capacity: Sequence[int], max_passes: int = 3) -> tuple[list[list[list[int]]], float]:
    """Local search on a whole-model placement: move one expert copy at a time to another
    holder while ``score`` (a predicted step time: the simulator with measured loads, so
    transfers and the pipeline count, not just the expert phase) falls. Returns the
    placement and its score."""
    best = [[list(h) for h in layer] for layer in placement]
    t_best = score(best)
    holders = range(len(best[0]))
    for _ in range(max_passes):
        improved = False
        for l, layer in enumerate(best):
            for a in holders:
                for e in list(layer[a]):
                    for b in holders:
                        if b == a or e in layer[b] or len(layer[b]) >= capacity[b]:
                            continue
                        trial = [[list(h) for h in x] for x in best]
                        trial[l][a].remove(e)
                        trial[l][b] = sorted(trial[l][b] + [e])
                        t = score(trial)
                        if t < t_best * (1 - 1e-6):
                            best, t_best, improved = trial, t, True
                            layer = best[l]
                            break
                    else:
                        continue
                    break
        if not improved:
            break
    return best, t_best
