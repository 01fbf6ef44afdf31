"""EP priced at its fastest group size (``simulate/ep_groups.py``): the sizes a run can be
set to, the fastest of them in the planner's table and in ``mode="auto"``'s choice, and a
run on gloo ranks that auto put in groups smaller than the world."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, MoELanguageModel, OptimConfig
from lightning_hetermoe.cluster import ClusterConfig, LinkConfig
from lightning_hetermoe.cluster.topology import Topology
from lightning_hetermoe.configs import ModelConfig, from_cfg, workload_model
from lightning_hetermoe.plan import Plan, make_plan
from lightning_hetermoe.plan.planner import as_cluster
from lightning_hetermoe.profile import make_timer
from lightning_hetermoe.simulate import predict_step, simulate_plan
from lightning_hetermoe.simulate.ep_groups import ep_group_sizes, fastest_ep
from reference import assert_same_params, data, make_model, trainer

CONF = Path(__file__).resolve().parents[1] / "conf"


def shipped(name: str) -> ClusterConfig:
    return from_cfg(ClusterConfig, OmegaConf.load(CONF / "cluster" / f"{name}.yaml"), "cluster")


def naive_sizes(node_of: list[int]) -> list[int]:
    """Every divisor k of the world whose groups of k consecutive ranks each lie in one node
    or are exactly the ranks of the nodes they touch: by sets of ranks."""
    world = len(node_of)
    out = []
    for k in range(world, 0, -1):
        if world % k:
            continue
        ok = True
        for g in range(world // k):
            ranks = set(range(g * k, (g + 1) * k))
            nodes = {node_of[r] for r in ranks}
            whole = {r for r in range(world) if node_of[r] in nodes}
            ok &= len(nodes) == 1 or ranks == whole
        if ok:
            out.append(k)
    return out


@pytest.mark.parametrize("node_of", [
    [0] * 12, [0] * 4 + [1] * 4, [0] * 3 + [1] * 3, [0] * 2 + [1] * 4, [0] * 4 + [1] * 2,
    [n for n in range(8) for _ in range(8)], [0] * 6 + [1] * 6 + [2] * 6 + [3] * 6])
def test_group_sizes_are_the_divisors_whose_groups_sit_in_a_node_or_cover_whole_nodes(node_of):
    nodes = max(node_of) + 1
    link = LinkConfig()
    topo = Topology(node_of=tuple(node_of), links=(link,) * nodes, network=link if nodes > 1 else None)
    got = ep_group_sizes(topo, len(node_of))
    assert got == naive_sizes(node_of) and got[0] == len(node_of) and got[-1] == 1
    if nodes == 1:  # one node: every divisor
        assert got == [k for k in range(len(node_of), 0, -1) if len(node_of) % k == 0]
        assert ep_group_sizes(link, len(node_of)) == got
    with pytest.raises(ValueError, match="EP needs at least one rank"):
        ep_group_sizes(topo, 0)


@pytest.mark.parametrize("cluster,seqs", [("n2_mixed", 32), ("a40x2_v100x2", 16), ("n2_h100_mi250x", 32)])
def test_the_fastest_size_is_the_brute_force_fastest_of_every_size(cluster, seqs):
    model = workload_model("d1")
    view = as_cluster(shipped(cluster))
    timer = make_timer(model, 4096)
    kw = dict(seq_len=4096, total_seqs=seqs, keep_timeline=False)
    steps = {}
    for k in ep_group_sizes(view.topology, len(view.devices)):
        try:
            steps[k] = predict_step("ep", view.devices, model, view.topology, timer, ep_size=k, **kw).step_time
        except ValueError:
            pass
    size, res = fastest_ep("ep", view.devices, model, view.topology, timer, **kw)
    assert steps[size] == res.step_time == min(steps.values())
    world = len(view.devices)
    if cluster == "a40x2_v100x2":  # one node: a quarter of the experts each beats half or all
        assert size == world
    else:  # two servers: each keeps its exchange inside itself, only the gradient sum crosses
        assert size == world // 2 and steps[world] > 1.3 * res.step_time
    with pytest.raises(ValueError, match="fastest_ep prices ep and ep_balanced, not 'zebra'"):
        fastest_ep("zebra", view.devices, model, view.topology, timer, **kw)


@pytest.mark.parametrize("layout", ["flat", "nodes"])
@pytest.mark.parametrize("schedule", ["ep", "ep_balanced"])
def test_at_even_routing_alike_ranks_share_a_lane_and_price_as_a_lane_per_rank(layout, schedule):
    """EP's group at even routing merges its alike ranks into lanes (the expert ids they
    hold price nothing there); the same setup with a lane per rank, the graph before, gives
    the same step, per-rank busy time and network bytes, to rounding (sums over a lane's
    ranks, not rank by rank), at every group size."""
    from lightning_hetermoe.simulate import ep_setup
    from lightning_hetermoe.simulate.step import Lane, simulate_step

    devices = ["h100"] * 2 + ["a40"] * 6 + ["v100"] * 8
    if layout == "flat":
        cluster = ClusterConfig(name="mix16", devices=devices)
    else:
        cluster = ClusterConfig(name="mix16_nodes", network="ib_hdr", nodes=[
            {"name": f"n{i}", "devices": devices[i * 4:(i + 1) * 4], "link": "pcie4"} for i in range(4)])
    view = as_cluster(cluster)
    model = workload_model("olmoe_1b_7b")
    timer = make_timer(model, 4096)
    sizes = ep_group_sizes(view.topology, len(view.devices))
    assert len(sizes) >= 3
    for k in sizes:
        for seqs in (32, 35):  # 35: the remainder's ranks differ from their kind's others
            try:
                setup = ep_setup(view.devices, model, seq_len=4096, total_seqs=seqs, link=view.topology,
                                 timer=timer, balanced=schedule == "ep_balanced", ep_size=k)
            except ValueError:
                continue
            per_rank = dataclasses.replace(setup, lanes=[
                Lane(device=lane.device, ranks=[r], seqs=list(lane.seqs), experts=list(lane.experts), role=lane.role)
                for lane in setup.lanes for r in lane.ranks])
            assert len(setup.lanes) < len(per_rank.lanes) == k
            merged, each = simulate_step(setup, timer, schedule), simulate_step(per_rank, timer, schedule)
            assert merged.step_time == pytest.approx(each.step_time, rel=1e-12, abs=0)
            assert merged.busy.keys() == each.busy.keys()
            assert all(merged.busy[r] == pytest.approx(each.busy[r], rel=1e-12, abs=0) for r in each.busy)
            assert merged.network_bytes == pytest.approx(each.network_bytes, rel=1e-12, abs=0)
            if layout == "nodes" and k > 4:
                assert each.network_bytes > 0


@pytest.mark.slow  # computes for seconds (the quick loop stays about a minute)
def test_the_plan_prices_ep_at_its_fastest_group_size_and_says_how_to_run_it():
    model = workload_model("d1")
    cluster = shipped("n2_mixed")
    view = as_cluster(cluster)
    timer = make_timer(model, 4096)
    plan = make_plan(cluster, model, seq_len=4096, global_batch_tokens=4096 * 32)
    for name in ("ep", "ep_balanced"):
        size, res = fastest_ep(name, view.devices, model, view.topology, timer, seq_len=4096,
                               total_seqs=plan.step_seqs, plan=plan)
        row = plan.predicted[name]
        assert (row["ep_size"], row["step_time_s"]) == (size, res.step_time) == (4, res.step_time)
        assert plan.run_as(name).endswith("strategy.expert_parallel_size=4")
    text = str(plan)
    assert "EP groups of 4" in text and "strategy.expert_parallel_size=k" in text
    # what recipes/plan.py simulates and draws for a row is the row's step
    drawn = simulate_plan(plan, view.devices, model, view.topology, timer, schedule="ep", keep_timeline=False)
    assert drawn.step_time == plan.predicted["ep"]["step_time_s"]
    assert Plan.from_dict(plan.to_dict()).predicted == plan.predicted  # the size survives plan.json
    world = make_plan(cluster, model, seq_len=4096, global_batch_tokens=4096 * 32, ep_groups="world")
    one = predict_step("ep", view.devices, model, view.topology, timer, plan=world)
    assert "ep_size" not in world.predicted["ep"] and world.predicted["ep"]["step_time_s"] == one.step_time
    assert world.run_as("ep") == "strategy.mode=ep" and "EP groups of" not in str(world)
    assert world.predicted["ep"]["step_time_s"] > 1.3 * plan.predicted["ep"]["step_time_s"]
    with pytest.raises(ValueError, match=r"ep_groups='some' is invalid: choose from \('fastest', 'world'\)"):
        make_plan(cluster, model, seq_len=4096, global_batch_tokens=4096 * 32, ep_groups="some")


@pytest.mark.slow  # computes for seconds (the quick loop stays about a minute)
def test_auto_weighs_every_ep_group_size_and_names_the_one_it_chose(capsys):
    """OLMoE on two servers (H100s, MI250Xs) joined by 200 Gbit/s: EP in a group per server
    is predicted faster than zebra's plan there; EP over both servers was 4.5x slower."""
    from lightning_hetermoe.strategy.backends.base import Simulated
    from lightning_hetermoe.strategy.run_clock import RunClock
    from lightning_hetermoe.strategy.selection import _decide, _Description

    model = workload_model("olmoe_1b_7b")
    cluster = shipped("n2_h100_mi250x")
    clock = RunClock(cluster, None, rank=0)
    clock.bind(model, 4, 4096, 8, cluster.specs())
    # the model run is a small one of the workload's shape: the clock prices the workload
    small = MoELanguageModel(ModelConfig(d_model=32, n_heads=2, n_layers=model.n_layers,
                                         moe=dataclasses.replace(model.moe, d_ff=64)))
    schedule, plan, size = _decide(HeterMoEStrategy(mode="auto", cluster=cluster).args, clock, 8, small,
                                   _Description.of(small))
    steps = clock.ep_step_times(schedule)
    assert steps[8] == clock.step_time(Simulated(schedule, ep_size=8)) and min(steps.values()) == steps[4]
    assert schedule in ("ep", "ep_balanced") and plan is None and size == 4
    assert steps[8] > 2 * steps[4]
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("hetermoe[auto]")][-1]
    assert line.startswith(f"hetermoe[auto]: chose {schedule} (expert_parallel_size=4) (") and "runner-up zebra" in line
    # with 60% of the memory a group of 4's ranks no longer hold their experts and batch in
    # one micro-batch (EP runs one): the world-wide group is chosen though 4 would step faster
    tight = from_cfg(ClusterConfig, {**OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / "n2_h100_mi250x.yaml")),
                                     "memory_scale": 0.6}, "cluster")
    clock = RunClock(tight, None, rank=0)
    clock.bind(model, 4, 4096, 8, tight.specs())
    assert clock.step_time(Simulated("ep", ep_size=4)) < clock.step_time(Simulated("ep", ep_size=8))
    times = clock.ep_step_times("ep")
    assert 4 not in times and min(times, key=times.get) == 8


