"""NCCL's rules, checked on real gloo processes: on every communicator, every member issues
the same collectives in the same order with matching sizes; host metadata and device
tensors go over their own groups; no tensor is made on the host by default where the
device needs it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness import run_ranks
from lightning_hetermoe import ExpertLoadMonitor, HeterMoEStrategy, OptimConfig, comm
from helpers_traffic import DEVICE_TRAFFIC, HOST_TRAFFIC
from reference import data, make_model, trainer
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan

ROOT = Path(__file__).resolve().parents[1]



def recorded(rank: int, world: int, cases: list[dict], ckpt_dir: str) -> list[list[dict]]:
    """Each case: fit with validation, a step checkpoint and the load monitor, then validate;
    every collective this rank issued."""
    out = []
    for c, case in enumerate(cases):
        with comm.record() as calls:
            model = make_model(4, seed=rank, optim=OptimConfig())
            strategy = HeterMoEStrategy(mode=case["mode"], plan=case.get("plan"),
                                        checkpoint_format=case.get("format", "auto"))
            callbacks = [ModelCheckpoint(dirpath=f"{ckpt_dir}/{c}", every_n_train_steps=2, save_top_k=-1),
                         ExpertLoadMonitor(log_every_n_steps=1, plots=False)]
            dm = data(world, GLOBAL[world], windows=WINDOWS[world])
            t = trainer(strategy, world, max_steps=3, callbacks=callbacks, enable_checkpointing=True,
                        limit_val_batches=1, val_check_interval=2)
            t.fit(model, datamodule=dm)
            t.validate(model, datamodule=dm, verbose=False)
        out.append([dataclasses.asdict(call) for call in calls])
    return out


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    asym = [[1, 1, 2, 0], [1, 2, 0, 0]]  # Asym-EA: the attention rank holds experts in both layers
    plan = make_test_plan(3, [0], R=3, placement=asym)
    distep = dataclasses.replace(make_test_plan(3, [0], R=3, placement=asym), distep_microbatches=2)
    # no expert on the attention rank: rounds are early (the next dispatch goes before a
    # round's combine); rank 2 holds nothing of layer 1 (it takes part with empty shares)
    early = make_test_plan(3, [0], R=3, placement=[[1, 1, 2, 2], [1, 1, 1, 1]])
    # ep at the default (this small model: one checkpoint file) and sharded (ZeRO-1's collectives too)
    cases = [dict(mode="ep"), dict(mode="ep", format="sharded", key="ep_sharded"), dict(mode="zebra", plan=plan),
             dict(mode="distep", plan=distep), dict(mode="zebra", plan=early, key="zebra_early")]
    per_rank = run_ranks(3, recorded, 3, cases, str(tmp_path_factory.mktemp("ckpt")))
    return {case.get("key", case["mode"]): [[comm.Call(**c) for c in per_rank[r][i]] for r in range(3)]
            for i, case in enumerate(cases)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ep", "ep_sharded", "zebra", "distep", "zebra_early"])
def test_every_member_of_every_group_issues_the_same_sequence(recordings, mode):
    per_rank = recordings[mode]
    assert comm.check_sequences(per_rank) == []
    ops = {(c.group, c.what) for calls in per_rank for c in calls}
    if mode.startswith("ep"):
        assert {("ep0", "ep.counts"), ("ep0", "ep.rows"), ("world", "ep.balance")} <= ops, ops
        # optimizer state sharded over the replicas only with sharded checkpoints
        assert any(what == "zero.params" for _, what in ops) == (mode == "ep_sharded"), ops
    else:
        # training rounds, validation rounds, checkpoint gathers, the clip norm: all were seen
        assert {("zp0.dispatch", "zebra.header"), ("zp0.dispatch", "zebra.rows"), ("zp0.combine", "zebra.answers"),
                ("zp0", "experts.gather"), ("world", "zebra.loss")} <= ops, ops
        # a header for each forward round only (a backward round moves its forward's sizes):
        # rows = training forward + backward + validation forward rounds, headers = the forward ones
        for calls in per_rank:
            headers = sum(c.what == "zebra.header" for c in calls)
            rows = sum(c.what == "zebra.rows" for c in calls)
            assert rows / 2 <= headers < rows, (headers, rows)
    # every all-to-all moved rows somewhere: the sizes compared above were not all empty
    assert any(sum(c.in_splits) for calls in per_rank for c in calls if c.op == "all_to_all")


@pytest.mark.slow
def test_host_metadata_and_device_tensors_use_their_own_groups(recordings):
    for mode, per_rank in recordings.items():
        # Lightning's broadcasts (the checkpoint directory, each checkpoint's path) and
        # barriers, and the pack's broadcasts (init seeds, the plan) go over the host side
        # too, not the default group (NCCL on GPUs): seen here, so they went through comm
        for what in ("strategy.broadcast", "strategy.barrier"):
            assert all(any(c.what == what for c in calls) for calls in per_rank), (mode, what)
        for rank, calls in enumerate(per_rank):
            for c in calls:
                if c.what in HOST_TRAFFIC:
                    assert c.traffic == comm.HOST and c.device in ("", "cpu"), (mode, rank, c)
                else:
                    assert c.what in DEVICE_TRAFFIC, f"{c.what}: a collective this test does not know"
                    assert c.traffic == comm.DEVICE, (mode, rank, c)
                    # the compute device here is the CPU; on CUDA comm rejects anything else
                    assert c.device == "cpu", (mode, rank, c)
                if c.traffic == comm.HOST and c.dtype:
                    assert c.dtype in ("torch.int64", "torch.float64"), (mode, rank, c)


@pytest.mark.slow
def test_the_sequence_check_catches_a_seeded_mismatch(recordings):
    per_rank = [list(calls) for calls in recordings["zebra"]]
    rows = [i for i, c in enumerate(per_rank[1]) if c.what == "zebra.rows"]
    # one member issues two rounds in the other order
    a, b = rows[0], rows[1]
    per_rank[1][a], per_rank[1][b] = per_rank[1][b], per_rank[1][a]
    problems = comm.check_sequences(per_rank)
    assert problems and any("zebra.rows" in p for p in problems), problems
    # one member sends a row more than its peer expects
    per_rank = [list(calls) for calls in recordings["zebra"]]
    i = next(i for i, c in enumerate(per_rank[0]) if c.what == "zebra.rows" and sum(c.in_splits))
    bad = per_rank[0][i]
    splits = list(bad.in_splits)
    splits[splits.index(max(splits))] += 1
    per_rank[0][i] = dataclasses.replace(bad, in_splits=tuple(splits))
    assert any("expects" in p for p in comm.check_sequences(per_rank))
    # one member issues a collective more
    per_rank = [list(calls) for calls in recordings["zebra"]]
    per_rank[2].append(per_rank[2][-1])
    assert any("different numbers" in p for p in comm.check_sequences(per_rank))
    # one member issues a round's combine before the next round's dispatch where the others
    # issue the dispatch first: each communicator's own sequence still matches
    per_rank = [list(calls) for calls in recordings["zebra_early"]]
    order = [(i, c.what) for i, c in enumerate(per_rank[1]) if c.what in ("zebra.rows", "zebra.answers")]
    i, j = next((x[0], y[0]) for x, y in zip(order, order[1:]) if (x[1], y[1]) == ("zebra.rows", "zebra.answers"))
    per_rank[1][i], per_rank[1][j] = per_rank[1][j], per_rank[1][i]
    problems = comm.check_sequences(per_rank)
    assert problems and all("different orders" in p for p in problems), problems


def _reject_host_tensor_on_device_side(rank: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    comm.configure(torch.device("meta"))  # pretend the compute device is elsewhere
    group = comm.new_group("g", [0], host=True)
    try:
        comm.all_reduce(group, torch.ones(2), what="test.rows")
    except comm.CommError as err:
        message = str(err)
    else:
        message = ""
    comm.forget()
    return message


@pytest.mark.slow
def test_a_host_tensor_given_to_a_device_collective_is_rejected_naming_the_site():
    (message,) = run_ranks(1, _reject_host_tensor_on_device_side)
    assert "test.rows" in message and "compute device is meta" in message, message


def _zebra_communicators(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from lightning_hetermoe.strategy.backends.zebra.layout import Layout, ZebraGroups

    dist.init_process_group("gloo")
    comm.configure(torch.device("cpu"))
    plan = make_test_plan(world, [0, 1], R=2, groups=[([0], [2]), ([1], [3])])  # two ZP groups, not the world
    groups = ZebraGroups.build(Layout.from_plan(plan, rank))
    out = {"zp_is_dispatch": groups.zp.device is groups.dispatch.device,
           "combine_is_dispatch": groups.combine.device is groups.dispatch.device}
    t = torch.ones(3) * (rank + 1)
    comm.all_reduce(groups.zp, t, what="test.sum")  # the shared communicator works for both names
    out["sum"] = t.tolist()
    comm.forget()
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_zebra_opens_no_second_communicator_for_the_same_members_where_traffic_never_overlaps():
    """NCCL communicators cost device memory: the ZP group's checkpoint gathers and clip norm
    ride on the dispatch communicator; dispatch and combine, which run at once, keep theirs."""
    for rank, got in enumerate(run_ranks(4, _zebra_communicators, 4)):
        total = 4.0 if rank in (0, 2) else 6.0  # rank + 1 summed over its ZP group
        assert got == {"zp_is_dispatch": True, "combine_is_dispatch": False, "sum": [total] * 3}, got


FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "randn", "rand", "randint", "eye",
             "linspace"}


def test_code_that_feeds_collectives_never_makes_tensors_on_the_default_device():
    """On CUDA a tensor made without ``device=`` lands on the host; in the code around the
    collectives every factory call says where its tensor lives."""
    files = [ROOT / "lightning_hetermoe" / "comm.py", ROOT / "lightning_hetermoe" / "callbacks" / "load_monitor.py",
             *sorted((ROOT / "lightning_hetermoe" / "strategy").rglob("*.py"))]
    missing = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                    and not any(k.arg == "device" for k in node.keywords):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{node.func.attr}")
    assert not missing, "tensors made without device=: " + ", ".join(missing)
