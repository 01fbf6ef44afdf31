"""Local-first replica dispatch as the simulator and the rebalancer price it: the expected
flows against a naive count, and the simulator's EP step with copies priced by them."""

from __future__ import annotations

import random

import pytest

from lightning_hetermoe.copy_routing import expected_flows


def by_hand(held, share, choices, nodes):
    """Every (source, expert) by the rule's words: own copy, else copies on the node, else all."""
    served = [{e: 0.0 for e in h} for h in held]
    rows = [[0.0] * len(held) for _ in held]
    for src in range(len(held)):
        for e, s in enumerate(share):
            copies = [h for h in range(len(held)) if e in held[h]]
            if e in held[src]:
                copies = [src]
            elif any(nodes[h] == nodes[src] for h in copies):
                copies = [h for h in copies if nodes[h] == nodes[src]]
            for h in copies:
                served[h][e] += choices[src] * s / len(copies)
                rows[src][h] += choices[src] * s / len(copies)
    return served, rows


def random_copies(rng, H, E):
    """Each expert on 1..H random holders."""
    held = [[] for _ in range(H)]
    for e in range(E):
        for h in rng.sample(range(H), rng.randint(1, H)):
            held[h].append(e)
    return held


@pytest.mark.parametrize("seed", range(5))
def test_flows_follow_the_rule_and_keep_every_choice(seed):
    rng = random.Random(seed)
    H, E = rng.randint(2, 5), rng.randint(4, 9)
    held = random_copies(rng, H, E)
    share = [rng.random() for _ in range(E)]
    share = [s / sum(share) for s in share]
    choices = [rng.randint(0, 100) * 1.0 for _ in range(H)]
    nodes = [rng.randint(0, 1) for _ in range(H)]
    f = expected_flows(held, share, choices, nodes)
    served, rows = by_hand(held, share, choices, nodes)
    for h in range(H):
        assert f.served[h] == pytest.approx(served[h]) and f.rows[h] == pytest.approx(rows[h])
    assert sum(sum(x.values()) for x in f.served) == pytest.approx(sum(choices))
    for h in range(H):  # a holder's own choices for its own copies never leave it
        assert f.rows[h][h] == pytest.approx(choices[h] * sum(share[e] for e in held[h]))
    even = expected_flows(held, share, choices, nodes, rule="even")
    assert sum(even.sent) >= sum(f.sent) - 1e-9


def test_simulated_ep_step_prices_copies_by_the_dispatch_rule():
    from lightning_hetermoe.cluster.devices import get_device
    from lightning_hetermoe.cluster.spec import LinkConfig
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.profile.timer import make_timer
    from lightning_hetermoe.simulate import ep_setup, simulate_step

    model = ModelConfig(d_model=1024, n_layers=2, n_heads=8, max_seq_len=4096, moe=MoEConfig(num_experts=4, d_ff=2048))
    timer = make_timer(model, 4096)
    devs = [get_device("a40"), get_device("v100")]
    load = [[0.4, 0.4, 0.1, 0.1]] * 2
    held = [[0, 1, 2], [0, 1, 3]]  # the two hot experts on both ranks

    def step(rule, keep=True):
        setup = ep_setup(devs, model, seq_len=4096, total_seqs=4, link=LinkConfig(bandwidth_gbps=100.0), timer=timer,
                         num_microbatches=1, expert_load=load)
        setup.replica_dispatch = rule
        for lane in setup.lanes:
            lane.expert_ids = [list(held[lane.ranks[0]])] * 2
            lane.experts = [3, 3]
        return simulate_step(setup, timer, "ep", keep_timeline=True), setup

    (lf, setup), (ev, _) = step("local_first"), step("even")
    moved = {}
    for res, name in ((lf, "lf"), (ev, "even")):
        tl = res.timeline
        moved[name] = sum(e - s for t, s, e in zip(tl.tasks, tl.start, tl.end) if t.kind == "dispatch")
    # local first: each rank sends only its choices for the one expert it lacks (0.1 of
    # them); even: half of its choices for the shared hot experts travel too (0.5)
    tokens = 2 * 4096 * model.moe.top_k
    assert setup.exchange(0, [2 * 4096, 2 * 4096])[0][0][0] == pytest.approx(tokens * 0.1)
    assert moved["lf"] < moved["even"]
    assert lf.step_time < ev.step_time