class ManualStep(MoELanguageModel):
    """Manual optimization (auto then weighs EP and data-centric only: zebra runs the
    backward itself)."""

    def __init__(self) -> None:
        base = make_model(4, seed=0, optim=OptimConfig())
        super().__init__(base.model_cfg, base.optim_cfg)
        self.load_state_dict(base.state_dict())
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.losses(batch)["loss"]
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        return loss


# two servers, A40s and V100s, 25 Gbit/s between them, D1's tasks at 4K on the clock: EP
# over all four ranks sends every layer's rows over the network
TWO_SERVERS = dict(name="two", nodes=[{"name": "s0", "devices": ["a40", "a40"], "link": "pcie4"},
                                      {"name": "s1", "devices": ["v100", "v100"], "link": "nvlink2"}],
                   network={"bandwidth_gbps": 25, "latency_us": 20}, emulate=True, time_scale=0.5,
                   emulate_workload={"model": "d1", "seq_len": 4096})
STEPS = 3


def fit_auto(rank: int, world: int, asked: dict) -> dict | None:
    model = ManualStep()
    strategy = HeterMoEStrategy(cluster=TWO_SERVERS, **asked)
    trainer(strategy, world, max_steps=STEPS).fit(model, datamodule=data(world, 8))
    return {"state": model.state_dict(), "ep_size": strategy.expert_parallel_size, "schedule": strategy.schedule,
            "ep_rank": strategy.backend.groups.ep_rank}


