"""Trainer features a Lightning user reaches for, beyond the callbacks, in every mode on real
gloo processes: ``overfit_batches`` (equal to one process overfitting), the LR finder
(``Tuner.lr_find``: the model restored, the found rate the same on every rank and the one the
next fit trains at), the model summary printed at the start of a fit (the whole model's
counts, not rank 0's share), the pack's loader built in the script before the run starts,
loaders over ``IterableDataset`` streams of unequal lengths (every rank stops where the
shortest ends; what ran equals one process taking every rank's batches as its global batch), ``self.all_gather`` in a step (as under DDP where every rank runs the
step; refused, naming why, where only the attention ranks do), Lightning's weight averaging
(EMA: trained, validated, saved after and mid-run and resumed; ``StochasticWeightAveraging``
refused before anything trains), Lightning's
fine-tuning callback freezing and unfreezing blocks mid-run, manual optimization clipping
in its step, ``fast_dev_run`` and ``check_val_every_n_epoch`` (each equal to one process)."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import logging
import os
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (BaseFinetuning, EMAWeightAveraging, ModelCheckpoint, ModelSummary,
                                         StochasticWeightAveraging)
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, IterableDataset

from harness import run_ranks
from helpers_zebra import GLOBAL, STEPS, WINDOWS, check, make_test_plan, pieces
from lightning_hetermoe import HeterMoEStrategy, HFMoELanguageModel, MoELanguageModel, OptimConfig, comm, load_checkpoint
from lightning_hetermoe.configs import ConfigError
from reference import SEQ, assert_same_params, data, make_model, reference_fit, relative_gap, trainer

MODES = ("ep", "zebra", "distep", "datacentric")
LR_FIND_STEPS = 16


def _plan(mode: str, world: int):
    return make_test_plan(world, [0], R=2) if mode in ("zebra", "distep") else None


@pytest.mark.slow
def test_overfit_batches_train_on_the_first_global_batches_as_one_process_does_in_every_mode():
    """Lightning rebuilds the loaders with a SequentialSampler to overfit: the pack's loader
    takes it as the unshuffled global order, so 2 ranks cycle over the same 2 global batches
    as one process would (5 steps: 2 epochs and a step)."""
    overfit = dict(overfit_batches=2)
    check(2, [dict(mode=mode, plan=_plan(mode, 2), trainer=overfit) for mode in MODES])


def lr_find_then_fit(rank: int, world: int) -> dict:
    out = {}
    for mode in MODES:
        model = make_model(4, seed=0, optim=OptimConfig())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_steps=STEPS)
        dm = data(world, GLOBAL[world], windows=WINDOWS[world])
        found = Tuner(t).lr_find(model, datamodule=dm, min_lr=1e-4, max_lr=1.0, num_training=LR_FIND_STEPS,
                                 early_stop_threshold=None, update_attr=True)
        restored = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        suggestion, losses = found.suggestion(), list(found.results["loss"])
        t2 = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_steps=STEPS)
        t2.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode] = {"suggestion": suggestion, "lr": model.lr, "hparam": model.hparams["optim"]["lr"],
                     "losses": losses, "restored": restored,
                     "initial_lr": t2.optimizers[0].param_groups[0]["initial_lr"],
                     "state": {k: v.clone() for k, v in model.state_dict().items()}}
    return out


@pytest.mark.slow
def test_the_lr_finder_restores_the_model_and_the_next_fit_trains_at_its_rate_in_every_mode():
    per_rank = run_ranks(2, lr_find_then_fit, 2)
    for mode in MODES:
        got, other = per_rank[0][mode], per_rank[1][mode]
        assert got["restored"] and other["restored"], mode  # the sweep's steps undone on every rank
        assert len(got["losses"]) == LR_FIND_STEPS and all(x == x for x in got["losses"]), mode
        s = got["suggestion"]
        assert s is not None and 1e-4 <= s <= 1.0 and s != OptimConfig().lr, (mode, s)
        # one rate on every rank (ranks that disagreed would step their shares differently)
        assert other["suggestion"] == s and got["lr"] == other["lr"] == got["hparam"] == s, mode
        assert got["initial_lr"] == s, mode  # the optimizer the next fit built took it
        # and the fit at that rate equals one process's at it
        model = make_model(4, seed=0, optim=OptimConfig(lr=s))
        initial = copy.deepcopy(model.state_dict())
        plan = _plan(mode, 2)
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[2], windows=WINDOWS[2],
                                 pieces=pieces(plan, mode) if plan is not None else None)
        assert_same_params(got["state"], expected, initial)


def _hf_mixtral(optim: OptimConfig) -> HFMoELanguageModel:
    pytest.importorskip("transformers")
    from helpers_hf import tiny_lm

    return HFMoELanguageModel(tiny_lm("mixtral", 0, 4, SEQ).model, optim)


@pytest.mark.parametrize("build", [lambda optim: make_model(4, optim=optim), _hf_mixtral], ids=["pack", "hf"])
def test_the_learning_rate_is_the_optim_config_s_under_the_tuner_s_name(build):
    model = build(OptimConfig(lr=0.01, warmup_steps=0))
    assert model.lr == 0.01
    model.lr = 0.2
    assert model.optim_cfg.lr == 0.2 and model.hparams["optim"]["lr"] == 0.2
    assert model.configure_optimizers().param_groups[0]["lr"] == 0.2
    with pytest.raises(ConfigError, match=r"optim\.lr=-1\.0 is invalid: must be > 0"):
        model.lr = -1
    assert model.lr == 0.2  # a refused rate changes nothing
    if isinstance(model, MoELanguageModel):  # a checkpoint's hyperparameters rebuild it at the tuned rate
        assert MoELanguageModel(**model.hparams).lr == 0.2


@pytest.mark.parametrize("mode", MODES)
def test_stochastic_weight_averaging_is_refused_before_any_process_starts_naming_what_works(mode):
    t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, 2)), 2, max_steps=1,
                callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])
    with pytest.raises(ConfigError, match="StochasticWeightAveraging does not work under HeterMoEStrategy on 2 "
                                          "ranks: it keeps a copy of the whole model.*Use .*WeightAveraging"):
        t.fit(make_model(4, optim=OptimConfig()), datamodule=data(2, 8))


AVERAGE_DECAY = 0.7  # the average lags the weights by a few steps: a wrong average cannot pass for the right one
AVERAGING_SAVED_AT = 6  # mid-epoch 1, the average and the weights apart


def fit_averaging(rank: int, world: int, mode: str | None = None, resume: str | None = None,
                  save: str | None = None, checkpoint_format: str = "auto") -> dict:
    """8 steps under Lightning's EMA weight averaging, validating at each epoch's end (the
    average swapped in), then ``Trainer.validate`` (the strategy lays the module and the
    average out again); ``save``: a directory where a checkpoint of step
    :data:`AVERAGING_SAVED_AT` lands (``saved.ckpt``), and one saved after the validation
    (``after.ckpt``). Returns the module after fit (the average copied in) and each
    validation loss."""
    model = make_model(4, optim=OptimConfig(), seed=0)
    strategy = "auto" if world == 1 else HeterMoEStrategy(mode=mode, plan=_plan(mode, world),
                                                          checkpoint_format=checkpoint_format)
    saving = [ModelCheckpoint(dirpath=save, filename="saved", every_n_train_steps=AVERAGING_SAVED_AT,
                              save_top_k=-1)] if save else []
    losses = ValLosses()
    t = trainer(strategy, world, max_epochs=2, limit_val_batches=1, enable_checkpointing=bool(save),
                callbacks=[EMAWeightAveraging(decay=AVERAGE_DECAY), losses, *saving])
    dm = data(world, GLOBAL[2], windows=WINDOWS[2] // 2)  # 4 steps an epoch
    with comm.record() as calls:
        t.fit(model, datamodule=dm, ckpt_path=resume)
        assert t.global_step == 8
        t.validate(model, datamodule=dm, verbose=False)
    if save:
        t.save_checkpoint(os.path.join(save, "after.ckpt"))
    return {"module": {k: v.clone() for k, v in model.state_dict().items()}, "val": losses.values,
            "dense_sent": sum(c.what == "averaging.dense" for c in calls)}


class ValLosses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.values.append(float(trainer.callback_metrics["val_loss"]))


AVERAGING_FORMATS = {"ep": "sharded", "zebra": "full", "distep": "sharded"}  # data-centric saves nothing here


def every_mode_then_resumed(fit, formats: dict[str, str], rank: int, world: int, tmp: str) -> dict:
    """``fit`` in every mode; where ``formats`` names the mode's checkpoint format, saving a
    checkpoint into ``tmp/<mode>`` and run again resumed from it (``(mode, "resumed")``)."""
    out = {}
    for mode in MODES:
        fmt = formats.get(mode, "auto")
        out[mode] = fit(rank, world, mode, save=os.path.join(tmp, mode) if mode in formats else None,
                        checkpoint_format=fmt)
        if mode in formats:
            out[mode, "resumed"] = fit(rank, world, mode, resume=os.path.join(tmp, mode, "saved.ckpt"),
                                       checkpoint_format=fmt)
    return out


def fit_averaging_every_mode(rank: int, world: int, tmp: str) -> dict:
    return every_mode_then_resumed(fit_averaging, AVERAGING_FORMATS, rank, world, tmp)


@pytest.mark.slow
def test_weight_averaging_trains_validates_saves_and_resumes_like_one_process_in_every_mode(tmp_path):
    """Lightning's EMA weight averaging (an ``AveragedModel`` the callback copies from the
    module in its set-up, before the strategy spreads it) in every mode, against one
    process: the module after fit (the average copied in), the validation losses (the
    average swapped in), the checkpoint (the average as its state dict, the trained weights
    beside it: one file, gathered whole, under zebra with its dense weights on the attention
    rank alone; sharded pieces under ep, with ZeRO-1, and distep) and a run resumed from it
    (the average and the trained weights each put back where they were)."""
    initial = make_model(4, seed=0).state_dict()
    expected = fit_averaging(0, 1, save=str(tmp_path / "one"))
    expected_resumed = fit_averaging(0, 1, resume=str(tmp_path / "one" / "saved.ckpt"))
    one = torch.load(tmp_path / "one" / "saved.ckpt", map_location="cpu", weights_only=False)
    # the average is not the weights (else the test could not tell them apart)
    assert relative_gap(one["state_dict"], one["current_model_state"], initial) > 0.05
    per_rank = run_ranks(2, fit_averaging_every_mode, 2, str(tmp_path))
    for key, got in per_rank[0].items():
        want = expected_resumed if key[1:] == ("resumed",) else expected
        assert_same_params(got["module"], want["module"], initial)
        assert got["val"] == pytest.approx(want["val"], rel=1e-5), key
        # the average's dense tensors are sent at a stage's end only where a rank lacks them
        # (zebra's and distep's expert rank); under ep and datacentric each rank averaged its own
        mode = key if isinstance(key, str) else key[0]
        assert (got["dense_sent"] > 0) == (mode in ("zebra", "distep")), (key, got["dense_sent"])
    for name in ("saved.ckpt", "after.ckpt"):  # mid-run, and after the run (the module whole again)
        one = torch.load(tmp_path / "one" / name, map_location="cpu", weights_only=False)
        for mode in AVERAGING_FORMATS:
            saved = load_checkpoint(tmp_path / mode / name)  # a sharded directory read whole
            for part in ("state_dict", "current_model_state"):
                assert_same_params(saved[part], one[part], initial)
            torch.testing.assert_close(saved["averaging_state"], one["averaging_state"])


def summary_lines(rank: int, world: int) -> dict:
    """What the model summary shows at the start of fit, per mode, with the embedding frozen:
    Lightning's default callback (``RichModelSummary`` where rich is installed, printed), a
    ``ModelSummary`` passed in (logged), and one of a model with an ``example_input_array``;
    and the whole model's counts taken before the fit."""
    out = {}
    for mode in MODES:
        for case, callbacks in (("default", []), ("passed", [ModelSummary(max_depth=2)]),
                                ("example", [ModelSummary(max_depth=1)])):
            model = make_model(4, seed=0, optim=OptimConfig())
            model.model.embed.weight.requires_grad_(False)
            if case == "example":  # Lightning's summary forwards it on every rank
                model.example_input_array = torch.zeros(2, 16, dtype=torch.long)
            whole = {"total": sum(p.numel() for p in model.parameters()),
                     "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
            records: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda record: records.append(record.getMessage())
            logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
            logger.addHandler(handler)
            level = logger.level
            logger.setLevel(logging.INFO)
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_steps=1,
                                enable_model_summary=True, callbacks=callbacks)
                    t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            text = "\n".join(records) + "\n" + printed.getvalue()
            out[mode, case] = {"text": text, "whole": whole, "steps": t.global_step}
    return out


