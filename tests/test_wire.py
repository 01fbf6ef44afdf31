"""What travels, and at what price (#29): under bf16-mixed every activation and weight a
step sends goes in bf16 (the experts compute in it: the same values, half the bytes), every
gradient sync in fp32, and the cost model prices each at those widths: recorded against
priced on real gloo processes, call by call and, for the data-centric gathers, byte by byte."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig, comm
from lightning_hetermoe.model_contract import describe_model
from lightning_hetermoe.profile import CostModel
from reference import data, make_model, trainer
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan

STEPS = 2
# what each data collective carries: activations/weights (priced at dtype_bytes) or gradients (grad_bytes)
ACTIVATIONS = ("ep.rows", "zebra.rows", "zebra.answers", "datacentric.gather")
GRADIENTS = ("datacentric.grads", "zebra.grads.dense", "zebra.grads.replicas", "ep.grads.copies",
             "ep.grads.replicas")


class CountCommunicators(L.Callback):
    """The device communicators this rank opened, read while the process group still runs."""

    def on_train_end(self, trainer, pl_module):
        self.opened = {",".join(map(str, ranks)): n for ranks, n in comm.communicators_opened().items()}


def recorded(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        model = make_model(4, seed=rank, optim=OptimConfig())
        counter = CountCommunicators()
        with comm.record() as calls:
            strategy = HeterMoEStrategy(mode=case["mode"], plan=case.get("plan"))
            t = trainer(strategy, world, max_steps=STEPS, precision="bf16-mixed", callbacks=[counter])
            t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out.append({"calls": [dataclasses.asdict(c) for c in calls], "config": dataclasses.asdict(describe_model(model)),
                    "opened": counter.opened})
    return out


@pytest.fixture(scope="module")
def recordings():
    cases = [dict(mode="ep"), dict(mode="zebra", plan=make_test_plan(2, [0], R=2)), dict(mode="datacentric"),
             dict(mode="zebra", plan=make_test_plan(2, [0], R=2))]  # a second fit in the same processes
    per_rank = run_ranks(2, recorded, 2, cases)
    # a mode's first case (the second zebra fit is there for what it opens, checked below)
    by_mode = {}
    for i, case in enumerate(cases):
        by_mode.setdefault(case["mode"], [([comm.Call(**c) for c in per_rank[r][i]["calls"]], per_rank[r][i]["config"],
                                            per_rank[r][i]["opened"]) for r in range(2)])
    by_mode["zebra again"] = [(None, None, per_rank[r][3]["opened"]) for r in range(2)]
    return by_mode


def _kind(what: str) -> str | None:
    for name in ACTIVATIONS + GRADIENTS:
        if what == name or what.startswith(name + "."):
            return "activations" if name in ACTIVATIONS else "gradients"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ep", "zebra", "datacentric"])
def test_every_data_collective_travels_at_the_width_it_is_priced_at(recordings, mode):
    cost = CostModel(precision="bf16-mixed")
    width = {"activations": cost.dtype_bytes, "gradients": cost.grad_bytes}
    seen = set()
    for calls, _, _ in recordings[mode]:
        for c in calls:
            kind = _kind(c.what)
            if kind is None or not c.dtype:
                continue
            seen.add(kind)
            size = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4, "torch.float64": 8}[c.dtype]
            assert size == width[kind], f"{mode}: {c.what} sent {c.dtype}, priced at {width[kind]} bytes"
    assert "activations" in seen, seen  # the rows (or weights) were recorded: the check above bit


@pytest.mark.slow
def test_the_data_centric_gathers_move_the_bytes_the_simulator_prices(recordings):
    from lightning_hetermoe.configs import ModelConfig, from_cfg
    from lightning_hetermoe.profile.timer import CostModelTimer

    calls, cfg, _ = recordings["datacentric"][0]
    model = from_cfg(ModelConfig, cfg)
    timer = CostModelTimer(model, model.max_seq_len, CostModel(precision="bf16-mixed"))
    from lightning_hetermoe.simulate.datacentric import layer_weight_bytes

    W = 2
    per_layer = {}  # bytes this rank moved off-rank per gather: (W - 1) chunks of what it sent
    for c in calls:
        if c.what.startswith("datacentric.gather."):
            n = 1
            for s in c.shape:
                n *= s
            per_layer.setdefault(c.what, []).append((W - 1) * n * {"torch.bfloat16": 2, "torch.float32": 4}[c.dtype])
    # forward gather and backward re-gather, every step, every layer; each call one expert tensor
    assert len(per_layer) == model.n_layers
    for what, sizes in per_layer.items():
        assert len(sizes) % (2 * STEPS) == 0 and sizes, (what, len(sizes))
        moved = sum(sizes) / (2 * STEPS)
        priced = layer_weight_bytes(model, timer) * (W - 1) / W  # an even split of the layer over two ranks
        assert moved == pytest.approx(priced, rel=0.02), (what, moved, priced)
    scattered = [c for c in calls if c.what == "datacentric.grads"]
    assert scattered and all(c.dtype == "torch.float32" for c in scattered)


# Each NCCL communicator costs hundreds of MB on every member. ep's one EP group and data-
# centric's group have the world's members and share its communicator; zebra keeps the world's
# and one per direction of its rounds (dispatch and combine run at once, from two fibers), and
# its ZP group's gathers share the world's. The cases run one after the other in the same two
# processes (one process group): what each fit adds is counted, and a second zebra fit adds none.
OPENED_SO_FAR = {"ep": 1, "zebra": 3, "datacentric": 3, "zebra again": 3}


@pytest.mark.slow
def test_groups_with_the_same_members_share_a_communicator(recordings):
    for rank in range(2):
        opened = {mode: recordings[mode][rank][2] for mode in OPENED_SO_FAR}
        assert opened == {mode: {"0,1": n} for mode, n in OPENED_SO_FAR.items()}, f"rank {rank}: {opened}"