@pytest.mark.slow
@pytest.mark.parametrize("asked", [dict(mode="auto"), dict(mode="ep", expert_parallel_size="auto")],
                         ids=["mode_auto", "ep_size_auto"])
def test_auto_runs_ep_in_the_groups_it_chose_on_every_rank_and_trains_as_one_process(asked):
    per_rank = run_ranks(4, fit_auto, 4, asked)
    assert [(r["schedule"], r["ep_size"], r["ep_rank"]) for r in per_rank] == [
        ("ep", 2, 0), ("ep", 2, 1), ("ep", 2, 0), ("ep", 2, 1)]
    reference = ManualStep()
    initial = copy.deepcopy(reference.state_dict())
    trainer("auto", 1, max_steps=STEPS).fit(reference, datamodule=data(1, 8))
    for got in per_rank:
        assert_same_params(got["state"], reference.state_dict(), initial)


def test_ep_left_at_one_group_says_where_smaller_groups_are_predicted_faster(capsys):
    from lightning_hetermoe.strategy.backends.base import Simulated
    from lightning_hetermoe.strategy.run_clock import RunClock
    from lightning_hetermoe.strategy.selection import suggest_ep_size

    model = workload_model("d1")
    for name, world, size in (("n2_mixed", 8, 4), ("a40x2_v100x2", 4, None)):
        cluster = shipped(name)
        clock = RunClock(cluster, None, rank=0)
        clock.bind(model, 4, 4096, world, cluster.specs())
        line = suggest_ep_size(clock, "ep", world)
        if size is None:  # one server: one group over the world is the fastest; nothing said
            times = clock.ep_step_times("ep")
            assert line is None and min(times, key=times.get) == world
            continue
        ratio = clock.step_time(Simulated("ep", ep_size=world)) / clock.step_time(Simulated("ep", ep_size=size))
        assert ratio > 1.2 and line == (
            f"hetermoe[ep]: 2 EP groups of 4 (each holds every expert and exchanges inside itself) is predicted "
            f"{ratio:.2f}x faster here than one group of 8: set strategy.expert_parallel_size=4 (or auto)")
        assert line in capsys.readouterr().out
    # the README's `strategy.mode=ep cluster=cpu2` job, its routing skewed (half the choices
    # on one expert): plain data parallelism is predicted faster, by less than HINT_RATIO:
    # nothing is said (it said "1.02x faster", a nag)
    from lightning_hetermoe.strategy.selection import HINT_RATIO

    tiny = from_cfg(ModelConfig, OmegaConf.load(CONF / "model" / "tiny.yaml"), "model")
    cluster = shipped("cpu2")
    clock = RunClock(cluster, None, rank=0)
    clock.bind(tiny, 8, 64, 2, cluster.specs(), optimizer=OptimConfig())
    E = tiny.moe.num_experts
    clock.batch_loads = [[[0.5] + [0.5 / (E - 1)] * (E - 1)] * tiny.n_layers]
    ratio = clock.step_time(Simulated("ep", ep_size=2)) / clock.step_time(Simulated("ep", ep_size=1))
    times = clock.ep_step_times("ep")
    assert min(times, key=times.get) == 1 and 1 < ratio < HINT_RATIO
    assert suggest_ep_size(clock, "ep", 2) is None and "hetermoe[ep]" not in capsys.readouterr().out