def shown_counts(text: str) -> dict[str, str]:
    """The summary's three totals and its top row's count, as printed (plain or rich)."""
    counts = {m.group(2): m.group(1) for m in re.finditer(
        r"^(\S+(?: [KMBT])?) +((?:Non-t|T)rainable params|Total params) *$", text, re.M)}
    counts.update({m.group(1): m.group(2) for m in re.finditer(
        r"^((?:Non-t|T)rainable params|Total params): (\S+(?: [KMBT])?) *$", text, re.M)})
    row = re.search(r"0 [|│] model +[|│] MoETransformer +[|│] (.+?) +[|│]", text)
    if row is not None:
        counts["model"] = row.group(1)
    return counts


@pytest.mark.slow
def test_the_model_summary_counts_the_whole_model_not_rank_0_s_share_in_every_mode():
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count as count

    per_rank = run_ranks(2, summary_lines, 2)
    for key, got in per_rank[0].items():
        whole = got["whole"]
        assert shown_counts(got["text"]) == {
            "Total params": count(whole["total"]), "model": count(whole["total"]),
            "Trainable params": count(whole["trainable"]),
            "Non-trainable params": count(whole["total"] - whole["trainable"])}, (key, got["text"])
        assert shown_counts(per_rank[1][key]["text"]) == {}, key  # shown by rank 0 alone
        assert got["steps"] == 1, key
        if key[1] == "example":  # run where a bare forward runs; under zebra and distep not, and sizes unknown
            sizes = re.search(r"^0 \| model .*\| (\S.*?) +\| (\S.*?) *$", got["text"], re.M).group(1, 2)
            assert sizes == (("[[2, 16], '?']", "[[2, 16, 256], ['?', '?']]") if key[0] in ("ep", "datacentric")
                             else ("?", "?")), (key, got["text"])