@pytest.mark.parametrize("seed", range(6))
def test_routes_reach_their_targets_local_first_then_the_node(seed):
    from lightning_hetermoe.copy_routing import routes_to_targets

    rng = random.Random(seed)
    H = rng.randint(2, 6)
    have = sorted(rng.sample(range(H), rng.randint(2, H)))
    targets = [rng.random() + 0.01 for _ in have]
    targets = [t / sum(targets) for t in targets]
    supply = [rng.random() * (seed % 2 or h in have) for h in range(H)]  # odd seeds: non-holders route too
    supply = [s / sum(supply) for s in supply]
    nodes = [rng.randint(0, 1) for _ in range(H)]
    route = routes_to_targets(have, targets, supply, nodes)
    flow = [[supply[s] * f for f in route[s]] for s in range(H)]
    for s in range(H):
        assert sum(route[s]) == pytest.approx(1.0) and min(route[s]) >= 0
    for c, h in enumerate(have):
        assert sum(flow[s][c] for s in range(H)) == pytest.approx(targets[c]), "every copy serves its target"
        # a holder keeps at home what its copy is to serve, up to what it has
        assert flow[h][c] == pytest.approx(min(supply[h], targets[c]))
    for s in range(H):
        crossed = any(flow[s][c] > 1e-9 and nodes[h] != nodes[s] for c, h in enumerate(have))
        for c, h in enumerate(have):
            if crossed and nodes[h] == nodes[s]:  # sent off its node only once its node's copies were full
                assert sum(flow[x][c] for x in range(H)) == pytest.approx(targets[c])


def by_hand_routed(held, share, choices, routes):
    served = [{e: 0.0 for e in h} for h in held]
    for src in range(len(held)):
        for e, s in enumerate(share):
            have = [h for h in range(len(held)) if e in held[h]]
            if routes[e] is None:
                copies = [src] if e in held[src] else have
                split = {h: 1 / len(copies) for h in copies}
            else:
                split = dict(zip(have, routes[e][src]))
            for h, f in split.items():
                served[h][e] += choices[src] * s * f
    return served


@pytest.mark.parametrize("seed", range(4))
def test_flows_follow_routes_where_the_placement_has_them(seed):
    from lightning_hetermoe.copy_routing import holders_of, routes_to_targets

    rng = random.Random(10 + seed)
    H, E = rng.randint(2, 4), rng.randint(3, 7)
    held = random_copies(rng, H, E)
    share = [rng.random() for _ in range(E)]
    share = [s / sum(share) for s in share]
    choices = [float(rng.randint(1, 50)) for _ in range(H)]
    routes = []
    for e, have in enumerate(holders_of(held, E)):
        if len(have) > 1 and rng.random() < 0.7:
            t = [rng.random() + 0.1 for _ in have]
            routes.append(routes_to_targets(have, [x / sum(t) for x in t], [c / sum(choices) for c in choices]))
        else:
            routes.append(None)
    f = expected_flows(held, share, choices, routes=routes)
    expected = by_hand_routed(held, share, choices, routes)
    for h in range(H):
        assert f.served[h] == pytest.approx(expected[h])
    assert sum(sum(x.values()) for x in f.served) == pytest.approx(sum(choices))


def test_split_over_copies_cuts_runs_of_the_shares():
    from fractions import Fraction

    import torch

    from lightning_hetermoe.moe.dispatch import SHARE_UNITS, split_over_copies

    g = torch.Generator().manual_seed(0)
    T, k, E = 50, 2, 3
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    keep = torch.rand(T, k, generator=g) > 0.2
    shares = [[Fraction(1, 3)] * 3, [Fraction(1, 4), Fraction(3, 4)], [Fraction(1)]]  # even, uneven, one copy
    position = torch.tensor([[10 * e + c for c in range(3)] for e in range(E)])
    start = torch.tensor([[int(sum(s[:c]) * SHARE_UNITS) if c < len(s) else SHARE_UNITS for c in range(3)]
                          for s in shares])
    got = split_over_copies(indices, keep, position, start)
    n = [int(((indices == e) & keep).sum()) for e in range(E)]
    seen = [0] * E
    for t in range(T):
        for j in range(k):
            e = int(indices[t, j])
            if not keep[t, j]:
                continue
            i, c = seen[e], 0
            while c + 1 < len(shares[e]) and Fraction(i, n[e]) >= sum(shares[e][:c + 1]):
                c += 1
            assert int(got[t, j]) == 10 * e + c, (t, j)
            seen[e] += 1
    served = [[int((got[keep] == 10 * e + c).sum()) for c in range(len(shares[e]))] for e in range(E)]
    for e in range(E):  # runs as long as the shares, to within one choice
        assert all(abs(s - n[e] * f) < 1 for s, f in zip(served[e], shares[e]))


