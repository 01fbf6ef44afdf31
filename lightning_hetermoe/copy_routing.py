"""Which copy of a replicated expert serves a token: local first.

Where an expert has copies on several holders, a holder sends its own routing choices for
that expert to its own copy when it holds one (nothing travels), else to the copies on its
own node (the node's link, not the network), else over every copy; the candidates share
the choices in even runs. The rule (``RULES``: ``local_first``, or ``even``: every copy
always, DeepSeek EPLB's assumption of load / copies) is a function of the placement and
the nodes alone, fixed when the placement is adopted: each source holder applies it to
its own choices with no extra communication, and receivers learn their counts from the
dispatch's one count exchange, as before. With equal batch shares a copy serves
``load / copies`` either way; local first only keeps rows at home.

:func:`candidates` is the rule (the dispatcher turns it into tensors); :func:`expected_flows`
is what it gives on average (the simulator and the rebalancer price placements with it), so
the prediction and the dispatch agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


RULES = ("local_first", "even")


def holders_of(held: Sequence[Sequence[int]], num_experts: int) -> list[list[int]]:
    """``[expert] -> holders of a copy``, in holder order; every expert must have one."""
    have: list[list[int]] = [[] for _ in range(num_experts)]
    for h, ids in enumerate(held):
        for e in ids:
            have[e].append(h)
    missing = [e for e, x in enumerate(have) if not x]
    if missing:
        raise ValueError(f"experts {missing} are held by no holder of {[list(x) for x in held]}")
    return have


def candidates(have: Sequence[int], source: int, nodes: Sequence[int] | None = None, rule: str = "local_first"
               ) -> list[int]:
    """Of the holders ``have`` of an expert's copies, those that serve ``source``'s choices:
    itself if it holds a copy, else those on its node, else all (``rule="even"``: all)."""
    if rule not in RULES:
        raise ValueError(f"replica dispatch rule {rule!r} is invalid: must be one of {RULES}")
    if rule == "even":
        return list(have)
    if source in have:
        return [source]
    if nodes is not None:
        near = [h for h in have if nodes[h] == nodes[source]]
        if near:
            return near
    return list(have)


@dataclass
class Flows:
    """Expected traffic of one layer's exchange. ``served[h][e]``: routed choices expert
    ``e``'s copy on holder ``h`` processes; ``sent[h]`` / ``received[h]``: choices that
    leave / reach holder ``h`` (its own choices for its own copies stay)."""

    served: list[dict[int, float]]
    sent: list[float]
    received: list[float]
    rows: list[list[float]]  # [src][dst] choices, the diagonal kept at home


def expected_flows(held: Sequence[Sequence[int]], share: Sequence[float], choices: Sequence[float],
                   nodes: Sequence[int] | None = None, rule: str = "local_first") -> Flows:
    """The traffic of ``rule`` when holder ``h`` routes ``choices[h]`` choices (tokens x
    top_k) and expert ``e`` takes ``share[e]`` of every holder's choices. ``rows[src][dst]``
    as well, for pricing links by node."""
    H = len(held)
    have = holders_of(held, len(share))
    served: list[dict[int, float]] = [{e: 0.0 for e in ids} for ids in held]
    rows = [[0.0] * H for _ in range(H)]
    for src in range(H):
        if choices[src] <= 0:
            continue
        for e, s in enumerate(share):
            who = candidates(have[e], src, nodes, rule) if s > 0 else []
            for h in who:
                r = choices[src] * s / len(who)
                served[h][e] += r
                rows[src][h] += r
    sent = [sum(r for h, r in enumerate(row) if h != src) for src, row in enumerate(rows)]
    received = [sum(rows[src][h] for src in range(H) if src != h) for h in range(H)]
    return Flows(served, sent, received, rows)
