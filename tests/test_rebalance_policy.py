"""The rebalancing policy: time-balanced placement from measured loads, and EPLB's."""

import random

import pytest

from lightning_hetermoe.plan.rebalance import balance_layer, copies_of, eplb_layer, layer_time, rebalance


def speeds(*factors):
    """Holder ``h`` takes ``factors[h]`` seconds per token (plus a small fixed launch cost)."""
    return lambda h, tokens: 1e-3 + factors[h] * tokens if tokens > 0 else 0.0


def test_never_predicted_worse_than_the_current_placement():
    rng = random.Random(0)
    for trial in range(200):
        H, E = rng.randint(1, 5), rng.randint(1, 12)
        tokens = [rng.expovariate(1.0) * 100 for _ in range(E)]
        current = [[] for _ in range(H)]
        for e in range(E):
            current[rng.randrange(H)].append(e)
        cost = speeds(*[rng.uniform(0.5, 3.0) for _ in range(H)])
        cap = [E] * H
        res = balance_layer(tokens, current, cost, cap, redundant=rng.randint(0, 3))
        assert res.time <= res.current_time + 1e-12, trial
        assert res.time == pytest.approx(layer_time(res.placement, tokens, cost))
        assert sorted(set(e for held in res.placement for e in held)) == list(range(E)), "every expert placed"
        assert all(len(set(held)) == len(held) for held in res.placement), "no holder holds an expert twice"


def test_fewer_experts_than_holders():
    res = balance_layer([10.0, 30.0], [[0, 1], [], [], []], speeds(1, 1, 1, 1), [4] * 4)
    assert sum(1 for held in res.placement if held) == 2, res.placement
    assert res.time == pytest.approx(1e-3 + 30.0)


def test_one_very_hot_expert_gets_copies_and_its_tokens_split():
    tokens = [900.0, 50.0, 30.0, 20.0]  # expert 0 alone carries far more than a fair quarter
    current = [[0], [1], [2], [3]]
    moved_only = balance_layer(tokens, current, speeds(1, 1, 1, 1), [2] * 4)
    replicated = balance_layer(tokens, current, speeds(1, 1, 1, 1), [2] * 4, redundant=3)
    assert copies_of(replicated.placement, 4)[0] == 4
    assert replicated.time < moved_only.time / 3, (replicated.time, moved_only.time)


def test_mixed_device_speeds_give_the_fast_device_more_work():
    tokens = [100.0] * 8
    current = [[0, 1, 2, 3], [4, 5, 6, 7]]  # even by tokens
    fast_slow = speeds(1.0, 3.0)  # holder 1 is three times slower per token
    res = balance_layer(tokens, current, fast_slow, [8, 8])
    assert len(res.placement[0]) == 6 and len(res.placement[1]) == 2, res.placement
    assert res.time < res.current_time * 0.8
    # EPLB balances token counts: it keeps 4 and 4 and pays for the slow device
    base = eplb_layer(tokens, current, fast_slow)
    assert [len(h) for h in base.placement] == [4, 4] and base.time > res.time * 1.3


def test_capacity_bounds_what_a_holder_takes():
    res = balance_layer([100.0] * 8, [[0, 1, 2, 3], [4, 5, 6, 7]], speeds(1.0, 3.0), [5, 8])
    assert len(res.placement[0]) <= 5


def test_deterministic_and_whole_model():
    share = [[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]
    current = [[[0, 1], [2, 3]], [[0, 1], [2, 3]]]
    a = rebalance(share, 1000.0, current, speeds(1.0, 2.0), [4, 4], redundant=1)
    b = rebalance(share, 1000.0, current, speeds(1.0, 2.0), [4, 4], redundant=1)
    assert a == b
    placement, t_new, t_now, moves = a
    assert t_new < t_now and moves > 0
    with pytest.raises(ValueError, match="policy='greedy' is invalid"):
        rebalance(share, 1000.0, current, speeds(1.0, 2.0), [4, 4], policy="greedy")