class FreezeThenSwap(BaseFinetuning):
    """Lightning's fine-tuning callback as its docs use it (the optimizer over the trainable
    parameters only): block 0 frozen through the first epoch, then added to the optimizer
    as a group of its own while block 1 is frozen (made trainable and frozen mid-run, both
    ways)."""

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.model.blocks[0])

    def finetune_function(self, pl_module, current_epoch: int, optimizer) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.blocks[0], optimizer, lr=1e-3)
            self.freeze(pl_module.model.blocks[1])


class TrainableOnly(MoELanguageModel):
    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=OptimConfig().lr)


FREEZING_WINDOWS = WINDOWS[2] // 2  # 4 steps an epoch at 2 ranks' global batch
FREEZING_SAVED_AT = 6  # a checkpoint after the group was added (epoch 1), resumed to the end


def _freezing_plan(mode: str, world: int):
    # zebra with both ranks attention ranks, each holding half the experts: their dense
    # gradients are summed in buckets (distep's attention rank holds no experts)
    if mode == "zebra":
        return make_test_plan(world, list(range(world)), R=2, placement=[[0, 0, 1, 1]] * 2)
    return _plan(mode, world)


def fit_freezing(rank: int, world: int, mode: str | None = None, resume: str | None = None,
                 save: str | None = None, checkpoint_format: str = "auto") -> dict[str, torch.Tensor]:
    """The whole run (8 steps), from ``resume`` if given; ``save``: a directory where a
    checkpoint of step :data:`FREEZING_SAVED_AT` lands (``saved.ckpt``)."""
    model = TrainableOnly(make_model(4).model_cfg, OptimConfig())
    model.load_state_dict(make_model(4, seed=0).state_dict())
    strategy = "auto" if world == 1 else HeterMoEStrategy(mode=mode, plan=_freezing_plan(mode, world),
                                                          checkpoint_format=checkpoint_format)
    saving = [ModelCheckpoint(dirpath=save, filename="saved", every_n_train_steps=FREEZING_SAVED_AT,
                              save_top_k=-1)] if save else []
    t = trainer(strategy, world, max_epochs=2, callbacks=[FreezeThenSwap(), *saving], enable_checkpointing=bool(save))
    t.fit(model, datamodule=data(world, GLOBAL[2], windows=FREEZING_WINDOWS), ckpt_path=resume)
    assert t.global_step == 8
    return {k: v.clone() for k, v in model.state_dict().items()}


