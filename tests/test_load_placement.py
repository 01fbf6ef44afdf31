"""Which expert goes where at a measured routing (``plan/load_placement.py``): the plan's
counts kept, the ids chosen so that a hot expert does not set a slow member's pace."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from lightning_hetermoe import HeterMoEStrategy, Plan
from lightning_hetermoe.cluster.devices import get_device
from lightning_hetermoe.cluster.spec import LinkConfig
from lightning_hetermoe.configs import ConfigError, workload_model
from lightning_hetermoe.plan import make_plan
from lightning_hetermoe.plan.fit import member_capacity, optimizer_shares
from lightning_hetermoe.plan.load_placement import place_at_load
from lightning_hetermoe.profile.memory import MemoryModel
from lightning_hetermoe.profile.timer import make_timer
from lightning_hetermoe.simulate.predict import predict_step_time


def busiest(row: list[int], load: list[float], base: list[float], speed: list[float]) -> float:
    """The layer's slowest member by hand: its base plus its experts' tokens at its speed."""
    t = list(base)
    for e, m in enumerate(row):
        t[m] += load[e] * speed[m]
    return max(t)


def test_each_layer_gets_the_ids_a_brute_force_search_finds_with_every_members_count_kept():
    """One swap at a time reaches the best ids of most small layers (all 720 orders of 6
    experts priced by hand); where it stops short, it stops close."""
    optimal = 0
    for seed in range(30):
        rng = random.Random(seed)
        counts = [rng.randint(0, 3), rng.randint(1, 3)]
        counts.append(6 - sum(counts))
        row = [m for m, c in enumerate(counts) for _ in range(c)]  # id order, as Asym-EA's counts come
        load = [rng.random() ** 3 for _ in range(6)]
        load = [x / sum(load) for x in load]
        base = [rng.random() for _ in counts]
        speed = [rng.choice([1.0, 2.0, 3.5]) for _ in counts]
        got = place_at_load([row], [load], base, lambda m, t: speed[m] * t, choices=1.0)[0]
        assert sorted(got) == sorted(row), "every member keeps its count"
        best = min(busiest(list(p), load, base, speed) for p in set(itertools.permutations(row)))
        assert best <= busiest(got, load, base, speed) <= best * 1.05, seed
        assert busiest(got, load, base, speed) <= busiest(row, load, base, speed)
        optimal += busiest(got, load, base, speed) <= best * (1 + 1e-12)
    assert optimal >= 27, f"the best ids in {optimal} of 30 layers"  # 28 (95% of 300 such layers)


def test_layers_are_placed_each_at_their_own_routing_and_an_even_one_is_left_in_id_order():
    speed = [1.0, 3.0]  # member 1 is three times slower per token
    rows = [[0, 0, 1, 1], [0, 0, 1, 1]]
    hot_last = [0.1, 0.1, 0.1, 0.7]
    even = [0.25] * 4
    got = place_at_load(rows, [hot_last, even], [0.0, 0.0], lambda m, t: speed[m] * t, choices=100.0)
    assert got[0][3] == 0, "the hot expert leaves the slow member"
    assert got[1] == rows[1], "nothing to gain: nothing moves"


def test_experts_move_to_a_member_with_room_and_no_further_than_its_room():
    """A fast member with room for one more expert (all layers together): of two layers that
    both want one more expert there, one gets it; without room every member keeps its count."""
    speed = [100.0, 300.0]  # seconds per share of the tokens: member 1 is three times slower
    rows = [[0, 1, 1, 1], [0, 1, 1, 1]]
    load = [0.3, 0.3, 0.3, 0.1]
    cost = lambda m, t: speed[m] * t  # noqa: E731
    kept = place_at_load(rows, [load, load], [0.0, 0.0], cost, choices=1.0)
    assert all(row.count(0) == 1 for row in kept)
    got = place_at_load(rows, [load, load], [0.0, 0.0], cost, choices=1.0, room=[1, 0])
    assert sorted(row.count(0) for row in got) == [1, 2], "one more expert on member 0, in one layer only"
    moved = next(l for l, row in enumerate(got) if row.count(0) == 2)
    assert busiest(got[moved], load, [0.0, 0.0], speed) == pytest.approx(120.0)  # 0.6 x 100 | 0.4 x 300
    assert busiest(kept[moved], load, [0.0, 0.0], speed) == pytest.approx(210.0)  # 0.3 x 100 | 0.7 x 300


D1 = workload_model("d1")
MODEL = replace(D1, n_layers=4, moe=replace(D1.moe, num_experts=24, top_k=2))
HOT = [[0.28, 0.28] + [0.02] * 22 for _ in range(4)]  # the first two ids take over half the tokens


@pytest.mark.parametrize("devices, gains", [(["a40", "v100"], 0.95), (["a40", "a40", "v100", "v100"], 0.95),
                                            # id order already gives both to the L40S: no faster ids
                                            (["l40s", "t4", "t4", "t4"], 1.0)])
def test_a_plan_placed_at_a_record_is_predicted_faster_with_the_counts_and_memory_of_id_order(devices, gains):
    kw = dict(seq_len=4096, global_batch_tokens=12 * 4096, expert_load=HOT, max_waves=1)
    by_id = make_plan(devices, MODEL, **kw)
    placed = make_plan(devices, MODEL, place_at_load=True, **kw)
    assert placed.placed_at_load and not by_id.placed_at_load
    assert "chosen at the routing planned at" in str(placed) and "chosen at the routing" not in str(by_id)
    # the same layout: roles, micro-batches, counts per member (so the same memory)
    assert (placed.roles, placed.num_microbatches, placed.seqs_per_rank) == \
        (by_id.roles, by_id.num_microbatches, by_id.seqs_per_rank)
    assert placed.base_counts == by_id.base_counts
    # DistEP keeps its counts; zebra's experts may move, each member within its memory
    distep = [[row.count(m) for row in placed.placement_for("distep")] for m in range(len(devices))]
    assert distep == [[row.count(m) for row in by_id.placement_for("distep")] for m in range(len(devices))]
    for m, r in enumerate(placed.zp_groups[0].members):
        assert sum(placed.expert_counts(0)[m]) <= capacity(placed, r), (devices, r)
    for schedule in ("zebra", "distep"):
        assert placed.predicted[schedule]["step_time_s"] <= by_id.predicted[schedule]["step_time_s"] * (1 + 1e-12)
    for schedule in ("zebra", "distep"):  # two hot experts on one member: placing them apart pays
        assert placed.predicted[schedule]["step_time_s"] <= by_id.predicted[schedule]["step_time_s"] * gains
    assert Plan.from_json(placed.to_json()) == placed
    # at even routing there is nothing to place at: id order, and the plan says so
    even = make_plan(devices, MODEL, place_at_load=True, seq_len=4096, global_batch_tokens=12 * 4096, max_waves=1)
    assert not even.placed_at_load and even.placement == make_plan(
        devices, MODEL, seq_len=4096, global_batch_tokens=12 * 4096, max_waves=1).placement


def capacity(plan: Plan, r: int) -> int:
    """The experts rank ``r`` of ``plan`` can hold, all layers, by the memory model."""
    attention = plan.zp_groups[0].attention_ranks
    devs = [get_device(d) for d in plan.devices]
    seqs = plan.seqs_per_rank[r] if r in attention else None
    share = optimizer_shares(devs, attention, sharded=False).get(r, 1.0)
    return member_capacity(MemoryModel(MODEL), devs[r], seq_len=plan.seq_len, group_seqs=plan.total_seqs,
                           R=plan.num_microbatches, seqs=seqs, share=share)


def test_distep_runs_its_own_placement_where_the_plan_carries_one():
    plan = make_plan(["a40", "v100"], MODEL, seq_len=4096, global_batch_tokens=12 * 4096, expert_load=HOT,
                     max_waves=1, place_at_load=True)
    assert plan.base_placement and plan.placement_for("distep") == plan.base_placement
    by_id = replace(plan, base_placement=[])
    devs, timer = [get_device("a40"), get_device("v100")], make_timer(MODEL, 4096)
    assert predict_step_time("distep", devs, MODEL, LinkConfig(), timer, plan=plan, expert_load=HOT) < \
        predict_step_time("distep", devs, MODEL, LinkConfig(), timer, plan=by_id, expert_load=HOT)
    with pytest.raises(ValueError, match="DistEP's ids may be chosen, its counts not"):
        replace(plan, base_placement=[[0] * 24 for _ in range(4)])


def test_the_strategy_places_at_a_record_by_default_and_refuses_what_runs_no_plan(tmp_path):
    from lightning_hetermoe import RoutingRecord
    from lightning_hetermoe.strategy.selection import _place_at_load

    path = tmp_path / "expert_load.json"
    RoutingRecord(model="d1", mean_share=HOT, steps=5, choices_per_step=256.0).to_json(str(path))
    assert _place_at_load(HeterMoEStrategy(mode="zebra", expert_load=str(path)).args) is True
    assert _place_at_load(HeterMoEStrategy(mode="zebra").args) is False, "a fresh router's routing drifts"
    assert _place_at_load(HeterMoEStrategy(mode="zebra", place_at_load=True).args) is True
    assert _place_at_load(HeterMoEStrategy(mode="auto", expert_load=str(path), place_at_load=False).args) is False
    with pytest.raises(ConfigError, match="place_at_load is for mode='zebra', 'distep' and 'auto'.*mode='ep'"):
        HeterMoEStrategy(mode="ep", place_at_load=True)
    with pytest.raises(ConfigError, match="place_at_load='yes' is invalid: must be true, false or null"):
        HeterMoEStrategy(mode="zebra", place_at_load="yes")
    plan = make_plan(["a40", "v100"], MODEL, seq_len=4096, global_batch_tokens=12 * 4096, max_waves=1)
    with pytest.raises(ConfigError, match="the given plan runs as written"):
        HeterMoEStrategy(mode="zebra", plan=plan, place_at_load=True)
