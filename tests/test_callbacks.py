"""The callbacks and Trainer features people add, under every mode, on real gloo processes:
each behaves as under DDP, on every rank alike (a decision taken on one rank and not the
others would hang the next collective)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, MoELanguageModel, OptimConfig
from reference import data, make_model, reference_fit, trainer
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan

MODES = ("ep", "zebra", "distep", "datacentric")


def _strategy(mode: str, world: int) -> HeterMoEStrategy:
    if mode in ("zebra", "distep"):
        return HeterMoEStrategy(mode=mode, plan=make_test_plan(world, [0], R=2))
    return HeterMoEStrategy(mode=mode)


def watched_fit(rank: int, world: int, root: str) -> dict:
    """Checkpoint the best two by val_loss, stop early, monitor the LR, validate twice an
    epoch on a limited number of batches, in every mode (zebra's attention blocks compiled,
    the way the strategy allows torch.compile)."""
    out = {}
    for mode in MODES:
        model = make_model(4, seed=rank, optim=OptimConfig())
        if mode == "zebra":
            for block in model.model.blocks:
                block.attn = torch.compile(block.attn, backend="aot_eager")
        where = os.path.join(root, mode)
        ckpt = ModelCheckpoint(dirpath=where, monitor="val_loss", mode="min", save_top_k=2, filename="{step}")
        # never improves by 1e9: stops at its second check, with wait_count 1
        stop = EarlyStopping(monitor="val_loss", mode="min", patience=1, min_delta=1e9)
        lr = LearningRateMonitor(logging_interval="step")
        t = trainer(_strategy(mode, world), world, max_steps=40, callbacks=[ckpt, stop, lr],
                    enable_checkpointing=True, logger=CSVLogger(where, name="log"), log_every_n_steps=1,
                    limit_val_batches=2, val_check_interval=4, limit_train_batches=12)
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode] = {"step": t.global_step, "best": ckpt.best_model_path, "top": sorted(ckpt.best_k_models),
                     "score": float(ckpt.best_model_score), "wait": stop.wait_count,
                     "metrics": sorted(t.callback_metrics), "lrs": {k: len(v) for k, v in lr.lrs.items()}}
    return out


@pytest.mark.slow
def test_checkpoint_top_k_early_stopping_and_lr_monitor_behave_as_under_ddp_in_every_mode(tmp_path):
    per_rank = run_ranks(2, watched_fit, 2, str(tmp_path))
    for mode in MODES:
        got = per_rank[0][mode]
        # every rank saw the same metrics and took the same decisions (expert ranks log nothing)
        assert per_rank[1][mode] == got, mode
        assert got["step"] == 8 and got["wait"] == 1, got  # stopped at the second validation (steps 4, 8)
        assert "val_loss" in got["metrics"] and "train_loss" in got["metrics"], got
        assert len(got["top"]) == 2 and all(os.path.exists(p) for p in got["top"]), got
        assert got["lrs"] and all(n == 8 for n in got["lrs"].values()), got  # one LR per step
        # every mode trains the same model: the best val_loss agrees with ep's
        assert got["score"] == pytest.approx(per_rank[0]["ep"]["score"], rel=1e-4), (mode, got["score"])
    logged = (tmp_path / "zebra" / "log" / "version_0" / "metrics.csv").read_text()
    assert "lr-AdamW" in logged.splitlines()[0] and "val_loss" in logged.splitlines()[0]


class PlateauOn(MoELanguageModel):
    """AdamW under ReduceLROnPlateau watching a training loss logged with ``sync_dist`` (as
    under DDP, where a rank's own loss would cut each rank's LR apart), per step or per
    epoch; no patience, and an improvement must beat the best by 1e9: it cuts each time it
    is asked after the first (which finds the first best)."""

    interval = "step"

    def training_step(self, batch, batch_idx):
        out = self.losses(batch)
        self.log("synced_ce", out["ce"], sync_dist=True, on_step=True, on_epoch=True)
        return out["loss"]

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=1e9,
                                                           threshold_mode="abs")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval,
                                                   "monitor": "synced_ce_step" if self.interval == "step"
                                                   else "synced_ce_epoch"}}


class LRs(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def plateau_fit(rank: int, world: int) -> dict:
    out = {}
    for mode in MODES:
        for interval in ("step", "epoch"):
            model = make_model(4, seed=rank, optim=OptimConfig())
            model.__class__ = PlateauOn
            model.interval = interval
            seen = LRs()
            t = trainer(_strategy(mode, world), world, max_epochs=3, limit_train_batches=2, callbacks=[seen])
            t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
            out[(mode, interval)] = seen.lrs
    return out


@pytest.mark.slow
def test_reduce_lr_on_plateau_watching_a_training_metric_steps_alike_on_every_rank_in_every_mode():
    # under zebra and distep the expert ranks log nothing: the monitored metric is shared
    # with them before Lightning steps the scheduler there
    per_rank = run_ranks(2, plateau_fit, 2)
    for (mode, interval), lrs in per_rank[0].items():
        assert per_rank[1][(mode, interval)] == lrs, (mode, interval)
        assert lrs == per_rank[0][("ep", interval)], (mode, interval)
    # asked after every step from the first: cut from the third step's LR on
    assert per_rank[0][("ep", "step")] == [1e-3, 1e-3, 5e-4, 2.5e-4, 1.25e-4, 6.25e-5]
    # asked after epochs 1 and 2 of 3 (two steps each): cut once, for the third
    assert per_rank[0][("ep", "epoch")] == [1e-3] * 4 + [5e-4] * 2


class ReturnsExtras(MoELanguageModel):
    """A training step that returns a dict: the loss, a detached scalar and a per-row tensor."""

    def training_step(self, batch, batch_idx):
        out = self.losses(batch)
        return {"loss": out["loss"], "ce": out["ce"].detach(), "rows": batch[0][:, 0].float()}


class Outputs(L.Callback):
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append({k: float(v) for k, v in outputs.items() if k != "rows"} | {"keys": sorted(outputs)})


def outputs_fit(rank: int, world: int) -> dict:
    out = {}
    for mode in MODES:
        model = make_model(4, seed=0, optim=OptimConfig())
        model.__class__ = ReturnsExtras
        seen = Outputs()
        t = trainer(_strategy(mode, world), world, max_steps=3, callbacks=[seen])
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode] = seen.seen
    return out


@pytest.mark.slow
def test_a_training_step_s_extra_scalars_reach_on_train_batch_end_in_every_mode():
    per_rank = run_ranks(2, outputs_fit, 2)
    ep = [per_rank[0]["ep"], per_rank[1]["ep"]]
    assert [s["keys"] for s in ep[0]] == [["ce", "loss", "rows"]] * 3  # as under DDP: each rank's own
    for mode in ("zebra", "distep"):
        mine = per_rank[0][mode]
        assert per_rank[1][mode] == mine, mode  # the expert rank too, though it ran no training_step
        # the global batch's means (one sequence per micro-batch, equal token counts): the
        # mean of ep's two ranks' own, step by step (every mode trains the same model);
        # per-row tensors have no global mean and are left out (said once)
        assert [s["keys"] for s in mine] == [["ce", "loss"]] * 3, mode
        for step, got in enumerate(mine):
            for key in ("ce", "loss"):
                assert got[key] == pytest.approx((ep[0][step][key] + ep[1][step][key]) / 2, rel=1e-4), (mode, step)


def test_the_extras_of_a_training_step_are_its_scalars_and_must_not_change():
    from lightning_hetermoe.strategy.backends.zebra.executor import ZebraContractError
    from lightning_hetermoe.strategy.backends.zebra.train_outputs import extra_values, extras_of

    result = {"loss": torch.tensor(1.0), "b": torch.tensor([2.0]), "a": 3, "rows": torch.ones(4), "on": True}
    assert extras_of(result) == (["a", "b"], ["on", "rows"])
    assert extras_of(torch.tensor(1.0)) == ([], [])
    assert [float(v) for v in extra_values(result, ["a", "b"], 0)] == [3.0, 2.0]
    with pytest.raises(ZebraContractError, match=r"micro-batch 1 returned the extra scalars \['a', 'b'\].*\['a'\]"):
        extra_values(result, ["a"], 1)


class LogsPerEpoch(MoELanguageModel):
    def training_step(self, batch, batch_idx):
        out = self.losses(batch)
        self.log("ce_epoch", out["ce"], on_step=False, on_epoch=True, sync_dist=True)
        return out["loss"]


def epoch_metric_fit(rank: int, world: int, root: str) -> dict:
    out = {}
    two = dict(plan=make_test_plan(world, [0, 1], R=2, placement=[[0, 0, 1, 1], [0, 0, 1, 1]]))
    for mode, kwargs in (("ep", {}), ("zebra", two), ("distep", two), ("auto", {})):
        model = make_model(4, seed=0, optim=OptimConfig())
        model.__class__ = LogsPerEpoch
        t = trainer(HeterMoEStrategy(mode=mode, **kwargs), world, max_steps=2, enable_checkpointing=True,
                    default_root_dir=os.path.join(root, mode))
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode] = float(t.callback_metrics["ce_epoch"])
    return out


@pytest.mark.slow
def test_an_epoch_metric_synced_over_two_attention_ranks_ends_the_epoch_in_every_mode(tmp_path):
    # a checkpoint callback (Lightning's default) shares the metrics at the epoch's end: the
    # first read of a sync_dist epoch metric reduces it over the attention ranks, which every
    # one of them must join (it hung when only the first read it)
    per_rank = run_ranks(2, epoch_metric_fit, 2, str(tmp_path), timeout=150)
    assert per_rank[0] == per_rank[1]
    for mode, value in per_rank[0].items():
        assert value == pytest.approx(per_rank[0]["ep"], rel=1e-5), mode


@pytest.mark.slow
def test_gradient_clipping_by_value_equals_one_process_in_every_mode():
    from helpers_zebra import check

    clip = dict(gradient_clip_val=0.002, gradient_clip_algorithm="value")
    check(2, [dict(plan=make_test_plan(2, [0], R=2), trainer=clip),
              dict(plan=make_test_plan(2, [0], R=2), mode="distep", trainer=clip),
              dict(mode="ep", trainer=clip), dict(mode="datacentric", trainer=clip)])


def test_a_compiled_module_is_refused_before_any_process_starts_with_the_reason():
    from lightning_hetermoe.configs import ConfigError

    model = torch.compile(make_model(4, optim=OptimConfig()), backend="eager")
    t = trainer(HeterMoEStrategy(mode="ep"), 2, max_steps=1)
    with pytest.raises(ConfigError, match="does not train a torch.compile'd LightningModule.*compile parts"):
        t.fit(model, datamodule=data(2, 8))


@pytest.mark.slow
def test_lightning_cli_trains_the_main_model_under_the_strategy(tmp_path):
    """``recipes/cli.py``: LightningCLI with the strategy by class path and its own arguments,
    beside the Hydra recipes. (The registered name, ``strategy="hetermoe"``, is a string the
    CLI hands to the Trainer as it is: test_strategy.py and the user script of test_exit.py
    train under it.)"""
    import sys
    from pathlib import Path

    from helpers_exit import EXIT_S, run_to_exit

    root = Path(__file__).resolve().parents[1]
    common = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=3",
              "--trainer.enable_progress_bar=false", "--model.model.d_model=32", "--data.cfg.batch_size=4"]
    done = "`Trainer.fit` stopped: `max_steps=3` reached"
    strategy = ["--trainer.strategy=lightning_hetermoe.HeterMoEStrategy", "--trainer.strategy.mode=zebra"]
    # timed to its exit too (issue #38: every entry point exits within seconds of its work)
    code, out, exit_after_s = run_to_exit([sys.executable, str(root / "recipes" / "cli.py"), "fit", *strategy,
                                           *common], done, cwd=tmp_path, timeout=300, warm=True)
    assert code == 0, out[-3000:]
    assert exit_after_s < EXIT_S and "terminate called" not in out, (exit_after_s, out[-2000:])
    assert "schedule zebra" in out  # the strategy's argument reached it
    assert (tmp_path / "lightning_logs" / "version_0" / "config.yaml").exists()


class NormSeen(L.Callback):
    """The logged ``grad_norm`` after each step, and whether the step's gradients still
    carried the loss scale when it was taken (a fused step unscales inside itself)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.scaled: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scaled.append(bool(scaler is not None and scaler.holds_scaled(optimizer)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.norms.append(float(trainer.callback_metrics["grad_norm"]))


NORM_CASES = {  # name: (mode, strategy kwargs, trainer kwargs)
    **{mode: (mode, {}, {}) for mode in MODES},
    "ep_zero": ("ep", dict(shard_optimizer_state=True), {}),
    "ep_fp16_fused": ("ep", {}, dict(fp16=True)),
}
NORM_CLIP = 0.05  # below every step's norm: the logged norm must be the one before the clip


def _scaler() -> torch.amp.GradScaler:
    # a scale that overflows no step here (at torch's 65536 one step overflows on one process and
    # not on two, whose partial gradients differ in rounding): every step's norm is compared
    return torch.amp.GradScaler("cpu", init_scale=1024.0)


def grad_norm_fit(rank: int, world: int) -> dict:
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_hetermoe import GradNormMonitor

    out = {}
    for name, (mode, kwargs, extra) in NORM_CASES.items():
        model = make_model(4, seed=rank, optim=OptimConfig(fused=True) if extra.get("fp16") else OptimConfig())
        strategy = HeterMoEStrategy(mode=mode, **kwargs) if kwargs else _strategy(mode, world)
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=_scaler())] if extra.get("fp16") else []
        seen = NormSeen()
        t = trainer(strategy, world, max_steps=4, gradient_clip_val=NORM_CLIP, plugins=plugins,
                    callbacks=[GradNormMonitor(log_every_n_steps=1), seen])
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[name] = {"norms": seen.norms, "scaled": seen.scaled}
    return out


