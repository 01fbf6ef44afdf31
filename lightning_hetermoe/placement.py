"""Where experts live under plain expert parallelism: one definition, used by the EP
strategy and by the simulator that predicts it."""

from __future__ import annotations


def contiguous_placement(num_experts: int, ep_size: int) -> list[list[int]]:
    """Split experts into ``ep_size`` contiguous runs, the first ``E % P`` ranks one longer.

    Uneven splits are allowed on purpose: 6 experts on 4 ranks is 2+2+1+1 (ranks with more
    experts do more expert work; the heterogeneity-aware planner exists to fix that).
    """
    base, extra = divmod(num_experts, ep_size)
    out, start = [], 0
    for r in range(ep_size):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out
