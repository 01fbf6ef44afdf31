"""Checkpoints: saving never touches live state, and a checkpoint taken mid-epoch on one
world size resumes on another exactly where the uninterrupted run would be."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from reference import assert_same_params, data, make_model, reference_fit, trainer

WINDOWS = 24  # 3 global batches of 8 per epoch
EPOCHS = 3
STEPS = EPOCHS * WINDOWS // 8
NUM_EXPERTS = 4


def model(seed: int = 0):
    # AdamW's moments and step counts make the optimizer state matter on resume.
    return make_model(NUM_EXPERTS, seed=seed, optim=OptimConfig())


def fit_with_step_checkpoints(rank: int, world: int, ckpt_dir: str, mode: str = "ep", plan=None):
    m = model(seed=rank)
    every = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    t = trainer(HeterMoEStrategy(mode=mode, plan=plan), world, max_epochs=EPOCHS, callbacks=[every],
                enable_checkpointing=True)
    t.fit(m, datamodule=data(world, windows=WINDOWS))
    return m.state_dict() if rank == 0 else None


def resume(rank: int, world: int, ckpt: str, mode: str = "ep", plan=None):
    m = model(seed=100 + rank)  # anything: the checkpoint decides
    t = trainer(HeterMoEStrategy(mode=mode, plan=plan), world, max_epochs=EPOCHS)
    t.fit(m, datamodule=data(world, windows=WINDOWS), ckpt_path=ckpt)
    return m.state_dict() if rank == 0 else None


def save_both(rank: int, world: int, ep_dir: str, zebra_dir: str, plan) -> list | None:
    """Step checkpoints under ep and under zebra, in one start of the ranks."""
    out = [fit_with_step_checkpoints(rank, world, ep_dir), fit_with_step_checkpoints(rank, world, zebra_dir, "zebra",
                                                                                    plan)]
    return out if rank == 0 else None


def resume_each(rank: int, world: int, cases: list[tuple[str, str, object]]):
    """Several resumes (checkpoint, mode, plan) in one start of the ranks."""
    out = [resume(rank, world, ckpt, mode, plan) for ckpt, mode, plan in cases]
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Checkpoints saved by ep and by zebra (1 attention + 1 expert rank, R=2) on 2 ranks, and
    their mid-epoch step-4 checkpoints resumed on 4 ranks: ep's under ep; zebra's under ep
    and under zebra on 2 attention + 2 expert ranks with Asym-EA. Two starts of the ranks."""
    from test_zebra import make_test_plan

    ep_dir, zebra_dir = str(tmp_path_factory.mktemp("ep")), str(tmp_path_factory.mktemp("zebra"))
    plan2 = make_test_plan(2, [0], R=2, num_experts=NUM_EXPERTS)
    saved = run_ranks(2, save_both, 2, ep_dir, zebra_dir, plan2)[0]
    plan4 = make_test_plan(4, [0, 1], R=3, num_experts=NUM_EXPERTS, placement=[[2, 2, 3, 0], [2, 3, 3, 1]])
    cases = [(f"{ep_dir}/step=4.ckpt", "ep", None), (f"{zebra_dir}/step=4.ckpt", "ep", None),
             (f"{zebra_dir}/step=4.ckpt", "zebra", plan4)]
    resumed = run_ranks(4, resume_each, 4, cases)[0]
    m = model()
    return {"ep_dir": Path(ep_dir), "saved": saved, "resumed": resumed, "initial": copy.deepcopy(m.state_dict()),
            "expected": reference_fit(m, STEPS, windows=WINDOWS)}


def test_step_checkpoints_change_nothing_and_resume_mid_epoch_on_another_world(runs):
    expected, initial, ckpt_dir = runs["expected"], runs["initial"], runs["ep_dir"]
    # Saving every 2 steps across 3 epochs: training goes on and ends as without checkpoints.
    assert_same_params(runs["saved"][0], expected, initial)
    names = sorted(p.name for p in ckpt_dir.glob("*.ckpt"))
    assert names == [f"step={s}.ckpt" for s in (2, 4, 6, 8)], names

    ckpt = torch.load(ckpt_dir / "step=4.ckpt", weights_only=False)
    w_up = ckpt["state_dict"]["model.blocks.0.moe.experts.w_up"]
    assert w_up.shape[0] == NUM_EXPERTS, "a checkpoint must hold every expert, not one rank's shard"
    keys = list(ckpt["state_dict"].keys())
    adam = ckpt["optimizer_states"][0]["state"][keys.index("model.blocks.0.moe.experts.w_up")]
    assert adam["exp_avg"].shape == w_up.shape and adam["exp_avg_sq"].shape == w_up.shape
    assert ckpt["epoch"] == 1, "step 4 lies inside epoch 1 (3 steps per epoch): the resume must be mid-epoch"

    # Resumed mid-epoch on 4 ranks (same global batch): the uninterrupted result.
    assert_same_params(runs["resumed"][0], expected, initial)


def test_zebra_checkpoint_resumes_under_ep_and_under_another_zebra_mix(runs):
    assert_same_params(runs["saved"][1], runs["expected"], runs["initial"])
    for resumed in runs["resumed"][1:]:
        assert_same_params(resumed, runs["expected"], runs["initial"])