def fit_freezing_every_mode(rank: int, world: int, tmp: str) -> dict:
    # ep saves one file, zebra a sharded checkpoint (its optimizers fill as it loads)
    return every_mode_then_resumed(fit_freezing, {"ep": "full", "zebra": "sharded"}, rank, world, tmp)


@pytest.mark.slow
def test_parameters_frozen_and_unfrozen_mid_run_train_and_resume_like_one_process_in_every_mode(tmp_path):
    """What one process does: a frozen parameter keeps no gradient and no optimizer step
    (Adam's moments do not move it on, nothing decays it), and once unfrozen its gradient is
    summed over the ranks like every other. DDP (ep, data-centric) sums only what required a
    gradient when it was built, and alone would train the unfrozen block on each rank's own
    gradient; zebra filled frozen gradients with zeros; a rank holding none of block 0's
    experts (distep's attention rank) has them left out of its optimizer by the callback,
    and the run's end gathered the experts' moments in step with no other rank. A resumed
    run gets the callback's groups back before the optimizer state loads, from a full file
    (ep) and from a sharded checkpoint (zebra; the callback keeps ZeRO-1 off: it finds the
    module's parameters in the optimizer's groups)."""
    initial = make_model(4, seed=0).state_dict()
    expected = fit_freezing(0, 1, save=str(tmp_path / "one"))
    # (Lightning's resume of this callback mid-epoch does not land where the whole run does,
    # on one process either: the resumed runs are held to one process's resumed run)
    expected_resumed = fit_freezing(0, 1, resume=str(tmp_path / "one" / "saved.ckpt"))
    per_rank = run_ranks(2, fit_freezing_every_mode, 2, str(tmp_path))
    for key, got in per_rank[0].items():
        assert_same_params(got, expected_resumed if key[1:] == ("resumed",) else expected, initial)
    assert ("zebra", "resumed") in per_rank[0]


