"""A large cluster as k alike copies of a smaller one, for the planner's search.

A cluster of a few kinds of GPU, bought in round numbers, is often k copies of a smaller
cluster: every kind of node (its devices and its link) appears a multiple of k times. A plan
of the small copy, repeated k times (k times its ZP groups, each with the same ranks), is a
plan of the whole, and the groups are data-parallel replicas. So the whole plans at least as
fast per GPU as one copy does, where the copy's plan is searched finely; on hundreds of ranks
the search of the whole can only sample the role splits (a grid, the kinds' boundaries), and
then lands on a worse split than the copy's (Qwen3-30B-A3B on 1,024 GPUs with free
transfers: 64% of the throughput bound, its 64-GPU copy's plan 82%).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any

from ..cluster.topology import Topology

# The copies the whole is planned from: the smallest with at least each of COPY_RANKS ranks
# (a small copy's search tries every role split and wave count; a kind that attends in part
# needs enough of it in a copy), and the largest whose own search still runs whole
# (FULL_SEARCH_RANKS, where memory asks for bigger ZP groups than the small copies have).
COPY_RANKS = (16, 64)
FULL_SEARCH_RANKS = 256
# Fewer ranks are searched whole, without copies: up to the planner's MAX_SPLITS (48) its
# search tries every role split itself.
MIN_RANKS = 49
# A copy of this many or fewer per cluster (a quarter of it or more) tried ZP groups as large
# as the whole's best plans have: its plan stands in for the whole's search.
STANDS_IN_COPIES = 4


def _kinds(view: Any) -> list:
    """Each unit's kind: per device its name (one node), or per node its devices and link."""
    topo = view.topology
    if topo.num_nodes == 1:
        return [d.name for d in view.devices]
    on: list[list[str]] = [[] for _ in range(topo.num_nodes)]
    for r, n in enumerate(topo.node_of):  # one pass: thousands of nodes, each asked for its ranks, is quadratic
        on[n].append(view.devices[r].name)
    return [(tuple(names), (x.bandwidth_gbps, x.latency_us, x.kind)) for names, x in zip(on, topo.links, strict=True)]


def copy_counts(view: Any, total_seqs: int) -> list[int]:
    """How many copies to plan the cluster from (each ``k``, largest first: the smallest
    copies): for each of :data:`COPY_RANKS` the most copies with at least that many ranks
    each, and on more than :data:`FULL_SEARCH_RANKS` ranks the fewest with at most that
    many; each ``k`` divides every kind's count and the batch's ``total_seqs``. Empty where
    the cluster has fewer than :data:`MIN_RANKS` ranks or does not split."""
    W = len(view.devices)
    if W < MIN_RANKS:
        return []
    g = math.gcd(*Counter(_kinds(view)).values())
    ks = [k for k in range(2, g + 1) if g % k == 0 and total_seqs % k == 0]
    picks = {max((k for k in ks if W // k >= least), default=1) for least in COPY_RANKS}
    if W > FULL_SEARCH_RANKS:  # else the whole cluster's own search runs whole
        picks.add(min((k for k in ks if W // k <= FULL_SEARCH_RANKS), default=1))
    return sorted((k for k in picks if k > 1), reverse=True)


def stands_in(view: Any, ks: list[int]) -> bool:
    """Whether the copies' plans stand in for the search of the whole cluster: on more than
    :data:`FULL_SEARCH_RANKS` ranks, where one copy of ``ks`` holds a quarter of them or
    more (:data:`STANDS_IN_COPIES`). With smaller copies only (10,000 GPUs make copies of
    16, 80 and 200) the whole is searched too: its best plans there have other groups."""
    return len(view.devices) > FULL_SEARCH_RANKS and any(k <= STANDS_IN_COPIES for k in ks)


def one_copy(view: Any, k: int) -> Any:
    """One of the ``k`` copies: the first ``1/k`` of each kind of device (one node) or of
    each kind of node (several), in rank order, on the same links and network."""
    topo = view.topology
    kinds = _kinds(view)
    left = {key: c // k for key, c in Counter(kinds).items()}
    units = []  # the devices (one node) or nodes the copy keeps
    for u, key in enumerate(kinds):
        if left[key] > 0:
            units.append(u)
            left[key] -= 1
    if topo.num_nodes == 1:
        return replace(view, name=f"{view.name}/{k}", devices=[view.devices[r] for r in units],
                       topology=Topology.flat(topo.links[0], len(units)))
    index = {n: i for i, n in enumerate(units)}
    ranks = [r for r in range(len(view.devices)) if topo.node_of[r] in index]
    names = tuple(topo.names[n] for n in units) if topo.names else ()
    return replace(view, name=f"{view.name}/{k}", devices=[view.devices[r] for r in ranks],
                   topology=Topology(node_of=tuple(index[topo.node_of[r]] for r in ranks),
                                     links=tuple(topo.links[n] for n in units), network=topo.network, names=names))