def test_ep_size_auto_takes_the_fastest_group_that_fits_and_says_so(capsys):
    """``expert_parallel_size="auto"`` under ``mode="ep"``: the size :meth:`ep_step_times`
    prices shortest, in one line; where one group over the world is fastest, it says that."""
    from lightning_hetermoe.strategy.run_clock import RunClock
    from lightning_hetermoe.strategy.selection import chosen_ep_size

    model = workload_model("d1")
    for name, world in (("n2_mixed", 8), ("a40x2_v100x2", 4)):
        cluster = shipped(name)
        clock = RunClock(cluster, None, rank=0)
        clock.bind(model, 4, 4096, world, cluster.specs())
        times = clock.ep_step_times("ep")
        k = chosen_ep_size(clock, "ep", world)
        line = capsys.readouterr().out.strip()
        assert k == min(times, key=times.get) and line.startswith(f"hetermoe[ep]: expert_parallel_size=auto: {k}, ")
        if k == world:
            assert line.endswith(f"one EP group of {world} (each rank a 1/{world} slice of the experts)")
        else:
            assert f"{world // k} EP groups of {k}" in line and \
                line.endswith(f"predicted {times[world] / times[k]:.2f}x faster than one group of {world}")


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="zebra", expert_parallel_size="auto"), "expert_parallel_size is for mode='ep'"),
    (dict(mode="ep", expert_parallel_size="fast"), "expert_parallel_size='fast' is invalid: must be an integer >= 1 "
                                                   "or 'auto'"),
    (dict(mode="ep", expert_parallel_size=0), "expert_parallel_size=0 is invalid"),
])
def test_ep_size_takes_a_number_or_auto_and_names_the_field_otherwise(kwargs, message):
    from lightning_hetermoe.configs import ConfigError

    with pytest.raises(ConfigError, match=message):
        HeterMoEStrategy(**kwargs)


def test_ep_size_auto_fits_any_world():
    """Any world size divides into the sizes auto picks from (its memory check:
    ``test_memory_budget.py``)."""
    args = HeterMoEStrategy(mode="ep", expert_parallel_size="auto").args
    for world in (1, 3, 6):
        args.check_world(world)
    assert args.fixed_ep_size is None
    assert HeterMoEStrategy(mode="ep", expert_parallel_size=2).args.fixed_ep_size == 2