class ManualStep(MoELanguageModel):
    """Manual optimization as Lightning's docs write it: backward, clip, step, zero_grad,
    schedule. ``clip``: the algorithm, ``None``, or ``"two"``: two optimizers (the dense
    parameters on SGD, the experts on Adam), the first clipped by its own parameters' norm."""

    def __init__(self, clip: str | None) -> None:
        super().__init__(make_model(4).model_cfg, OptimConfig())
        self.load_state_dict(make_model(4, seed=0).state_dict())
        self.automatic_optimization = False
        self.clip = clip

    def configure_optimizers(self):
        if self.clip != "two":
            return super().configure_optimizers()
        experts = [p for n, p in self.named_parameters() if ".experts." in n]
        rest = [p for n, p in self.named_parameters() if ".experts." not in n]
        # SGD where the clip is: its step scales with the clip's coefficient (Adam's hardly)
        return [torch.optim.SGD(rest, lr=0.1), torch.optim.Adam(experts, lr=OptimConfig().lr)]

    def training_step(self, batch, batch_idx):
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        loss = self.losses(batch)["loss"]
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(opts[0], gradient_clip_val=2e-3 if self.clip == "value" else 0.5,
                                gradient_clip_algorithm="value" if self.clip == "value" else "norm")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if self.clip != "two":
            self.lr_schedulers().step()
        return loss


MANUAL_CASES = (("ep", "norm"), ("ep", "value"), ("ep", "two"), ("datacentric", "two"))


def fit_manual(rank: int, world: int) -> dict:
    out = {}
    for mode, clip in MANUAL_CASES:
        model = ManualStep(clip)
        trainer(HeterMoEStrategy(mode=mode), world, max_steps=STEPS).fit(
            model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode, clip] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.slow
def test_manual_optimization_clipping_in_its_step_trains_like_one_process_where_it_runs():
    """A manual ``self.clip_gradients`` comes before ``opt.step()``, where each rank still
    held its own gradients (summed over the ranks only inside the step): it clipped by a norm
    or against values of gradients that were not the global batch's. With two optimizers,
    the first is clipped by the norm of its own gradients, as in one process (each
    optimizer's norm had counted every expert's gradient). Zebra and distep run the backward
    themselves and refuse manual optimization (test_bad_input.py)."""
    initial = make_model(4, seed=0).state_dict()
    expected = {}
    for clip in (None, "norm", "value", "two"):
        model = ManualStep(clip)
        trainer("auto", 1, max_steps=STEPS).fit(model, datamodule=data(1, GLOBAL[2], windows=WINDOWS[2]))
        expected[clip] = {k: v.clone() for k, v in model.state_dict().items()}
    for clip in ("norm", "value"):  # the clip bites
        assert relative_gap(expected[clip], expected[None], initial) > 1e-3, clip
    per_rank = run_ranks(2, fit_manual, 2)
    for (mode, clip), got in per_rank[0].items():
        assert_same_params(got, expected[clip], initial)


