"""Expert parallelism with copies of experts, priced as the dispatcher serves them.

Where a layer keeps copies of an expert (the rebalancer's ``redundant_experts``), which copy
serves a token follows the run's rule (:mod:`lightning_hetermoe.copy_routing`: local first
or even), or the placement's route for that expert: a rank's choices for an expert it holds
never travel under local first without a route. The
rows each rank sends and receives, and the tokens each copy serves, come from
:func:`~lightning_hetermoe.copy_routing.expected_flows` on the measured loads, rank by rank
(lanes are expanded: copies make ranks differ), so the prediction is the dispatch's own rule.
"""

from __future__ import annotations

from ..copy_routing import Flows, expected_flows


def replicated(setup, layer: int) -> bool:
    """An EP setup with measured loads whose ``layer`` keeps copies of some expert."""
    return setup.schedule is None and setup.expert_load is not None and any(n > 1 for n in setup.copies(layer))


def _holders(setup) -> list[tuple[int, int]]:
    """``(rank, lane index)`` of every rank, in rank order: the EP group's holder order (a
    setup is one EP group; the others are its replicas, :func:`~.schedules.ep_setup`)."""
    return sorted((r, i) for i, lane in enumerate(setup.lanes) for r in lane.ranks)


def flows(setup, layer: int, tokens: list[float]) -> Flows:
    """``tokens[i]``: lane ``i``'s tokens in the round."""
    holders = _holders(setup)
    k = setup.model.moe.top_k
    held = [setup.lanes[i].expert_ids[layer] for _, i in holders]
    nodes = [setup.topology.node_of[r] for r, _ in holders]
    routes = setup.copy_routes[layer] if setup.copy_routes is not None else None
    if routes is not None and any(r is not None and len(r) != len(holders) for r in routes):
        routes = None  # routes for another group size than the setup's: the rule alone is priced
    return expected_flows(held, setup.expert_load[layer], [tokens[i] * k for _, i in holders], nodes,
                          setup.replica_dispatch, routes)


def expert_tokens(setup, lane_index: int, layer: int, tokens: list[float]) -> list[float]:
    """Tokens each expert of the lane's (first) rank serves."""
    lane = setup.lanes[lane_index]
    h = [r for r, _ in _holders(setup)].index(lane.ranks[0])
    served = flows(setup, layer, tokens).served[h]
    return [served[e] for e in lane.expert_ids[layer]]


def legs(setup, layer: int, tokens: list[float]):
    """As :func:`~.step.exchange_legs`: inside each node its busiest rank's rows to and from
    the node's other ranks over the node's link; across nodes each node's rows in or out
    over the network. Returns the legs and the rows that cross the network."""
    topo = setup.topology
    f = flows(setup, layer, tokens)
    ranks = [r for r, _ in _holders(setup)]
    node = [topo.node_of[r] for r in ranks]
    n_nodes = topo.num_nodes
    intra, out, inn = [0.0] * n_nodes, [0.0] * n_nodes, [0.0] * n_nodes
    for a, row in enumerate(f.rows):
        near_out = sum(x for b, x in enumerate(row) if b != a and node[b] == node[a])
        near_in = sum(f.rows[b][a] for b in range(len(ranks)) if b != a and node[b] == node[a])
        intra[node[a]] = max(intra[node[a]], near_out, near_in)
        for b, x in enumerate(row):
            if node[b] != node[a]:
                out[node[a]] += x
                inn[node[b]] += x
    result = [(rows, topo.links[n]) for n, rows in enumerate(intra) if rows > 0]
    result += [(max(o, i), topo.network) for o, i in zip(out, inn) if max(o, i) > 0]
    return result, sum(out)