@pytest.mark.slow
def test_the_logged_gradient_norm_is_one_process_s_in_every_mode():
    """``GradNormMonitor`` logs the norm of every gradient over all ranks, before the clip and
    without the loss scale: each step's equals the one process's at the same step, in every
    mode, with the dense optimizer state sharded (ZeRO-1), and in fp16 with a fused step
    (whose gradients still carry the scale when it is taken). Lightning's ``grad_norm``
    would give each rank's share."""
    from helpers_zebra import pieces

    got = run_ranks(2, grad_norm_fit, 2)
    for name, (mode, kwargs, extra) in NORM_CASES.items():
        mine, other = got[0][name], got[1][name]
        stats: dict = {}
        model = make_model(4, seed=0, optim=OptimConfig(fused=True) if extra.get("fp16") else OptimConfig())
        plan = make_test_plan(2, [0], R=2) if mode in ("zebra", "distep") else None
        reference_fit(model, 4, global_batch=GLOBAL[2], windows=WINDOWS[2], clip=NORM_CLIP, stats=stats,
                      scaler=_scaler() if extra.get("fp16") else None,
                      pieces=pieces(plan, mode) if plan is not None else None)
        want = stats["grad_norms"]
        assert len(mine["norms"]) == 4 and min(want) > NORM_CLIP, (name, mine["norms"], want)
        if extra.get("fp16"):
            # the first step's parameters are one process's: only the rounding of the partial
            # gradients differs; after it the fp16 runs drift apart as their parameters do (on
            # an AVX-512 EPYC the fourth step's norm lay 4.6e-3 from one process's). What fp16
            # adds here is the scale, 1024x if left on; the sum over ranks is the fp32 cases'
            assert mine["norms"][0] == pytest.approx(want[0], rel=2e-3), (name, mine["norms"], want)
            assert mine["norms"] == pytest.approx(want, rel=1e-2), (name, mine["norms"], want)
        else:
            assert mine["norms"] == pytest.approx(want, rel=1e-5), (name, mine["norms"], want)
        if mode != "zebra" and mode != "distep":  # expert ranks log nothing under zebra: rank 1 is one there
            assert other["norms"] == pytest.approx(mine["norms"], rel=1e-6), name
        if extra.get("fp16"):
            assert all(mine["scaled"]), "the fused step left the scale on: the case exercised unscaling"


