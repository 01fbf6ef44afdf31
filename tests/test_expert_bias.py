"""Aux-loss-free balancing under the strategy: every router's bias moves once per optimizer
step by the *global* load, identically on every rank, equal to one process training on the
global batch (whose update the reference writes out itself), under expert parallelism and
zebra; the bias is saved in checkpoints and a zebra checkpoint resumes under ep."""

from __future__ import annotations

import copy

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness import run_ranks
from lightning_hetermoe import ExpertLoadMonitor, HeterMoEStrategy, OptimConfig
from reference import assert_same_params, data, make_model, reference_fit, trainer, whole_checkpoint
from helpers_zebra import make_test_plan
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 5
SAVED = 3


def model(seed: int):
    return make_model(4, seed=seed, optim=OptimConfig(), expert_bias=True)


def biases(m) -> list[torch.Tensor]:
    return [t.clone() for n, t in m.state_dict().items() if n.endswith("expert_bias")]


def fits(rank: int, world: int, ckpt_dir: str) -> dict:
    out = {}
    m = model(seed=rank)
    monitor = ExpertLoadMonitor(log_every_n_steps=1, plots=False)
    trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS, callbacks=[monitor]).fit(m, datamodule=data(world))
    out["ep"] = m.state_dict(), biases(m), getattr(monitor, "last_metrics", None)

    m = model(seed=rank)
    save = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=SAVED, save_top_k=-1)
    plan = make_test_plan(world, [0], R=2)
    trainer(HeterMoEStrategy(mode="zebra", plan=plan), world, max_steps=STEPS, callbacks=[save],
            enable_checkpointing=True).fit(m, datamodule=data(world))
    out["zebra"] = m.state_dict(), biases(m), None

    m = model(seed=100 + rank)  # the checkpoint decides
    trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS).fit(m, datamodule=data(world),
                                                                     ckpt_path=f"{ckpt_dir}/step={SAVED}.ckpt")
    out["resumed"] = m.state_dict(), biases(m), None
    return out


def test_bias_moves_by_the_global_load_alike_on_every_rank_and_resumes(tmp_path):
    per_rank = run_ranks(2, fits, 2, str(tmp_path))
    m = model(seed=0)
    initial = copy.deepcopy(m.state_dict())
    expected = reference_fit(m, STEPS)
    want = [t for n, t in expected.items() if n.endswith("expert_bias")]
    assert len(want) == 2 and all(b.abs().max() > 0 for b in want), "the reference bias never moved"
    ckpt = whole_checkpoint(tmp_path / f"step={SAVED}.ckpt")
    assert sum(n.endswith("expert_bias") for n in ckpt["state_dict"]) == 2, "the bias is not in the checkpoint"
    for run in ("ep", "zebra", "resumed"):
        state, bias0, _ = per_rank[0][run]
        _, bias1, _ = per_rank[1][run]
        for a, b in zip(bias0, bias1, strict=True):  # zebra's expert rank routes nothing, yet moves alike
            assert torch.equal(a, b), run
        # the bias steps by 1e-3 per step: equal to the reference exactly, not nearly
        for got, w in zip(bias0, want, strict=True):
            assert torch.equal(got, w), (run, got, w)
        assert_same_params(state, expected, initial)
    metrics = per_rank[0]["ep"][2]
    assert metrics["moe_load/layer0_bias_spread"] == float(want[0].max() - want[0].min())
