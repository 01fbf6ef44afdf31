"""Which expert goes where, at a measured routing.

Asym-EA decides how many experts each member of a ZP group holds per layer; it assumes
even routing, so which ids those are does not matter to it and they are handed out in id
order. Where the routing is known and lasting (an earlier run's ``expert_load.json``, or a
trained model's), the ids matter: a hot expert on a slow member sets the layer's pace.
:func:`place_at_load` swaps experts between members (each keeps its count, so its memory)
and, given ``room``, moves one to a member with memory to spare, while a layer's time by
this measure falls:

    max over members of (base[m] + sum over its experts of cost(m, tokens of e))

``base[m]`` is what the member does besides its experts in that layer (its attention under
zebra, where attention and experts overlap; nothing where they take turns), ``cost`` the
member's device on one expert's tokens, forward and backward. Each round takes the best
swap or move off the busiest member (all priced at once), until none lowers the maximum
or, where members are level at the top, evens them out. It starts twice, from id order and
from a greedy fill, and keeps the better. The planner keeps the result only where the
simulator, on the whole step, agrees.

The routing of a freshly initialised model is not such a routing: it drifts as soon as the
model trains. On the tiny model of ``bench/schedules.py``, at three seeds, placements fitted
to the warm-up routing left predictions up to 13% short of the routing two optimizer steps
later on L40S+T4 (id order: up to 7%). So the strategy places at warm-up routing only when
asked (``place_at_load``), and by default at a record.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Cost = Callable[[int, float], float]  # (member, tokens) -> seconds of one expert, forward and backward


def place_at_load(placement: list[list[int]], load: Sequence[Sequence[float]], base: Sequence[float], cost: Cost,
                  choices: float, room: Sequence[int] | None = None, max_rounds: int | None = None
                  ) -> list[list[int]]:
    """``placement[layer][expert] -> member`` with the ids swapped to lower every layer's
    busiest member; ``load[layer][expert]`` is each expert's share of the layer's
    ``choices`` routed tokens (per ZP group and step). Each member keeps its count per
    layer, unless ``room`` says how many more experts each may hold (all layers together):
    then an expert may also move to a member with room."""
    members = len(base)
    base_t = np.asarray(base, dtype=float)
    left = None if room is None else np.asarray(room, dtype=int).copy()
    out = []
    for l, row in enumerate(placement):
        tokens = [float(s) * choices for s in load[l]]
        # seconds of expert e on member m
        C = np.array([[cost(m, t) if t > 0 else 0.0 for t in tokens] for m in range(members)])
        start = np.asarray(row, dtype=int)
        # two starts, each improved: id order (the plan's as it is) and a greedy fill (hottest
        # expert first, each to the member it leaves least busy): a move at a time can stop
        # short of the best, and the two stop short in different places
        tried = [_improve(start, base_t, C, None if left is None else left.copy(), max_rounds),
                 _improve(_greedy(np.bincount(start, minlength=members), base_t, C, tokens), base_t, C,
                          None if left is None else left.copy(), max_rounds)]
        best, best_left = min(tried, key=lambda t: _rank(_times(t[0], base_t, C)))
        if _times(best, base_t, C).max() < _times(start, base_t, C).max() * (1 - 1e-12):
            out.append(best.tolist())
            left = best_left
        else:
            out.append(list(row))
    return out


def _rank(T: np.ndarray) -> tuple[float, float]:
    """The busiest member first, then how even the members are."""
    return float(T.max()), float((T ** 2).sum())


def _times(pl: np.ndarray, base: np.ndarray, C: np.ndarray) -> np.ndarray:
    T = base.copy()
    np.add.at(T, pl, C[pl, np.arange(len(pl))])
    return T


def _greedy(counts: np.ndarray, base: np.ndarray, C: np.ndarray, tokens: list[float]) -> np.ndarray:
    T, left = base.copy(), counts.copy()
    pl = np.zeros(len(tokens), dtype=int)
    for e in sorted(range(len(tokens)), key=lambda e: (-tokens[e], e)):
        m = min((m for m in range(len(T)) if left[m]), key=lambda m: (T[m] + C[m, e], m))
        pl[e], T[m], left[m] = m, T[m] + C[m, e], left[m] - 1
    return pl


def _improve(pl: np.ndarray, base: np.ndarray, C: np.ndarray, room: np.ndarray | None, max_rounds: int | None
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """Swaps (and, with ``room``, moves to a member with room), the best each round, while
    the busiest member's time falls or, level with it, the members even out (two members
    level at the top can then both come down). Returns the placement and the room left."""
    pl = pl.copy()
    E = len(pl)
    experts = np.arange(E)
    for _ in range(max_rounds or 2 * E):
        T = _times(pl, base, C)
        # only what takes an expert off the busiest member can lower the maximum (or, level
        # with it, even it out): its experts against every other member's, or to a member
        top = int(np.argmax(T))
        mine, theirs = experts[pl == top], experts[pl != top]
        if not len(mine):
            break
        I, J = np.repeat(mine, len(theirs)), np.tile(theirs, len(mine))
        b = pl[J]
        # swap: the two members' times after e_i and e_j trade places
        ta = T[top] - C[top, I] + C[top, J]
        tb = T[b] - C[b, J] + C[b, I]
        dest = np.flatnonzero(room > 0) if room is not None else np.zeros(0, dtype=int)
        dest = dest[dest != top]
        Im, Bm = np.repeat(mine, len(dest)), np.tile(dest, len(mine))
        # move: e_i alone to a member with room
        ta = np.concatenate([ta, T[top] - C[top, Im]])
        tb = np.concatenate([tb, T[Bm] + C[Bm, Im]])
        b = np.concatenate([b, Bm])
        if not len(b):
            break
        after = np.maximum(np.maximum(ta, tb), _others(T, np.full(len(b), top), b))
        spread = (T ** 2).sum() - T[top] ** 2 - T[b] ** 2 + ta ** 2 + tb ** 2
        peak, tol = T[top], 1e-9 * T[top]
        better = after < peak - tol
        if (T >= peak - tol).sum() > 1:  # level at the top: a swap that lowers neither may still pay
            better |= (after <= peak + tol) & (spread < (T ** 2).sum() * (1 - 1e-9))
        if not better.any():
            break
        k = int(np.lexsort((spread, np.where(better, after, np.inf)))[0])
        if k < len(I):
            pl[I[k]], pl[J[k]] = pl[J[k]], top
        else:
            e, to = Im[k - len(I)], Bm[k - len(I)]
            pl[e] = to
            room[to] -= 1
            room[top] += 1
    return pl, room


def _others(T: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per pair, the busiest member but the two that trade: the first of the three busiest
    that is neither."""
    top = np.argsort(-T, kind="stable")[:3]
    out = np.full(len(a), -np.inf)
    for m in top[::-1]:  # the busiest last: it wins wherever it is not one of the pair
        out = np.where((a != m) & (b != m), T[m], out)
    return out