class GatherInValidationStep(MoELanguageModel):
    """Gathers each rank's loss in ``validation_step``, as DDP users gather predictions."""

    def validation_step(self, batch, batch_idx):
        ce = self.losses(batch)["ce"]
        self.log("val_loss", ce, sync_dist=True)
        self.log("gathered_mean", self.all_gather(ce.detach()).mean(), sync_dist=True)


def gather_in_step(rank: int, world: int, modes: tuple[str, ...]) -> dict:
    out = {}
    for mode in modes:
        base = make_model(4, seed=0, optim=OptimConfig())
        model = GatherInValidationStep(base.model_cfg, base.optim_cfg)
        model.load_state_dict(base.state_dict())
        t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_steps=2, limit_val_batches=2,
                    val_check_interval=2)
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode] = {k: float(v) for k, v in t.callback_metrics.items()}
    return out


@pytest.mark.slow
def test_all_gather_in_a_step_gathers_where_every_rank_runs_it_and_is_refused_where_only_attention_ranks_do():
    per_rank = run_ranks(2, gather_in_step, 2, ("ep", "datacentric"))
    for mode in ("ep", "datacentric"):
        metrics = per_rank[0][mode]
        synced = ("val_loss", "gathered_mean")  # the training losses are each rank's own, as under DDP
        assert {k: metrics[k] for k in synced} == {k: per_rank[1][mode][k] for k in synced}, mode
        # each rank's losses gathered, their mean the mean the synced log takes
        assert metrics["gathered_mean"] == pytest.approx(metrics["val_loss"], rel=1e-6), (mode, metrics)
    # under zebra (and distep, the same executor) the expert ranks never run the step: a hang, refused
    with pytest.raises(RuntimeError, match=r"self\.all_gather inside a training/validation/test/predict step under "
                                           r"zebra: only the attention ranks run the step.*on_validation_epoch_end"):
        run_ranks(2, gather_in_step, 2, ("zebra",), timeout=120)


class Stream(IterableDataset):
    """A rank's own stream of samples (no ``__getitem__``, no length), as a streaming corpus
    gives; it starts again at each ``iter``."""

    def __init__(self, rank: int, samples: int = 48, seed: int = 100) -> None:
        self.rank, self.samples, self.seed = rank, samples, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.rank)
        for _ in range(self.samples):
            x = torch.randint(0, 256, (17,), generator=g)
            yield x[:-1], x[1:]


# Each rank's stream holds a different number of batches (rank 0 the fewest): every rank
# stops where rank 0's ends, in training (each epoch) and in validation.
TRAIN_BATCHES, VAL_BATCHES, EPOCHS = (3, 5), (2, 3), 2
VAL_SEED = 500


def _streams(rank: int, world: int, counts: tuple[int, ...], seed: int = 100) -> DataLoader:
    per = GLOBAL[world] // world
    return DataLoader(Stream(rank, counts[rank] * per, seed), batch_size=per)


def fit_on_uneven_streams(rank: int, world: int) -> dict:
    import warnings

    out = {}
    for mode in MODES:
        model = make_model(4, seed=rank, optim=OptimConfig())
        t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_epochs=EPOCHS, max_steps=-1,
                    limit_val_batches=1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(model, train_dataloaders=_streams(rank, world, TRAIN_BATCHES))
            val = t.validate(model, dataloaders=_streams(rank, world, VAL_BATCHES, VAL_SEED), verbose=False)
        out[mode] = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "steps": t.global_step,
                     "val": val[0].get("val_loss") if val else None,
                     "warned": sum("ended unevenly" in str(w.message) for w in caught)}
    return out


def stream_global_batches(world: int, batches: int, seed: int = 100):
    """One process's view of one pass: each step, every rank's next batch, rank 0's rows
    first, as many steps as the shortest stream holds."""
    per = GLOBAL[world] // world
    streams = [iter(DataLoader(Stream(r, 48, seed), batch_size=per)) for r in range(world)]
    for _ in range(batches):
        parts = [next(s) for s in streams]
        yield tuple(torch.cat([p[i] for p in parts]) for i in range(2))


