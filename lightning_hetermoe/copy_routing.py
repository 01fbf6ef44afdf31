"""Which copy of a replicated expert serves a token: local first, then the least loaded.

Where an expert has copies on several holders, a holder sends its own routing choices for
that expert to its own copy when it holds one (nothing travels), else to the copies on its
own node (the node's link, not the network), else over every copy; the candidates share
the choices in even runs. The rule (``RULES``: ``local_first``, or ``even``: every copy
always, DeepSeek EPLB's assumption of load / copies) is a function of the placement and
the nodes alone, fixed when the placement is adopted: each source holder applies it to
its own choices with no extra communication, and receivers learn their counts from the
dispatch's one count exchange, as before.

Local first alone makes each copy serve its own holder's choices, however slow the
holder: a V100 holding a hot expert serves its half of that expert at V100 speed. A
placement may therefore carry **routes** (:class:`~lightning_hetermoe.placement.Placement`'s
``routes``): for an expert, the share of every source's choices each copy serves. The
rebalancer computes them from a target per copy (its time-balanced share of the expert,
:func:`routes_to_targets`): a source keeps at home what its own copy is to serve, sends
what is left to copies short of their target on its node, then to those anywhere, in
proportion to what each still lacks (the least loaded first). A routed expert is served
by its table under either rule; the table is fixed with the placement, so dispatch needs
no communication beyond the count exchange.

:func:`source_split` is a source's rule for one expert (the dispatcher turns it into
tensors); :func:`expected_flows` is what the rule gives on average (the simulator and the
rebalancer price placements with it), so the prediction and the dispatch agree by
construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


RULES = ("local_first", "even")
Route = Sequence[Sequence[float]]  # [source holder][copy, in holder order] -> share of the source's choices


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


def source_split(have: Sequence[int], source: int, nodes: Sequence[int] | None = None, rule: str = "local_first",
                 route: Route | None = None) -> list[tuple[int, float]]:
    """``(holder, share)`` of ``source``'s choices for one expert, in holder order, shares
    summing to 1: the expert's ``route`` where it has one, else :func:`candidates` in even runs."""
    if route is not None:
        return [(h, float(f)) for h, f in zip(have, route[source], strict=True) if f > 0]
    who = candidates(have, source, nodes, rule)
    return [(h, 1.0 / len(who)) for h in who]


def _match(sources: Sequence[int], copies: Sequence[int], left: dict[int, float], need: dict[int, float],
           flow: list[list[float]]) -> None:
    """Move what ``sources`` have ``left`` to the ``copies`` that still ``need`` some, every
    source in proportion to what it has left and every copy to what it lacks (both updated)."""
    sources = [s for s in sources if left[s] > 1e-12]
    copies = [c for c in copies if need[c] > 1e-12]
    give, take = sum(left[s] for s in sources), sum(need[c] for c in copies)
    moved = min(give, take)
    if moved <= 0:
        return
    for s in sources:
        part = left[s] / give * moved
        for c in copies:
            flow[s][c] += part * need[c] / take
        left[s] -= part
    for c in copies:
        need[c] -= need[c] / take * moved


def routes_to_targets(have: Sequence[int], targets: Sequence[float], supply: Sequence[float],
                      nodes: Sequence[int] | None = None) -> list[list[float]]:
    """A route for one expert: ``[source][copy]`` share of the source's choices, so that the
    copy on ``have[c]`` serves ``targets[c]`` of the expert's choices when source holder ``s``
    routes ``supply[s]`` of them (both lists sum to 1). Local first up to each copy's target,
    then the node's copies short of theirs, then any (see the module docstring)."""
    H, C = len(supply), len(have)
    if len(targets) != C or any(t < 0 for t in targets) or abs(sum(targets) - 1) > 1e-6:
        raise ValueError(f"copy targets {list(targets)} must be {C} non-negative shares summing to 1")
    flow = [[0.0] * C for _ in range(H)]
    left = {s: float(a) for s, a in enumerate(supply)}
    need = {c: float(t) for c, t in enumerate(targets)}
    for c, h in enumerate(have):
        _match([h], [c], left, need, flow)
    for n in sorted(set(nodes)) if nodes is not None else ():
        _match([s for s in range(H) if nodes[s] == n], [c for c in range(C) if nodes[have[c]] == n], left, need, flow)
    _match(range(H), range(C), left, need, flow)
    out = []
    for s in range(H):
        total = sum(flow[s])
        # a source that routes nothing is given the targets (any split serves it)
        out.append([f / total for f in flow[s]] if total > 0 else [float(t) for t in targets])
    return out


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
                   nodes: Sequence[int] | None = None, rule: str = "local_first",
                   routes: Sequence[Route | None] | None = None) -> Flows:
    """The traffic of ``rule`` when holder ``h`` routes ``choices[h]`` choices (tokens x
    top_k) and expert ``e`` takes ``share[e]`` of every holder's choices; ``routes[e]``: the
    expert's route where the placement gives one. ``rows[src][dst]`` as well, for pricing
    links by node."""
    H = len(held)
    have = holders_of(held, len(share))
    served: list[dict[int, float]] = [{e: 0.0 for e in ids} for ids in held]
    rows = [[0.0] * H for _ in range(H)]
    for src in range(H):
        if choices[src] <= 0:
            continue
        for e, s in enumerate(share):
            if s <= 0:
                continue
            for h, f in source_split(have[e], src, nodes, rule, routes[e] if routes is not None else None):
                r = choices[src] * s * f
                served[h][e] += r
                rows[src][h] += r
    sent = [sum(r for h, r in enumerate(row) if h != src) for src, row in enumerate(rows)]
    received = [sum(rows[src][h] for src in range(H) if src != h) for h in range(H)]
    return Flows(served, sent, received, rows)
