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


@pytest.mark.parametrize("seed", range(5))
def test_flows_follow_the_rule_and_keep_every_choice(seed):
    rng = random.Random(seed)
    H, E = rng.randint(2, 5), rng.randint(4, 9)
    held = [[] for _ in range(H)]
    for e in range(E):
        for h in rng.sample(range(H), rng.randint(1, H)):
            held[h].append(e)
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
