"""HeterMoEStrategy on real gloo processes against a single-process naive training loop."""

import copy
import importlib

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_hetermoe
from lightning_hetermoe import (
    ByteCorpusDataModule,
    DataConfig,
    HeterMoEStrategy,
    ModelConfig,
    MoEConfig,
    MoELanguageModel,
    OptimConfig,
)

GLOBAL_BATCH = 8

STEPS = 5


def tiny_model(num_experts: int, seed: int = 0) -> MoELanguageModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(num_experts=num_experts, top_k=2, d_ff=12, aux_loss_coef=0.0))
    # The balance loss is a product of batch means, so a per-rank version is not the
    # global one; the z-loss is a plain mean and stays in.
    return MoELanguageModel(cfg, OptimConfig(name="sgd", lr=0.2, warmup_steps=0))


def data(world: int) -> ByteCorpusDataModule:
    dm = ByteCorpusDataModule(DataConfig(seq_len=16, batch_size=GLOBAL_BATCH // world, shuffle=False,
                                         train_windows=64, val_windows=8))
    dm.setup()
    return dm


def reference_training(model: MoELanguageModel, clip: float | None = None) -> dict[str, torch.Tensor]:
    """The naive reference: one process, the whole global batch, plain SGD."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=model.optim_cfg.lr)
    # Rank r of W takes every W-th window of one shared order: per step the ranks together
    # see the same GLOBAL_BATCH windows as this single process.
    loader = DataLoader(data(1).train_set, batch_size=GLOBAL_BATCH, shuffle=False)
    for _, batch in zip(range(STEPS), loader):
        opt.zero_grad()
        model.losses(batch)["loss"].backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def strategy_training(model: MoELanguageModel, devices: int, ep_size: int | None = None,
                      clip: float | None = None) -> dict[str, torch.Tensor]:
    strategy = HeterMoEStrategy(expert_parallel_size=ep_size, start_method="spawn")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=clip)
    trainer.fit(model, datamodule=data(devices))
    return model.state_dict()


def assert_same_params(actual, expected, initial):
    assert actual.keys() == expected.keys()
    for name in expected:
        moved = (expected[name] - initial[name]).abs().max()
        assert moved > 0 or "noise" in name, f"{name} never trained: the comparison would be vacuous"
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("devices,num_experts,ep_size", [
    (2, 4, None),  # 2 experts per rank
    (4, 3, None),  # uneven, and one rank holds no expert at all: 1+1+1+0
    (4, 8, 2),     # 2 expert-parallel groups of 2 ranks: expert replicas reduced across groups
])
def test_multiprocess_training_matches_single_process(devices, num_experts, ep_size):
    model = tiny_model(num_experts)
    initial = copy.deepcopy(model.state_dict())
    expected = reference_training(model)
    actual = strategy_training(model, devices, ep_size)
    assert_same_params(actual, expected, initial)


def test_gradient_clipping_uses_the_global_norm():
    """Each rank sees different experts: clipping by a per-rank norm would desynchronise
    the dense weights and differ from clipping the whole model."""
    model = tiny_model(4)
    initial = copy.deepcopy(model.state_dict())
    clip = 0.05
    expected = reference_training(model, clip)
    unclipped = reference_training(model)
    assert (expected["model.head.weight"] - unclipped["model.head.weight"]).abs().max() > 1e-3, "clip never bit"
    actual = strategy_training(model, 2, clip=clip)
    assert_same_params(actual, expected, initial)


def test_string_resolves_to_strategy_and_reimport_is_safe():
    importlib.reload(lightning_hetermoe)
    trainer = L.Trainer(strategy="hetermoe", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, HeterMoEStrategy)
    assert trainer.strategy.mode == "ep"
    spawn = L.Trainer(strategy="hetermoe_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(spawn.strategy, HeterMoEStrategy)
    assert spawn.strategy._start_method == "spawn"


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode='pipeline'.*ep"):
        HeterMoEStrategy(mode="pipeline")
    with pytest.raises(ValueError, match="zebra.*not available"):
        HeterMoEStrategy(mode="zebra")


def test_expert_parallel_size_must_divide_world_before_launch():
    with pytest.raises(ValueError, match="expert_parallel_size=3"):
        L.Trainer(strategy=HeterMoEStrategy(expert_parallel_size=3), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ValueError, match="expert_parallel_size=0"):
        HeterMoEStrategy(expert_parallel_size=0)


def test_cluster_size_must_match_devices_before_launch():
    cluster = {"name": "three", "devices": ["cpu", "cpu", "cpu"]}
    with pytest.raises(ValueError, match="cluster 'three' names 3 devices"):
        L.Trainer(strategy=HeterMoEStrategy(cluster=cluster), accelerator="cpu", devices=2, logger=False)


def test_bad_model_config():
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown field"):
        lightning_hetermoe.from_cfg(ModelConfig, {"d_modle": 32})