@pytest.mark.parametrize("kwargs,field", [(dict(log_every_n_steps=0), "log_every_n_steps=0"),
                                          (dict(log_every_n_steps=2.5), "log_every_n_steps=2.5"),
                                          (dict(name=""), "name=''")])
def test_a_bad_grad_norm_monitor_setting_is_refused_naming_the_field(kwargs, field):
    from lightning_hetermoe import GradNormMonitor

    with pytest.raises(ValueError, match=f"GradNormMonitor {field} is invalid"):
        GradNormMonitor(**kwargs)


class LogsAMetric(MoELanguageModel):
    """The cross-entropy as a torchmetrics ``MeanMetric`` (weighted by targets) logged in
    validation, as Lightning's docs log metrics; with ``compute_everywhere`` also its
    ``compute()`` at the epoch's end on every rank (a hook expert ranks run too)."""

    def add_metric(self, compute_everywhere: bool) -> None:
        import torchmetrics

        self.val_ce = torchmetrics.MeanMetric()
        self.compute_everywhere = compute_everywhere
        self.computed: list[float] = []

    def validation_step(self, batch, batch_idx: int) -> None:
        out = self.losses(batch)
        self.val_ce.update(out["ce"], weight=batch[1].numel())
        self.log("val_ce_metric", self.val_ce)
        self.log("val_loss", out["ce"], sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        import warnings

        if self.compute_everywhere:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an expert rank's metric saw no update: its mean is nan
                self.computed.append(float(self.val_ce.compute()))


METRIC_CASES = [("ep", False), ("datacentric", False), ("zebra", False), ("distep", False), ("zebra", True),
                ("distep", True)]


def metric_fit(rank: int, world: int) -> dict:
    out = {}
    two_attending = make_test_plan(world, [0, 1], R=2)  # rank 2 an expert rank
    for mode, everywhere in METRIC_CASES:
        model = make_model(4, seed=0, optim=OptimConfig())
        model.__class__ = LogsAMetric
        model.add_metric(everywhere)
        plan = two_attending if mode in ("zebra", "distep") else None
        t = trainer(HeterMoEStrategy(mode=mode, plan=plan), world, max_steps=2, limit_val_batches=1.0)
        dm = data(world, GLOBAL[world], windows=WINDOWS[world])
        t.fit(model, datamodule=dm)
        model.computed.clear()  # any validation inside the fit computed already
        got = t.validate(model, datamodule=dm, verbose=False)[0]
        out[(mode, everywhere)] = {"metric": got.get("val_ce_metric"), "loss": got.get("val_loss"),
                                   "computed": model.computed}
    return out


@pytest.mark.slow
def test_a_torchmetrics_metric_logged_in_validation_syncs_over_the_ranks_that_run_the_steps_in_every_mode():
    """Under zebra and distep only the attention ranks run the steps: a logged metric gathers
    over them (it gathered over the world before, waiting for the expert rank, and the job
    hung at the first validation); its value is the one the steps' synced loss gives, on
    both attention ranks, and ``trainer.validate`` returns it on the expert rank too (it
    logs nothing; the epoch's value is shared to it, as DDP's ranks each return it); and a
    ``compute()`` in a hook every rank runs returns on the expert rank at once, its own
    state ungathered, the attention ranks' gathered."""
    got = run_ranks(3, metric_fit, 3, timeout=180)
    for mode, everywhere in METRIC_CASES:
        ranks = [got[r][(mode, everywhere)] for r in range(3)]
        logging = [0, 1] if mode in ("zebra", "distep") else [0, 1, 2]
        for r in logging:
            assert ranks[r]["metric"] == pytest.approx(ranks[r]["loss"], rel=1e-6), (mode, r, ranks[r])
            assert ranks[r]["metric"] == pytest.approx(ranks[0]["metric"], rel=1e-6), (mode, r)
            if everywhere:
                assert ranks[r]["computed"] == [pytest.approx(ranks[0]["metric"], rel=1e-6)], (mode, r)
        if everywhere:
            assert len(ranks[2]["computed"]) == 1, mode  # the expert rank's compute() returned
        assert ranks[2]["metric"] == pytest.approx(ranks[0]["metric"], rel=1e-6), (mode, ranks[2])


class LossSeen(L.Callback):
    """The ``train_loss`` this rank holds after each step (an attention rank: its own)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train_loss")
        self.losses.append(float(value) if value is not None else float("nan"))


def logged_where_rank_0_attends_or_not(rank: int, world: int, root: str) -> dict:
    import csv
    import glob

    from lightning_hetermoe import comm

    out = {}
    for name, mode, attention, shown in (("zebra_expert_rank_0", "zebra", [1], "csv"),
                                         ("distep_expert_rank_0", "distep", [1], "csv"),
                                         ("zebra_attention_rank_0", "zebra", [0], "csv"),
                                         ("zebra_expert_rank_0_bar", "zebra", [1], "bar"),
                                         ("zebra_expert_rank_0_no_logger", "zebra", [1], None)):
        model = make_model(4, seed=0, optim=OptimConfig())
        seen, bar = LossSeen(), BarSeen()
        where = os.path.join(root, name)
        t = trainer(HeterMoEStrategy(mode=mode, plan=make_test_plan(world, attention, R=2)), world, max_steps=3,
                    logger=CSVLogger(where, name="run") if shown == "csv" else False,
                    enable_progress_bar=shown == "bar", log_every_n_steps=1, callbacks=[seen, bar])
        with comm.record() as calls:
            t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        rows = []
        if rank == 0 and shown == "csv":
            (path,) = glob.glob(os.path.join(where, "run", "version_*", "metrics.csv"))
            rows = [r for r in csv.DictReader(open(path)) if r.get("train_loss")]
        out[name] = {"rows": [(int(r["step"]), float(r["train_loss"])) for r in rows], "seen": seen.losses,
                     "bar": bar.losses, "bar_after_fit": t.progress_bar_metrics.get("train_loss"),
                     "gathers": sum(c.what == "strategy.logged_metrics" for c in calls),
                     "after_fit": float(t.callback_metrics.get("train_loss", float("nan")))}
    return out


class BarSeen(L.Callback):
    """The ``train_loss`` the progress bar draws after each step (without a bar: the metrics
    it would draw, what the recipes' progress line reads); ``None``: none."""

    def __init__(self) -> None:
        self.losses: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = trainer.progress_bar_callback
        shown = bar.get_metrics(trainer, pl_module) if bar is not None else trainer.progress_bar_metrics
        self.losses.append(shown.get("train_loss"))


@pytest.mark.slow
def test_the_loggers_write_the_training_curves_and_the_bar_draws_the_loss_where_rank_0_is_an_expert_rank(tmp_path):
    """Lightning's loggers write on global rank 0 only. A plan whose rank 0 is an expert rank
    (a cluster that lists an older GPU first) wrote no train_loss at all: rank 0 runs no
    step. Its loggers now write the first attention rank's values at each logging step, and
    its progress bar draws them (it drew no loss; so does the recipes' progress line without
    a logger); where rank 0 attends, nothing more is gathered."""
    got = run_ranks(2, logged_where_rank_0_attends_or_not, 2, str(tmp_path), timeout=150)
    for name in ("zebra_expert_rank_0", "distep_expert_rank_0"):
        rows, attended = got[0][name]["rows"], got[1][name]["seen"]
        assert [step for step, _ in rows] == [0, 1, 2], (name, rows)
        assert [loss for _, loss in rows] == pytest.approx(attended, rel=1e-6), (name, rows, attended)
        assert got[0][name]["gathers"] == got[1][name]["gathers"] >= 3, name  # every logging step, every rank
        # and what a script reads after fit on rank 0 is the attention rank's last
        assert got[0][name]["after_fit"] == pytest.approx(attended[-1], rel=1e-6), (name, got[0][name]["after_fit"])
    plain = got[0]["zebra_attention_rank_0"]
    assert [loss for _, loss in plain["rows"]] == pytest.approx(plain["seen"], rel=1e-6)
    assert plain["gathers"] == 0 and got[1]["zebra_attention_rank_0"]["gathers"] == 0
    # Lightning's bar on rank 0 draws the attention rank's loss as of the last logging step
    # (each write follows the batch's callbacks, the bar's among them: one step late), with a
    # logger or without one
    for name in ("zebra_expert_rank_0_bar", "zebra_expert_rank_0_no_logger"):
        bar, attended = got[0][name], got[1][name]["seen"]
        assert bar["bar"][0] is None and bar["bar"][1:] == pytest.approx(attended[:-1], rel=1e-6), (name, bar)
        assert bar["bar_after_fit"] == pytest.approx(attended[-1], rel=1e-6), name
        assert bar["gathers"] == got[1][name]["gathers"] >= 3, name


class Sample(L.Callback):
    """The model's logits on fixed tokens, run on every rank at the end of each validation
    epoch: outside the Trainer's steps (a sample for the logs, as people generate them)."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        with torch.no_grad():
            self.logits.append(pl_module.model(TOKENS.to(pl_module.device))[0].float().cpu())


TOKENS = torch.arange(12).reshape(2, 6) * 7 % 97


def sampled_outside_a_step(rank: int, world: int) -> dict:
    from lightning_hetermoe import comm

    out = {}
    for mode in ("ep", "datacentric"):
        model = make_model(4, seed=rank, optim=OptimConfig())
        sample = Sample()
        t = trainer(HeterMoEStrategy(mode=mode), world, max_steps=2, callbacks=[sample], limit_val_batches=1,
                    val_check_interval=2)
        with comm.record() as calls:
            t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        model.eval()
        with torch.no_grad():  # after fit the model is whole again, the same weights
            whole = model.model(TOKENS)[0].float()
        out[mode] = {"sampled": sample.logits, "whole": whole,
                     "exchanged": sum(c.what.startswith(("ep.", "datacentric.")) for c in calls)}
    return out


@pytest.mark.slow
def test_the_model_runs_in_a_callback_on_every_rank_outside_the_steps():
    """A forward outside the steps that every rank runs (a callback without a rank guard)
    passes the check that it runs everywhere (the store's agreement before each MoE layer's
    exchange) and gives every rank the whole model's logits: the same as the model after
    fit, gathered whole, on the same tokens."""
    got = run_ranks(2, sampled_outside_a_step, 2, timeout=180)
    for mode in ("ep", "datacentric"):
        for rank in range(2):
            (sampled,) = got[rank][mode]["sampled"]
            torch.testing.assert_close(sampled, got[rank][mode]["whole"], rtol=1e-5, atol=1e-5, msg=mode)
            assert got[rank][mode]["exchanged"] > 0, mode
        torch.testing.assert_close(got[0][mode]["sampled"][0], got[1][mode]["sampled"][0], msg=mode)


def sampled_on_one_rank(rank: int, world: int, mode: str, alone: int) -> None:
    from faults import ForwardOnOneRank

    model = make_model(4, seed=rank, optim=OptimConfig())
    t = trainer(HeterMoEStrategy(mode=mode, progress_timeout_s=3), world, max_steps=4,
                callbacks=[ForwardOnOneRank(rank=alone, step=2)])
    t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))


@pytest.mark.slow
@pytest.mark.parametrize("mode,alone", [("ep", 0), ("datacentric", 1)])
def test_the_model_run_outside_a_step_on_one_rank_fails_naming_the_others(mode, alone):
    """A callback runs the model on one rank only (a sample under ``if trainer.is_global_zero:``).
    Its MoE layer's exchange waited forever for the other rank, or paired with that rank's
    next step's and exchanged rows of nothing (both ran past 120 s in the main job before);
    now every rank first says it got there, through the store, within the step's bound
    (``progress_timeout_s=3`` here), and the rank that ran it alone raises, naming the
    ranks that did not and how to run it (the job then ends as for any rank that raises)."""
    with pytest.raises(RuntimeError) as err:
        run_ranks(2, sampled_on_one_rank, 2, mode, alone, timeout=90)
    text = str(err.value)
    assert (f"OutsideStepError: rank {alone} ran MoE layer 0 outside the Trainer's steps") in text, text[-3000:]
    assert f"rank(s) {1 - alone} did not run it within 3 s" in text
    assert "drop an `if trainer.is_global_zero:` around it" in text


def test_the_norm_under_another_strategy_is_the_same_on_a_torch_before_get_total_norm(monkeypatch):
    """``torch.nn.utils.get_total_norm`` came with torch 2.6; the project supports 2.4 on."""
    from types import SimpleNamespace

    from lightning_hetermoe.callbacks.gradient_norm import gradient_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.SGD(params, lr=0.1)
    ddp = SimpleNamespace(root_device=torch.device("cpu"))  # a strategy without the pack's own norm
    by_hand = torch.cat([p.grad.reshape(-1) for p in params]).double().norm()
    now = gradient_norm(ddp, optimizer)
    monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)
    before = gradient_norm(ddp, optimizer)
    assert torch.allclose(now.double(), by_hand) and torch.allclose(before.double(), by_hand)