@pytest.mark.slow
def test_loaders_over_uneven_streams_stop_together_and_train_and_validate_like_one_process_in_every_mode():
    """No first sample to index and no length: the strategy reads the batch shape from the
    stream's first sample (under zebra and distep it times the run from it; it failed there
    before, asking for a plan that was given). The ranks' streams hold different numbers of
    batches: each batch is taken once every rank has one, so every rank stops where the
    shortest stream ends (before, the ranks with a batch left waited for ever in the step's
    collectives), in training each epoch and in validation, rank 0 saying so; what ran
    equals one process taking every rank's batches as its global batch."""
    got = run_ranks(2, fit_on_uneven_streams, 2)
    shortest_train, shortest_val = min(TRAIN_BATCHES), min(VAL_BATCHES)
    for mode in MODES:
        mine = got[0][mode]
        model = make_model(4, seed=0, optim=OptimConfig())
        initial = copy.deepcopy(model.state_dict())
        plan = _plan(mode, 2)
        epochs = itertools.chain.from_iterable(stream_global_batches(2, shortest_train) for _ in range(EPOCHS))
        assert mine["steps"] == got[1][mode]["steps"] == EPOCHS * shortest_train, mode
        expected = reference_fit(model, EPOCHS * shortest_train, batches=epochs,
                                 pieces=pieces(plan, mode) if plan is not None else None)
        assert_same_params(mine["state"], expected, initial)
        # validation: the mean cross-entropy of the batches every rank had, the trained model
        trained = make_model(4, seed=0, optim=OptimConfig())
        trained.load_state_dict(expected)
        trained.eval()
        with torch.no_grad():
            want = [float(trained.losses(b)["ce"]) for b in stream_global_batches(2, shortest_val, VAL_SEED)]
        assert mine["val"] is not None and abs(mine["val"] - sum(want) / len(want)) < 1e-4, (mode, mine["val"], want)
        # rank 0 said so: each training epoch and the validation pass
        assert mine["warned"] == EPOCHS + 1 and got[1][mode]["warned"] == 0, (mode, mine["warned"])


LOOP_SETTINGS = {
    # Lightning's debugging run: 3 training batches and 3 validation batches, no checkpoint, no logger
    "fast_dev_run": dict(fast_dev_run=3),
    # validation every second epoch only (epochs of 2 batches, 3 epochs: one validation, after epoch 2)
    "check_val_every_n_epoch": dict(max_epochs=3, limit_train_batches=2, check_val_every_n_epoch=2,
                                    limit_val_batches=1),
}


def fit_with_loop_settings(rank: int, world: int, mode: str | None = None) -> dict:
    out = {}
    for name, settings in LOOP_SETTINGS.items():
        strategy = "auto" if world == 1 else HeterMoEStrategy(mode=mode, plan=_plan(mode, world))
        losses = ValLosses()
        t = trainer(strategy, world, callbacks=[losses], **settings)
        model = make_model(4, optim=OptimConfig(), seed=0)
        t.fit(model, datamodule=data(world, 8))
        out[name] = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "steps": t.global_step,
                     "val": losses.values}
    return out


def fit_with_loop_settings_every_mode(rank: int, world: int) -> dict:
    return {mode: fit_with_loop_settings(rank, world, mode) for mode in MODES}


@pytest.mark.slow
def test_fast_dev_run_and_validation_every_n_epochs_run_as_one_process_in_every_mode():
    """The loop's own settings a user reaches for first: ``fast_dev_run`` (a few batches of
    each loop, as a smoke test) and ``check_val_every_n_epoch``; each rank runs the same
    steps and validations as one process, which the weights and validation losses show."""
    initial = make_model(4, seed=0).state_dict()
    expected = fit_with_loop_settings(0, 1)
    assert expected["fast_dev_run"]["steps"] == 3 and len(expected["fast_dev_run"]["val"]) == 1
    assert expected["check_val_every_n_epoch"]["steps"] == 6 and len(expected["check_val_every_n_epoch"]["val"]) == 1
    for mode, runs in run_ranks(2, fit_with_loop_settings_every_mode, 2)[0].items():
        for name, got in runs.items():
            want = expected[name]
            assert got["steps"] == want["steps"], (mode, name)
            assert_same_params(got["state"], want["state"], initial)
            assert got["val"] == pytest.approx(want["val"], rel=1e-5), (mode, name)


