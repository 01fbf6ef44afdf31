"""At a measured routing every expert costs its own: the simulator asks the timer for a
layer's experts as one array (``experts``), forms every lane's sum at once and every
layer's exchange at once. Each is held here to the one-number-at-a-time reference, to the
last bit (a plan's search compares predictions that differ in the last places)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lightning_hetermoe.cluster import ClusterConfig, get_device
from lightning_hetermoe.configs import ModelConfig, MoEConfig, workload_model
from lightning_hetermoe.plan import make_plan
from lightning_hetermoe.plan.planner import as_cluster
from lightning_hetermoe.profile import CostModel, DeviceProfile, Profile, interpolate, make_timer
from lightning_hetermoe.profile.timer import CachedTimer
from lightning_hetermoe.simulate.schedules import plan_setup
from lightning_hetermoe.simulate.step import TaskTimes, exchange_legs, lane_tokens, round_transfer_time

DEVICES = ("h100", "a40", "v100", "l40s", "t4")


def token_counts(rng: random.Random) -> np.ndarray:
    """Zeros, negatives (nothing routed), fractions (a share of a round), large counts."""
    return np.array([0.0, -3.0, 0.5, 1.0, 7.25, 4096.0, 1e6] + [rng.uniform(0, 5e4) for _ in range(40)])


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_cost_models_expert_array_is_each_numbers_own(activation, checkpointed):
    rng = random.Random(0)
    x = token_counts(rng)
    for precision, recompute in ((p, r) for p in ("32-true", "bf16-mixed") for r in (False, True)):
        cost = CostModel(precision=precision, activation_checkpointing=checkpointed)
        for name in DEVICES:
            dev = get_device(name)
            for backward in (False, True):
                kw = dict(d_model=512, d_ff=1408, activation=activation, backward=backward, recompute_hidden=recompute)
                many = cost.expert_time(dev, tokens=x, **kw)
                assert many.tolist() == [cost.expert_time(dev, tokens=float(t), **kw) for t in x]
                assert (many[x <= 0] == 0).all() and (many[x > 0] > 0).all()


@pytest.mark.parametrize("points", [1, 2, 5])
def test_a_profiles_interpolation_of_an_array_is_each_numbers_own(points):
    rng = random.Random(points)
    table = {int(2 ** (6 + 2 * i)): rng.uniform(1e-5, 1e-2) * (i + 1) for i in range(points)}
    xs = sorted(table)
    # below, at and between the measured points, past the last, and nothing at all
    x = np.array([0.0, -1.0, xs[0] / 3, *xs, *(a + (b - a) / 3 for a, b in zip(xs, xs[1:])), xs[-1] * 2.5] +
                 [rng.uniform(0, xs[-1] * 2) for _ in range(30)])
    assert interpolate(table, x).tolist() == [interpolate(table, float(t)) for t in x]


def test_every_timer_prices_an_array_of_experts_as_its_numbers():
    m = workload_model("olmoe_1b_7b")
    rng = random.Random(1)
    x = token_counts(rng)
    fwd = {256: 2e-4, 1024: 6e-4, 8192: 4e-3}
    profile = Profile(model=m.name, seq_len=4096, source="emulated", devices={
        "a40": DeviceProfile(device="a40", attention_fwd_s={4096: 1e-3}, expert_fwd_s=fwd),
        "v100": DeviceProfile(device="v100", attention_fwd_s={4096: 2e-3}, expert_fwd_s=fwd,
                              expert_bwd_s={k: 2.5 * v for k, v in fwd.items()})})
    for timer in (make_timer(m, 4096), make_timer(m, 4096, profile), CachedTimer(make_timer(m, 4096, profile))):
        for name in ("a40", "v100"):
            for backward in (False, True):
                got = timer.experts(get_device(name), x, backward)
                assert got.tolist() == [timer.expert(get_device(name), float(t), backward) for t in x]


class OneAtATime:
    """A user's timer without ``experts``: asked one number at a time."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        if name == "experts":
            raise AttributeError(name)
        return getattr(self.inner, name)


