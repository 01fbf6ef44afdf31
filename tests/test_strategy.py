"""HeterMoEStrategy's construction and the checks it makes before any process starts.

Training equivalence lives in test_equivalence.py (EP) and test_zebra.py (zebra, distep)."""

import importlib

import lightning as L
import pytest
import torch
from torch import nn

import lightning_hetermoe
from lightning_hetermoe import HeterMoEStrategy, ModelConfig, MoEConfig, MoELayer
from lightning_hetermoe.configs import ConfigError
from reference import data


def test_string_resolves_to_strategy_and_reimport_is_safe():
    importlib.reload(lightning_hetermoe)
    trainer = L.Trainer(strategy="hetermoe", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, HeterMoEStrategy)
    assert trainer.strategy.mode == "auto"  # resolved at set-up: see test_selection.py
    spawn = L.Trainer(strategy="hetermoe_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(spawn.strategy, HeterMoEStrategy)
    assert spawn.strategy._start_method == "spawn"


def test_unknown_mode_is_rejected():
    with pytest.raises(ConfigError, match="mode='pipeline'.*ep"):
        HeterMoEStrategy(mode="pipeline")


def test_bad_arguments_are_rejected_with_the_field():
    with pytest.raises(ConfigError, match="plan='garbage' is invalid: expected a Plan.*no such file"):
        HeterMoEStrategy(mode="zebra", plan="garbage")
    with pytest.raises(ConfigError, match="expert_parallel_size=0"):
        HeterMoEStrategy(mode="ep", expert_parallel_size=0)
    with pytest.raises(ConfigError, match="batch_split='fast' is invalid"):
        HeterMoEStrategy(batch_split="fast")
    with pytest.raises(ConfigError, match="batch_split='speed' needs a cluster"):
        L.Trainer(strategy=HeterMoEStrategy(mode="ep", batch_split="speed"), accelerator="cpu", devices=2,
                  logger=False)


@pytest.mark.slow
def test_expert_parallel_size_must_divide_world_before_launch():
    with pytest.raises(ConfigError, match="expert_parallel_size=3"):
        L.Trainer(strategy=HeterMoEStrategy(mode="ep", expert_parallel_size=3), accelerator="cpu", devices=2,
                  logger=False)


@pytest.mark.slow
def test_cluster_size_must_match_devices_before_launch():
    cluster = {"name": "three", "devices": ["cpu", "cpu", "cpu"]}
    with pytest.raises(ConfigError, match="cluster 'three' names 3 devices"):
        L.Trainer(strategy=HeterMoEStrategy(cluster=cluster), accelerator="cpu", devices=2, logger=False)


class HeadlessBlock(nn.Module):
    """A block whose token mixer states no head count."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(16, 16)
        self.moe = MoELayer(16, MoEConfig(num_experts=4, d_ff=8))

    def forward(self, x):
        x = x + self.mix(x)
        y, aux = self.moe(x)
        return x + y, aux


class NoHeadsModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.block = HeadlessBlock()
        self.head = nn.Linear(16, 256)

    def training_step(self, batch, batch_idx):
        x, aux = self.block(self.embed(batch[0]))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def spawn_trainer(strategy):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


@pytest.mark.slow
def test_emulation_needs_head_count_and_says_so_before_launch():
    emulated = {"name": "emu", "devices": ["a40", "v100"], "emulate": True, "time_scale": 1000.0}
    strategy = HeterMoEStrategy(cluster=emulated, start_method="spawn")
    with pytest.raises(ConfigError, match=r"no attention head count: planning and emulation read an int attribute "
                                          r"n_heads / num_heads / num_attention_heads"):
        spawn_trainer(strategy).fit(NoHeadsModel(), datamodule=data(2))
    assert not strategy.launcher.procs if hasattr(strategy.launcher, "procs") else True


def test_model_without_moe_layer_passes_where_it_trains_as_ddp_and_is_refused_naming_those_modes_elsewhere():
    plain = nn.Sequential(nn.Linear(4, 4))
    for mode in ("auto", "ep", "datacentric"):  # set-up prints that it trains as DDP (tests/test_dense_models.py)
        HeterMoEStrategy(mode=mode).check_model(plain)
    with pytest.raises(ConfigError, match="Sequential holds no lightning_hetermoe.MoELayer: mode='auto', 'ep' or "
                                          "'datacentric' trains it as plain DDP"):
        HeterMoEStrategy(mode="zebra").check_model(plain)


def test_bad_model_config():
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown field"):
        lightning_hetermoe.from_cfg(ModelConfig, {"d_modle": 32})
