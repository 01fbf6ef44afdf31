"""Optimizer state of the replicated dense weights kept once per replica group (ZeRO-1):
each rank's AdamW state covers its range of the dense parameters and its own experts, and
training equals one process, gradient clipping by the global norm included."""

from __future__ import annotations

import copy

import lightning as L
import pytest

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, MoELayer, OptimConfig
from reference import assert_same_params, data, make_model, reference_fit, trainer

pytestmark = pytest.mark.slow

STEPS = 4
CLIP = 0.05  # small enough that every step clips


def held(model, optimizer) -> dict[str, int]:
    """Elements of AdamW moments on this rank, dense and expert, and what the rank holds."""
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    out = {"dense_state": 0, "expert_state": 0, "dense": 0, "experts": 0}
    for p in model.parameters():
        out["experts" if id(p) in experts else "dense"] += p.numel()
    inner = getattr(optimizer, "_optimizer", optimizer)
    for p, state in inner.state.items():
        kind = "expert_state" if id(p) in experts else "dense_state"
        out[kind] += state["exp_avg"].numel()
    return out


class Held(L.Callback):
    """What the rank holds at the end of training (before the model is gathered back)."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.held = held(pl_module, trainer.optimizers[0])


def fits(rank: int, world: int, cases: list[tuple[str, object, bool]]) -> list:
    out = []
    for mode, plan, shard in cases:
        m = make_model(4, seed=rank, optim=OptimConfig())
        probe = Held()
        # sharded checkpoints: what ZeRO-1 needs (a model this small would save one file under auto)
        t = trainer(HeterMoEStrategy(mode=mode, plan=plan, shard_optimizer_state=shard, checkpoint_format="sharded"),
                    world, max_steps=STEPS,
                    gradient_clip_val=CLIP, callbacks=[probe])
        t.fit(m, datamodule=data(world))
        out.append((m.state_dict() if rank == 0 else None, probe.held))
    return out


@pytest.fixture(scope="module")
def expected():
    m = make_model(4, optim=OptimConfig())
    initial = copy.deepcopy(m.state_dict())
    return initial, reference_fit(m, STEPS, clip=CLIP)


def test_dense_optimizer_state_is_split_over_replicas_and_training_is_unchanged(expected):
    from helpers_zebra import make_test_plan

    plan = make_test_plan(4, [0, 1], R=2, num_experts=4)  # two attention ranks share the dense part
    cases = [("ep", None, True), ("ep", None, False), ("zebra", plan, True), ("datacentric", None, True)]
    results = run_ranks(2, fits, 2, cases[:2] + cases[3:])
    zebra = run_ranks(4, fits, 4, [cases[2]])
    initial, want = expected
    for c, (mode, _, shard) in enumerate(cases[:2] + cases[3:]):
        state, _ = results[0][c]
        assert_same_params(state, want, initial)
        per_rank = [results[r][c][1] for r in range(2)]
        dense = per_rank[0]["dense"]
        split = [h["dense_state"] for h in per_rank]
        if shard:
            assert sum(split) == dense and max(split) < dense, (mode, split, dense)
        else:
            assert split == [dense, dense], (mode, split)
        for h in per_rank:  # every rank's expert state is its own experts' (ep) or range (datacentric)
            assert h["expert_state"] == h["experts"], (mode, h)
    state, _ = zebra[0][0]
    assert_same_params(state, want, initial)
    attention = [zebra[r][0][1] for r in (0, 1)]
    assert sum(h["dense_state"] for h in attention) == attention[0]["dense"]
    assert all(0 < h["dense_state"] < h["dense"] for h in attention), attention
    assert zebra[2][0][1]["dense_state"] == zebra[3][0][1]["dense_state"] == 0, "expert ranks hold no dense state"