def skewed(model: ModelConfig, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(model.n_layers):
        w = [rng.paretovariate(1.5) for _ in range(model.moe.num_experts)]
        out.append([v / sum(w) for v in w])
    return out


def routed_plan(layout: str, seed: int):
    """A plan of a small mixed cluster at a skewed routing, experts placed at it."""
    m = ModelConfig(name="m", vocab_size=1000, d_model=256, n_layers=3, n_heads=4, max_seq_len=2048,
                    moe=MoEConfig(num_experts=16, top_k=2, d_ff=512))
    devs = ["h100", "a40", "a40", "v100", "v100", "v100", "t4", "t4"]
    cfg = ClusterConfig(name="c", devices=devs) if layout == "flat" else ClusterConfig(
        name="c", nodes=[{"name": f"n{i}", "devices": devs[i:i + 4], "link": "nvlink2"} for i in (0, 4)],
        network="ib_hdr")
    load = skewed(m, seed)
    plan = make_plan(cfg, m, seq_len=1024, global_batch_tokens=16 * 1024, expert_load=load, place_at_load=True,
                     schedules=("zebra",))
    view = as_cluster(cfg)
    return m, view, plan, load


@pytest.mark.parametrize("layout", ["flat", "nodes"])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_lanes_expert_task_is_the_sum_of_its_experts_asked_one_at_a_time(layout, seed):
    m, view, plan, load = routed_plan(layout, seed)
    k = m.moe.top_k
    for schedule in ("zebra", "distep"):
        setup = plan_setup(plan, view.devices, m, view.topology, schedule=schedule, expert_load=load)
        held = [lane for lane in setup.lanes if any(lane.experts)]
        assert len({tuple(map(tuple, lane.expert_ids)) for lane in held}) > 2  # lanes hold different experts
        # how many ranks hold each expert: its copies split its tokens
        copies = [[sum(len(lane.ranks) for lane in setup.lanes if e in lane.expert_ids[layer])
                   for e in range(m.moe.num_experts)] for layer in range(m.n_layers)]
        tokens = lane_tokens(setup)
        for timer in (make_timer(m, 1024), OneAtATime(make_timer(m, 1024))):
            times = TaskTimes(setup, timer)
            for i, lane in enumerate(setup.lanes):
                for layer, kind, mb in ((l, kd, j) for l in range(m.n_layers) for kd in ("expert_fwd", "expert_bwd")
                                        for j in range(setup.num_microbatches)):
                    group = sum(len(x.ranks) * t[mb] for x, t in zip(setup.lanes, tokens))
                    want = 0
                    for e in lane.expert_ids[layer]:
                        want += timer.expert(lane.device, group * k * load[layer][e] / copies[layer][e],
                                             backward=kind == "expert_bwd")
                    assert times(i, kind, layer, mb) == want
            # every lane's at once, as the lane-vector simulator asks
            lanes = np.arange(len(setup.lanes))
            for layer in range(m.n_layers):
                at_once = times.held_experts(lanes, np.full(len(lanes), layer), "expert_bwd", 0)
                assert at_once.tolist() == [times(i, "expert_bwd", layer, 0) for i in lanes]
        for layer in range(m.n_layers):
            want = [sum(load[layer][e] / copies[layer][e] for e in lane.expert_ids[layer]) for lane in setup.lanes]
            assert setup.lane_shares(layer).tolist() == want


@pytest.mark.parametrize("layout", ["flat", "nodes"])
def test_every_layers_exchange_at_once_is_each_layers_alone(layout):
    m, view, plan, load = routed_plan(layout, 3)  # a routing whose three layers exchange unalike on both
    timer = make_timer(m, 1024)
    setup = plan_setup(plan, view.devices, m, view.topology, expert_load=load)
    for mb_tokens in zip(*lane_tokens(setup)):
        tokens = list(mb_tokens)
        fresh = plan_setup(plan, view.devices, m, view.topology, expert_load=load)
        # the first layer asked prices every layer; each must be what that layer alone gives
        got = [round_transfer_time(fresh, timer, layer, tokens) for layer in reversed(range(m.n_layers))][::-1]
        want = []
        for layer in range(m.n_layers):
            legs, _ = exchange_legs(plan_setup(plan, view.devices, m, view.topology, expert_load=load), layer, tokens)
            want.append(max((timer.transfer(rows, link) for rows, link in legs), default=0.0))
        assert got == want and len(set(got)) == m.n_layers  # the layers' routings differ