def test_placement_routes_are_checked_and_round_trip():
    from lightning_hetermoe.placement import Placement

    held = [[[0, 1], [1, 2]]]
    routes = [[None, [[0.25, 0.75], [0.0, 1.0]], None]]
    p = Placement(held, routes)
    assert Placement(p.to_lists(), p.routes_lists()) == p and p != Placement(held)
    assert Placement(held, [[None, None, None]]).routes is None  # no route at all: none
    with pytest.raises(ValueError, match="expert 0: a route needs the expert to have copies"):
        Placement(held, [[[[1.0], [1.0]], None, None]])
    with pytest.raises(ValueError, match="summing to 1"):
        Placement(held, [[None, [[0.5, 0.6], [0.0, 1.0]], None]])
    with pytest.raises(ValueError, match="routes have 2 layers"):
        Placement(held, [None, None])


def test_copy_targets_balance_the_holders_time():
    from lightning_hetermoe.plan.rebalance import copy_targets

    def cost(h, t):  # holder 1 takes twice as long per token
        return t * (1.0, 2.0)[h]

    # expert 0 only on holder 0 (300 tokens), expert 1 copied on both (900 tokens)
    targets = copy_targets([[0, 1], [1]], [300.0, 900.0], cost, steps=90)
    assert targets[0] is None
    busy0 = 300 + 900 * targets[1][0]
    busy1 = 2 * 900 * targets[1][1]
    assert abs(busy0 - busy1) <= 2 * 900 / 90, "within one part of equal finish times"
    assert targets[1][0] == pytest.approx(5 / 9, abs=0.02)  # 300 + 900 x = 2 * 900 (1 - x)


def test_routed_copies_beat_local_first_where_the_slow_holder_keeps_too_much():
    """A40+T4, two hot experts copied on both ranks and nothing else on the T4: local first
    leaves the T4 its own half of the hot tokens; routes move part of them to the A40 and the
    simulator prices the step faster."""
    from lightning_hetermoe.cluster.devices import get_device
    from lightning_hetermoe.cluster.spec import LinkConfig
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.placement import Placement
    from lightning_hetermoe.plan.rebalance import balanced_routes
    from lightning_hetermoe.profile.timer import make_timer
    from lightning_hetermoe.simulate import predict_step

    model = ModelConfig(d_model=1024, n_layers=2, n_heads=8, max_seq_len=4096, moe=MoEConfig(num_experts=6, d_ff=2048))
    timer = make_timer(model, 4096)
    devs = [get_device("a40"), get_device("t4")]
    load = [[0.05] * 4 + [0.4, 0.4]] * 2
    held = [[0, 1, 2, 3, 4, 5], [4, 5]]
    tokens = 4 * 4096 * model.moe.top_k

    def cost(h, t):
        return timer.expert(devs[h], t) if t > 0 else 0.0

    routes = [balanced_routes(held, [s * tokens for s in row], cost, [1.0, 1.0]) for row in load]
    assert routes[0][4][1][0] > 0.1, "the T4 sends part of its hot choices to the A40"
    assert routes[0][4][0] == [1.0, 0.0], "the A40 keeps its own"

    def step(placement, groups=1):
        return predict_step("ep", devs * groups, model, LinkConfig(bandwidth_gbps=100.0), timer, seq_len=4096,
                            total_seqs=4 * groups, num_microbatches=1, placement=placement, ep_size=2,
                            expert_load=load).step_time

    assert step(Placement([held] * 2, routes)) < step(Placement([held] * 2)) * 0.99
    # two such EP groups (A40, T4, A40, T4): each group's exchange and each route its own;
    # the routes were dropped there (priced as one group of four holders, the rule alone)
    assert step(Placement([held] * 2, routes), groups=2) < step(Placement([held] * 2), groups=2) * 0.99
