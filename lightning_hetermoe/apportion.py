"""Whole units split in proportion: sequences over ranks, over micro-batches, elements
over shards. The planner, the simulator and the backends split batches with these, so
that what runs is what was planned and priced."""

from __future__ import annotations

import math
from typing import Sequence


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` whole units in proportion to ``weights`` (largest remainder)."""
    if total < 0 or not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"apportion: cannot split {total} over weights {list(weights)}")
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [math.floor(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def apportion_alike(total: int, blocks: Sequence[tuple[float, int]]) -> list[tuple[int, int]]:
    """:func:`apportion` over units laid out block by block, every unit of a block alike
    (``blocks``: ``(weight, units)``), without working unit by unit: per block, its units'
    share and how many of them (its first) take one more. The same split as ``apportion`` of
    the flat weights, to the unit: a block's units have one remainder, so the largest
    remainders go block by block, ties to the earlier block (its units come first)."""
    flat: list[float] = []
    for w, n in blocks:
        flat += [w] * n
    if total < 0 or not flat or any(w < 0 for w, _ in blocks) or sum(flat) <= 0:
        raise ValueError(f"apportion: cannot split {total} over weights {list(blocks)}")
    s = sum(flat)  # summed unit by unit, as apportion does: the same float
    raw = [total * w / s for w, _ in blocks]
    base = [math.floor(x) for x in raw]
    left = total - sum(b * n for b, (_, n) in zip(base, blocks))
    plus = [0] * len(blocks)
    for i in sorted(range(len(blocks)), key=lambda i: (-(raw[i] - base[i]), i)):
        plus[i] = min(blocks[i][1], left)
        left -= plus[i]
    return list(zip(base, plus))


def split_microbatches(n_seqs: int, R: int) -> list[int]:
    """``n_seqs`` whole sequences over ``R`` micro-batches, sizes differing by at most one
    (the first ones take the remainder)."""
    base, extra = divmod(n_seqs, R)
    return [base + (1 if j < extra else 0) for j in range(R)]
