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


def split_microbatches(n_seqs: int, R: int) -> list[int]:
    """``n_seqs`` whole sequences over ``R`` micro-batches, sizes differing by at most one
    (the first ones take the remainder)."""
    base, extra = divmod(n_seqs, R)
    return [base + (1 if j < extra else 0) for j in range(R)]
