"""Two vendors in one job (HETHUB's setting: NVIDIA and AMD GPUs together): no device
communicator may span them. On real gloo processes playing an H100 and two MI250X, the
recorder must show every collective whose members span vendors on the staged path, every
other device collective on a one-vendor group, and training equal to one process."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig, comm
from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.cluster.topology import cluster_topology
from reference import assert_same_params, data, make_model, reference_fit, trainer
from helpers_zebra import GLOBAL, STEPS, WINDOWS, make_test_plan, pieces

DEVICES = ["h100", "mi250x", "mi250x"]
VENDORS = [spec.vendor for spec in ClusterConfig(devices=DEVICES).specs()]


def fit_recorded(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        with comm.record() as calls:
            model = make_model(4, seed=rank, optim=OptimConfig())
            strategy = HeterMoEStrategy(mode=case["mode"], plan=case.get("plan"), cluster={"devices": DEVICES})
            t = trainer(strategy, world, max_steps=STEPS)
            t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
            backend = t.strategy._process_group_backend
        out.append({"state": {k: v.clone() for k, v in model.state_dict().items()}, "backend": backend,
                    "calls": [dataclasses.asdict(c) for c in calls]})
    return out


@pytest.mark.slow
def test_two_vendors_never_share_a_device_communicator_and_train_as_one_process():
    plan = dataclasses.replace(make_test_plan(3, [0], R=2), devices=DEVICES)
    cases = [dict(mode="zebra", plan=plan), dict(mode="ep")]
    per_rank = run_ranks(3, fit_recorded, 3, cases)
    for c, case in enumerate(cases):
        calls = [[comm.Call(**x) for x in per_rank[r][c]["calls"]] for r in range(3)]
        assert comm.check_sequences(calls) == []
        assert all(per_rank[r][c]["backend"] == "gloo" for r in range(3))  # the default group: gloo
        paths: dict[str, set] = {}
        for rank_calls in calls:
            for call in rank_calls:
                spans = len({VENDORS[r] for r in call.ranks}) > 1
                if call.traffic == comm.DEVICE:
                    # a device communicator never spans vendors; a staged one always does
                    assert call.path == (comm.STAGED if spans else comm.DEVICE), call
                else:
                    assert call.path == comm.HOST, call
                paths.setdefault(call.what, set()).add(call.path)
        if case["mode"] == "zebra":
            # token rows and answers cross from the H100 to the MI250Xs; the experts' replicas
            # and the dense weights stay on one vendor
            assert paths["zebra.rows"] == {comm.STAGED} and paths["zebra.answers"] == {comm.STAGED}, paths
        else:
            # DDP's gradient buckets went through comm's hook, staged over the world
            assert paths["ddp.grads"] == {comm.STAGED} and paths["ep.rows"] == {comm.STAGED}, paths

        model = make_model(4, seed=0, optim=OptimConfig())
        initial = copy.deepcopy(model.state_dict())
        cut = pieces(plan, "zebra") if case["mode"] == "zebra" else None
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[3], windows=WINDOWS[3], pieces=cut)
        assert_same_params(per_rank[0][c]["state"], expected, initial)


def test_the_planner_prices_the_staged_path_between_vendors():
    one = cluster_topology(ClusterConfig(devices=["h100", "h100", "h100"]))
    mixed = cluster_topology(ClusterConfig(devices=DEVICES))
    assert one.num_nodes == 1 and mixed.num_nodes == 2  # one island per vendor
    assert mixed.node_of == (0, 1, 1) and mixed.network.kind == "host_staged"
    nodes = cluster_topology(ClusterConfig(nodes=[{"devices": ["h100", "h100"], "link": "nvlink4"},
                                                  {"devices": ["mi250x", "h100"], "link": "pcie4"}],
                                           network="ib_ndr"))
    # the second node splits by vendor; between islands the slower of network and staging
    assert nodes.node_of == (0, 0, 1, 2) and nodes.links[1].kind == "pcie4" and nodes.links[2].kind == "pcie4"
    assert nodes.network.bandwidth_gbps == min(400.0, mixed.network.bandwidth_gbps)
    # a vendor-crossing exchange costs what the staged link costs: the same rows take longer
    rows = [[0, 50, 50], [50, 0, 50], [50, 50, 0]]
    flat_legs = one.matrix_legs(rows, [(0, 1, 2)])
    mixed_legs = mixed.matrix_legs(rows, [(0, 1, 2)])
    assert {link.kind for _, link in mixed_legs} >= {"host_staged"}
    assert all(link.kind != "host_staged" for _, link in flat_legs)


def test_the_planner_prices_rows_between_vendors_at_the_staged_path():
    from lightning_hetermoe.configs import workload_model
    from lightning_hetermoe.plan import make_plan

    m = workload_model("d1")
    kw = dict(seq_len=8192, global_batch_tokens=8192 * 16, num_zp_groups=1, num_attention_ranks=2)
    one = ClusterConfig(name="one", devices=["a40", "a40", "v100", "v100"], link="pcie4")
    # the same GPUs, the V100s declared another vendor's: every zebra row crosses vendors
    two = ClusterConfig(name="two", devices=["a40", "a40", "v100x", "v100x"], link="pcie4",
                        custom_devices={"v100x": {"base": "v100", "vendor": "amd"}})
    a, b = make_plan(one, m, **kw), make_plan(two, m, **kw)
    assert "network_gb" not in a.predicted["zebra"] and b.predicted["zebra"]["network_gb"] > 0
    assert b.predicted["zebra"]["step_time_s"] > a.predicted["zebra"]["step_time_s"]