def fit_on_a_loader_built_before_the_run(rank: int, world: int) -> dict:
    out = {}
    for mode in MODES:
        model = make_model(4, seed=rank, optim=OptimConfig())
        # made here, before Lightning starts the process group: its sampler learns its share later
        loader = data(world, GLOBAL[world], windows=WINDOWS[world]).train_dataloader()
        t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_steps=STEPS)
        t.fit(model, train_dataloaders=loader)
        out[mode] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.slow
def test_the_pack_s_loader_built_before_the_run_deals_each_rank_its_share_in_every_mode():
    """``trainer.fit(model, dm.train_dataloader())``: the loader is made before the process
    group exists. Its sampler follows the group once the run has begun; it used to keep the
    one-process order, and under ep each rank trained on the same rows (1.7e-3 off one process
    after two steps)."""
    got = run_ranks(2, fit_on_a_loader_built_before_the_run, 2)[0]
    for mode in MODES:
        model = make_model(4, seed=0, optim=OptimConfig())
        initial = copy.deepcopy(model.state_dict())
        plan = _plan(mode, 2)
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[2], windows=WINDOWS[2],
                                 pieces=pieces(plan, mode) if plan is not None else None)
        assert_same_params(got[mode], expected, initial)


class DecayByShape(MoELanguageModel):
    """nanoGPT's grouping: weight decay on every tensor of two or more dimensions, none (and
    another learning rate) on the rest, with a warm-up schedule."""

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                 {"params": others, "weight_decay": 0.0, "lr": 1e-3}], lr=3e-3, betas=(0.9, 0.95))
        warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}


def fit_grouped_by_shape(rank: int, world: int) -> dict:
    out = {}
    for mode in MODES:
        model = make_model(4, seed=rank, optim=OptimConfig())
        model.__class__ = DecayByShape
        t = trainer(HeterMoEStrategy(mode=mode, plan=_plan(mode, world)), world, max_steps=STEPS)
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[mode] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.slow
def test_optimizer_groups_chosen_by_shape_train_like_one_process_in_every_mode():
    """Under data-centric a rank holds a flat range of each expert tensor, so a grouping by
    shape put the experts with the norms (no weight decay, the other learning rate) and
    every parameter trained apart from one process (7e-3 off after five steps, against
    1.2e-2 moved); the pieces now take the group their whole shapes would."""
    got = run_ranks(2, fit_grouped_by_shape, 2)[0]
    for mode in MODES:
        model = make_model(4, seed=0, optim=OptimConfig())
        model.__class__ = DecayByShape
        initial = copy.deepcopy(model.state_dict())
        plan = _plan(mode, 2)
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[2], windows=WINDOWS[2],
                                 pieces=pieces(plan, mode) if plan is not None else None)
        assert_same_params(got[mode], expected, initial)


class _Piece(torch.nn.Module):
    """A module whose ``w`` is a flat piece of a [4, 3] tensor, beside a vector ``b``."""

    def __init__(self, configure) -> None:
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
        self.configure = configure

    def configure_optimizers(self):
        return self.configure(self)


def _by_dim(m):
    return torch.optim.SGD([{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                            {"params": [p for p in m.parameters() if p.dim() < 2]}], lr=0.1)


def test_a_piece_moves_to_the_group_of_its_whole_shape_and_a_grouping_that_cannot_run_on_meta_is_left_warned():
    from lightning_hetermoe.strategy.piece_groups import regroup_pieces

    m = _Piece(_by_dim)
    opt = _by_dim(m)
    assert [len(g["params"]) for g in opt.param_groups] == [0, 2]
    assert regroup_pieces(m, [opt], {"w": (4, 3)}) == 1
    assert opt.param_groups[0]["params"] == [m.w] and opt.param_groups[1]["params"] == [m.b]
    assert m.w.shape == (5,) and m.w.device.type == "cpu"  # the module's own parameters are back
    assert regroup_pieces(m, [opt], {"w": (4, 3)}) == 0  # already where it belongs

    def reads_values(mod):
        for p in mod.parameters():
            float(p.sum())  # a meta tensor has no value
        return _by_dim(mod)

    m2 = _Piece(reads_values)
    opt2 = _by_dim(m2)
    with pytest.warns(UserWarning, match="could not check which optimizer group each data-centric expert piece"):
        assert regroup_pieces(m2, [opt2], {"w": (4, 3)}) == 0
    assert [len(g["params"]) for g in opt2.param_groups] == [0, 2]
