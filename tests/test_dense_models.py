"""A LightningModule without MoE layers (Lightning's BoringModel shape: a Linear on random
data) under the strategy: auto, ep and datacentric train it as DDP does, to the weight;
zebra and distep refuse it before any process starts, naming a mode that trains it."""

from __future__ import annotations

import contextlib
import io

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy
from lightning_hetermoe.configs import ConfigError
from reference import trainer

TRAINS = ("auto", "ep", "datacentric")


class Dense(L.LightningModule):
    """BoringModel's shape, with a target that moves every weight and its own data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), x[:, :2] * 3 + 1)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), x[:, :2] * 3 + 1), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=gen)), batch_size=4)


def fit_each(rank: int, modes: tuple[str, ...]) -> dict:
    out = {}
    for mode in modes:
        model = Dense()
        strategy = "ddp" if mode == "ddp" else HeterMoEStrategy(mode=mode)
        t = trainer(strategy, 2, max_steps=6, limit_val_batches=2, val_check_interval=3)
        printed = io.StringIO()  # what this rank prints (a forked rank's stdout is not the test's)
        with contextlib.redirect_stdout(printed):
            t.fit(model, loader(), loader())
        out[mode] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                     "val_loss": float(t.callback_metrics["val_loss"]),
                     "schedule": None if mode == "ddp" else t.strategy.schedule}
        # Lightning's own demo model, its own data and optimizer (SGD with a step schedule)
        torch.manual_seed(3)
        boring = BoringModel()
        t = trainer("ddp" if mode == "ddp" else HeterMoEStrategy(mode=mode), 2, max_steps=4)
        with contextlib.redirect_stdout(printed):
            t.fit(boring)
        out[mode]["boring"] = {k: v.detach().clone() for k, v in boring.state_dict().items()}
        out[mode]["printed"] = printed.getvalue()
    return out


@pytest.mark.slow
def test_a_model_without_moe_layers_trains_as_ddp_under_auto_ep_and_datacentric():
    per_rank = run_ranks(2, fit_each, ("ddp", *TRAINS))
    initial = Dense().state_dict()
    torch.manual_seed(3)
    boring_initial = BoringModel().state_dict()
    for rank in range(2):
        ddp = per_rank[rank]["ddp"]
        for mode in TRAINS:
            got = per_rank[rank][mode]
            assert got["schedule"] == "ep", (mode, got["schedule"])  # expert parallelism with no experts
            for name, want in ddp["state"].items():
                assert (want - initial[name]).abs().max() > 1e-3, f"{name} never trained"
                torch.testing.assert_close(got["state"][name], want, rtol=0, atol=1e-6, msg=f"{mode}: {name}")
            assert got["val_loss"] == pytest.approx(ddp["val_loss"], abs=1e-6), mode
            for name, want in ddp["boring"].items():
                assert (want - boring_initial[name]).abs().max() > 1e-3, f"Boring {name} never trained"
                torch.testing.assert_close(got["boring"][name], want, rtol=0, atol=1e-6, msg=f"{mode}: Boring {name}")
    for mode in TRAINS:  # one line per run says so, on rank 0 only
        for name in ("Dense", "BoringModel"):
            line = f"hetermoe[{mode}]: {name} holds no lightning_hetermoe.MoELayer: it trains as plain DDP over 2 ranks"
            printed = [per_rank[rank][mode]["printed"] for rank in range(2)]
            assert printed[0].count(line) == 1 and line not in printed[1], (mode, printed[0][-2000:])


@pytest.mark.parametrize("mode", ["zebra", "distep"])
def test_zebra_and_distep_refuse_a_model_without_moe_layers_before_any_process_starts(mode):
    strategy = HeterMoEStrategy(mode=mode, start_method="spawn")
    t = trainer(strategy, 2, max_steps=1)
    with pytest.raises(ConfigError, match=rf"mode='{mode}' splits each step at the MoE layers' experts and Dense "
                                          r"holds no lightning_hetermoe.MoELayer: mode='auto', 'ep' or 'datacentric' "
                                          r"trains it as plain DDP"):
        t.fit(Dense(), loader())
    assert not getattr(strategy.launcher, "procs", None)  # refused before launch


@pytest.mark.parametrize("kwargs, field", [
    (dict(cluster={"name": "emu", "devices": ["a40", "v100"], "emulate": True}), "emulate=true"),
    (dict(mode="ep", batch_split="speed", cluster={"name": "mix", "devices": ["a40", "v100"]}),
     "batch_split='speed'"),
])
def test_settings_that_only_mean_something_for_moe_layers_are_refused_for_a_dense_model(kwargs, field):
    strategy = HeterMoEStrategy(start_method="spawn", **kwargs)
    with pytest.raises(ConfigError, match=rf"{field} .* Dense holds no lightning_hetermoe.MoELayer: .*plain DDP"):
        trainer(strategy, 2, max_steps=1).fit(Dense(), loader())
