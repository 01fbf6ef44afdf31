"""Host syncs per training step, counted on CPU: the stand-in device (``HETERMOE_STANDIN=1``)
notes every read of device values by the host and every blocking host-to-device copy, with
the file:line that asked (``standin.counting_syncs``), as CUDA's sync debug mode warns for
each on a GPU. The design allows one read per (layer, micro-batch) and rank: the round's
split sizes. Every mode, one step after two warm-up steps (the first steps build what later
steps reuse: DDP rebuilds its buckets in the second, reading their sizes), on real gloo
ranks."""

from __future__ import annotations

import contextlib
import json
import inspect
import logging
import os
import signal
from collections import Counter
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from harness import run_ranks
from lightning_hetermoe import ExpertLoadMonitor, HeterMoEStrategy, comm, standin
from lightning_hetermoe.selfcheck.host_syncs import is_sync_warning

LAYERS = 2


def _site(fn) -> tuple[str, range]:
    """Where a function's code is, as the stand-in names a caller: (path, its lines)."""
    lines, first = inspect.getsourcelines(fn)
    return standin.short_path(fn.__code__.co_filename), range(first, first + len(lines))


def _within(callers: tuple[str, ...], site: tuple[str, range]) -> bool:
    path, lines = site
    for caller in callers:
        file, _, line = caller.rpartition(":")
        if file == path and line.isdigit() and int(line) in lines:
            return True
    return False


# Lightning's own host syncs in a training step, which no strategy can avoid (named here,
# counted, bounded, never silently dropped):
# - after every batch its logger connector turns each metric logged with prog_bar=True into
#   a Python number for the progress bar, shown or not (``_ResultCollection.metrics`` ->
#   ``convert_tensors_to_scalars``: an ``.item()``); the tiny model logs one (``train_loss``)
#   on every rank that runs the user's step;
# - before every batch of a run of several ranks, the training loop broadcasts whether the
#   job got SIGTERM (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a tensor built from
#   a Python list on the device, broadcast on the default group, read back by ``.item()``.
#   HeterMoEStrategy asks the same on the host side instead (it would wait for every rank's
#   queued work: an expert rank's optimizer step), so this one must not show.
PROGRESS_BAR = _site(_ResultCollection.metrics)
SIGTERM = _site(_TrainingEpochLoop._broadcast_sigterm_tensor)
# host-to-device copies the stand-in sees as blocking, that on a GPU are not: comm.to_device
# copies from pinned memory, non_blocking (ordered on the stream, no host sync)
ASYNC_ON_GPU = _site(comm.to_device)
# device-to-host copies the stand-in sees as reads, that on a GPU are not: comm.HostCopy
# queues the copy into pinned memory with an event after it, and the host reads it a step later
READ_LATER = _site(comm.HostCopy.__init__)


class CountSyncs(L.Callback):
    """Counts host syncs from the start of each training step in ``steps`` to the start of
    the next (everything Lightning and the strategy do for one step, its logging included)."""

    def __init__(self, steps: tuple[int, ...] = (2,)) -> None:
        self.steps, self.stack, self.syncs = steps, contextlib.ExitStack(), {}

    def on_train_batch_start(self, trainer, *args) -> None:
        self.stack.close()
        if trainer.global_step in self.steps:
            self.syncs[trainer.global_step] = self.stack.enter_context(standin.counting_syncs())

    def on_train_end(self, trainer, pl_module) -> None:
        self.stack.close()


def one_step(rank: int, world: int, mode: str, R: int) -> dict:
    from helpers_zebra import make_test_plan
    from reference import data, make_model, mixed_cluster, trainer

    os.environ[standin.ENV] = "1"
    try:
        kwargs: dict = {"mode": mode}
        if mode in ("zebra", "distep"):
            plan = make_test_plan(world, [0], R=R, layers=LAYERS)
            plan.distep_microbatches = R
            kwargs["plan"] = plan
        elif mode == "datacentric":
            kwargs["cluster"] = mixed_cluster(world)
        model = make_model(4, n_layers=LAYERS)
        if mode in ("zebra", "distep"):  # a number logged too: zebra replays it on the device
            step = type(model).training_step

            def training_step(self, batch, batch_idx):
                self.log("a_number", 0.5, reduce_fx="max")
                return step(self, batch, batch_idx)

            model.training_step = training_step.__get__(model)
        counter = CountSyncs()
        # the load monitor of the recipes' default callbacks: its per-step counts read no device value
        monitor = ExpertLoadMonitor(plots=False)
        t = trainer(HeterMoEStrategy(**kwargs), world, max_steps=4, callbacks=[counter, monitor])
        t.fit(model, datamodule=data(world))
        return {"syncs": [tuple(s) for s in counter.syncs[2]], "device": str(t.strategy.root_device),
                "monitored_steps": len(monitor.history)}
    finally:
        os.environ.pop(standin.ENV, None)


def describe(per_rank: list[dict]) -> str:
    lines = []
    for rank, got in enumerate(per_rank):
        where = Counter(f"{kind} {op} at {' < '.join(callers)}" for kind, _, op, callers in got["syncs"])
        lines.append(f"rank {rank}: {len(got['syncs'])} syncs")
        lines += [f"  {n} x {w}" for w, n in where.most_common()]
    return "\n".join(lines)


CASES = [  # mode, ranks, micro-batches per step
    ("auto", 1, 1),  # one rank: the single-device backend
    ("ep", 2, 1),
    ("zebra", 2, 2),
    ("distep", 2, 1),
    ("datacentric", 2, 1),
]


def budget(got: dict, world: int, R: int) -> dict[str, list]:
    """One rank's syncs in one step, sorted by what allows them."""
    out: dict[str, list] = {"lightning_progress_bar": [], "lightning_sigterm": [], "reads": [], "host_lists": [],
                            "async_on_gpu": [], "read_later": [], "blocking_copies": []}
    for kind, where, op, callers in got["syncs"]:
        if kind == "item" and _within(callers, PROGRESS_BAR):
            out["lightning_progress_bar"].append(where)
        elif world > 1 and kind in ("item", "h2d_list") and _within(callers, SIGTERM):
            out["lightning_sigterm"].append(where)
        elif kind == "to_host" and _within(callers, READ_LATER):
            out["read_later"].append(where)
        elif kind in standin.READS:
            out["reads"].append(f"{kind} {op} at {where}")
        elif kind == "h2d_list":
            out["host_lists"].append(where)
        elif _within(callers, ASYNC_ON_GPU):
            out["async_on_gpu"].append(where)
        else:
            out["blocking_copies"].append(where)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode,world,R", CASES, ids=[c[0] for c in CASES])
def test_one_host_read_per_layer_and_microbatch_and_no_host_list_copies(mode, world, R):
    """Every read of device values by the host, but Lightning's own, is a round's split
    sizes: at most one per (layer, micro-batch) and rank; no host list is copied to the
    device (logging included); every other host-to-device copy is one that is asynchronous
    on a GPU."""
    per_rank = run_ranks(world, one_step, world, mode, R)
    report = describe(per_rank)
    print(f"{mode}: {LAYERS} layers x {R} micro-batches\n{report}")
    for rank, got in enumerate(per_rank):
        assert got["device"] == "standin:0"
        assert got["monitored_steps"] == 4, "the monitor recorded every step, the last at the end of training"
        b = budget(got, world, R)
        print(f"rank {rank}: " + ", ".join(f"{k} {len(v)}" for k, v in b.items()))
        assert len(b["reads"]) <= LAYERS * R, (f"rank {rank}: {len(b['reads'])} host reads in a step of {LAYERS} "
                                               f"layers x {R} micro-batches (allowed: 1 per (layer, micro-batch))"
                                               f"\n{report}")
        assert not b["host_lists"], f"rank {rank}: host lists copied to the device\n{report}"
        assert not b["blocking_copies"], f"rank {rank}: blocking host-to-device copies\n{report}"
        assert len(b["lightning_progress_bar"]) <= 1, f"rank {rank}: more progress-bar reads than metrics\n{report}"
        assert not b["lightning_sigterm"], f"rank {rank}: Lightning's SIGTERM broadcast on the device\n{report}"
        assert len(b["read_later"]) <= 1, f"rank {rank}: more than the monitor's counts read later\n{report}"
    # the counter sees the rounds at all: the ranks that route tokens read their split sizes
    assert any(budget(got, world, R)["reads"] for got in per_rank), report


def checkpoint_every_two_steps(rank: int, world: int, root: str) -> dict:
    from helpers_zebra import make_test_plan
    from lightning.pytorch.callbacks import ModelCheckpoint

    from reference import data, make_model, trainer

    os.environ[standin.ENV] = "1"
    try:
        ckpt = ModelCheckpoint(dirpath=root, monitor="train_loss", every_n_train_steps=2, save_top_k=1,
                               filename="{step}")
        counter = CountSyncs(steps=(1, 2))
        strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2, layers=LAYERS))
        t = trainer(strategy, world, max_steps=4, callbacks=[ckpt, counter], enable_checkpointing=True)
        t.fit(make_model(4, n_layers=LAYERS), datamodule=data(world))
        shares = {step: sum(1 for s in syncs if any(c.startswith("lightning_hetermoe/strategy/shared_metrics.py")
                                                     for c in s.callers))
                  for step, syncs in counter.syncs.items()}
        return {"shares": shares, "best": ckpt.best_model_path, "score": float(ckpt.best_model_score),
                "metrics": sorted(t.callback_metrics)}
    finally:
        os.environ.pop(standin.ENV, None)


@pytest.mark.slow
def test_metrics_are_shared_with_the_expert_ranks_only_at_the_steps_a_checkpoint_checks(tmp_path):
    """Zebra's expert ranks log nothing; a checkpoint monitoring ``train_loss`` every two
    steps decides alike on every rank (it needs the metric everywhere), and the metrics
    travel (and are read on the host) at the steps it checks only: the step ending at global
    step 2, not the one ending at 3."""
    per_rank = run_ranks(2, checkpoint_every_two_steps, 2, str(tmp_path))
    for got in per_rank:
        assert got["shares"][1] > 0 and got["shares"][2] == 0, got["shares"]
        assert {k: got[k] for k in ("best", "score", "metrics")} == {k: per_rank[0][k] for k in ("best", "score",
                                                                                                 "metrics")}
    assert "train_loss" in per_rank[1]["metrics"] and per_rank[0]["best"].endswith(".ckpt")


def test_the_gpu_self_check_counts_cuda_sync_warnings_only():
    """The self-check counts the warning CUDA's sync debug mode gives (c10's
    ``warn_or_error_on_sync``), not every warning that mentions synchronising."""
    assert is_sync_warning(UserWarning("called a synchronizing CUDA operation (Triggered internally at "
                                       "/pytorch/c10/cuda/CUDAFunctions.cpp:154.)"))
    for other in ("This is a prototype feature: its synchronization may change",
                  "torch.cuda.synchronize() is deprecated in this context", "Synchronizing streams"):
        assert not is_sync_warning(UserWarning(other)), other


def test_the_gpu_self_checks_step_runs_and_attributes_syncs_by_file(tmp_path):
    """The self-check's ``host syncs`` row on the CPU as far as it goes there: its single-device
    step (mode auto on one device) trains through its run (nothing to count off CUDA), and a
    sync is attributed to the file whose line made it."""
    from types import SimpleNamespace

    from lightning_hetermoe.selfcheck import Context
    from lightning_hetermoe.selfcheck.host_syncs import _step_syncs, syncs_in

    ctx = Context(device=torch.device("cpu"), quick=True, workdir=str(tmp_path))
    # in this process (the self-check runs it in a child): Lightning's rendezvous variables
    # must not reach the processes later tests start
    with mock.patch.dict(os.environ):
        assert _step_syncs(ctx, "syncs-single", "auto", None, 2) == []
    assert not torch.distributed.is_initialized()
    made = [SimpleNamespace(filename="/x/lightning_hetermoe/moe/dispatch.py"), SimpleNamespace(filename="/y/layer.py")]
    assert syncs_in(made, "dispatch.py") == 1 and syncs_in(made, "experts.py") == 0


@pytest.mark.slow
def test_the_standin_counts_each_kind_of_host_sync_only_while_counting():
    assert run_ranks(1, counted_kinds) == [True]


def counted_kinds(rank: int) -> bool:
    """What a GPU syncs on, the stand-in notes, with the line that asked; what a GPU runs
    without the host waiting, it does not; nothing outside ``counting_syncs``."""
    import sys

    import torch

    device = standin.enable()
    x = torch.randn(6, device=device)
    r = torch.tensor([1, 2, 3], device=device)
    here = f"{standin.short_path(__file__)}:"
    with standin.counting_syncs() as syncs:
        line = sys._getframe().f_lineno
        x.sum().item(); bool(x.sum() > 0); x.tolist(); x.cpu(); torch.empty(6).copy_(x)  # noqa: E702
        x.nonzero(); x[x > 0]; torch.repeat_interleave(r); torch.bincount(r)  # noqa: E702
        torch.tensor([1.0, 2.0], device=device); torch.ones(3).to(device)  # noqa: E702
        # device-only: no sync on a GPU
        torch.repeat_interleave(r, output_size=6); x.repeat_interleave(2); torch.where(x > 0, x, 0)  # noqa: E702
        torch.zeros(4, device=device).scatter_add_(0, r, torch.ones(3, device=device)); x.topk(2)  # noqa: E702
        torch.full((), 2.0, device=device) * x; x.masked_fill(x > 0, 0); x.to(torch.float64)  # noqa: E702
    x.sum().item(), x.tolist(), x.cpu()
    kinds = [(s.kind, s.op, s.where) for s in syncs]
    want = [("item", "_local_scalar_dense", 1), ("item", "_local_scalar_dense", 1), ("tolist", "tolist", 1),
            ("to_host", "_to_copy", 1), ("to_host", "copy_", 1), ("value_sized", "nonzero", 2),
            ("value_sized", "index (boolean mask)", 2), ("value_sized", "repeat_interleave", 2),
            ("value_sized", "bincount", 2), ("h2d_list", "tensor", 3), ("h2d", "copy_", 3)]
    assert [(k, op) for k, op, _ in kinds] == [(k, op) for k, op, _ in want], kinds
    for (_, _, where), (_, _, offset) in zip(kinds, want, strict=True):
        assert where == f"{here}{line + offset}", (where, line + offset)
    return True


@pytest.mark.slow
def test_a_busy_meter_reads_no_expert_counts_on_the_host():
    """The load monitor's busy split on a real device (a BusyMeter's hooks) models no time,
    so the experts' counts, on the device under the kernels, are not read there: no host
    sync per (layer, micro-batch) for nothing; an emulated rank's clock reads them (CPU)."""
    assert run_ranks(1, busy_meter_counts) == [True]


def busy_meter_counts(rank: int) -> bool:
    import torch

    from lightning_hetermoe.emulate import BusyMeter
    from lightning_hetermoe.emulate.hooks import _host_counts

    counts = torch.tensor([3, 0, 5]).to(standin.enable())
    with standin.counting_syncs() as syncs:
        got = _host_counts(BusyMeter("cpu"), counts)
    return got == [] and len(syncs) == 0


class SigtermAt(L.Callback):
    """Rank 0 gets a real SIGTERM during ``step``: Lightning's handler (as the strategy left
    it) runs in this process, between this hook and the next batch."""

    def __init__(self, step: int) -> None:
        self.step, self.logged = step, []
        self.logged_in_handler: list[str] | None = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            before = len(self.logged)
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next line
            self.logged_in_handler = self.logged[before:]


class Records(logging.Handler):
    def __init__(self, into: list) -> None:
        super().__init__(logging.INFO)
        self.into = into

    def emit(self, record) -> None:
        self.into.append(record.getMessage())


def stopped_by_sigterm(rank: int, world: int) -> dict:
    from helpers_zebra import make_test_plan
    from reference import data, make_model, trainer

    strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2, layers=LAYERS))
    at = SigtermAt(2)
    sigterm_log = logging.getLogger("lightning_hetermoe.strategy.sigterm")
    sigterm_log.setLevel(logging.INFO)
    sigterm_log.addHandler(Records(at.logged))
    t = trainer(strategy, world, max_steps=6, callbacks=[at])
    try:
        t.fit(make_model(4, n_layers=LAYERS), datamodule=data(world))
    except SIGTERMException:
        return {"raised": True, "step": t.global_step, "logged": at.logged, "in_handler": at.logged_in_handler}
    return {"raised": False, "step": t.global_step}


class SigtermInSanityCheck(L.Callback):
    """Rank 0 gets a real SIGTERM as the sanity check starts: after Lightning installed its
    handler, before the training's start (where the question moves to the host), with the
    sanity check's collectives to come on every rank."""

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def stopped_in_set_up(rank: int, world: int) -> dict:
    from helpers_zebra import make_test_plan
    from reference import data, make_model, trainer

    strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2, layers=LAYERS))
    t = trainer(strategy, world, max_steps=6, callbacks=[SigtermInSanityCheck()], limit_val_batches=2,
                num_sanity_val_steps=2)
    try:
        t.fit(make_model(4, n_layers=LAYERS), datamodule=data(world))
    except SIGTERMException:
        return {"raised": True, "step": t.global_step}
    return {"raised": False, "step": t.global_step}


@pytest.mark.slow
def test_a_sigterm_before_the_first_batch_stops_every_rank_there():
    """A preemption during set-up's last part (the sanity check, the training's start hooks):
    Lightning's handler broadcast from inside whatever collective the rank was in, and the
    main job waited there (a host all-gather, 2026-12-07; here rank 0's broadcast waited for
    rank 1, which waited in the sanity check's first gather, until the harness's deadline).
    The strategy makes the handler quiet as Lightning installs it, and every rank stops
    together: at the sanity check's next batch (each evaluation batch asks), before any
    training batch."""
    per_rank = run_ranks(2, stopped_in_set_up, 2, timeout=60.0)
    assert [r["raised"] for r in per_rank] == [True, True], per_rank
    assert [r["step"] for r in per_rank] == [0, 0], per_rank


class HandlerOfItsOwn(L.Callback):
    """Rank 1 replaces Lightning's SIGTERM handler with one of its own before training."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 1:
            signal.signal(signal.SIGTERM, lambda signum, frame: None)


def one_rank_without_lightnings_handler(rank: int, world: int) -> dict:
    from helpers_zebra import make_test_plan
    from reference import data, make_model, trainer

    strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2, layers=LAYERS))
    t = trainer(strategy, world, max_steps=3, callbacks=[HandlerOfItsOwn()])
    lightnings = type(t.fit_loop.epoch_loop)._broadcast_sigterm_tensor
    t.fit(make_model(4, n_layers=LAYERS), datamodule=data(world))
    asked = t.fit_loop.epoch_loop._broadcast_sigterm_tensor
    return {"step": t.global_step, "lightnings_own": getattr(asked, "__func__", None) is lightnings}


@pytest.mark.slow
def test_ranks_agree_to_keep_lightnings_question_where_one_has_no_handler_of_lightnings():
    """One rank's SIGTERM handler is the user's: no rank moves the question to the host (one
    asking on the host and one on the device would wait for each other); the run trains on."""
    per_rank = run_ranks(2, one_rank_without_lightnings_handler, 2)
    assert [r["step"] for r in per_rank] == [3, 3], per_rank
    assert [r["lightnings_own"] for r in per_rank] == [True, True], per_rank


@pytest.mark.slow
def test_rank_zeros_sigterm_still_stops_every_rank_before_the_next_batch():
    """The strategy asks Lightning's SIGTERM question over the host side (its handler's
    broadcast and the per-batch one): rank 0's signal still reaches every rank, each ends with
    Lightning's SIGTERMException at the same step (none runs a step the others do not)."""
    per_rank = run_ranks(2, stopped_by_sigterm, 2)
    assert [r["raised"] for r in per_rank] == [True, True], per_rank
    assert [r["step"] for r in per_rank] == [2, 2], per_rank
    # The handler itself writes nothing: a signal landing inside a write to the log's stream
    # made the handler's own log line fail with "reentrant call" (CI, 2026-12-07). The rank
    # the signal reached says so at the next batch's question, and only that rank.
    assert per_rank[0]["in_handler"] == [], per_rank[0]
    assert per_rank[0]["logged"] == ["rank 0: received SIGTERM"], per_rank[0]
    assert per_rank[1]["logged"] == [], per_rank[1]


class SigtermInEvaluation(L.Callback):
    """Rank 0 gets a real SIGTERM at the end of an evaluation's second batch; every rank
    counts the batches it ran."""

    def __init__(self) -> None:
        self.ran = 0

    def _ended(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.ran += 1
        if trainer.global_rank == 0 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _ended


def evaluations_stopped_by_sigterm(rank: int, world: int) -> dict:
    from torch.utils.data import DataLoader

    from helpers_predict import BATCH, predictor, rows
    from helpers_zebra import make_test_plan
    from reference import trainer

    out = {}
    for mode in ("ep", "zebra"):
        for fn in ("validate", "test", "predict"):
            plan = make_test_plan(world, [0], R=2) if mode == "zebra" else None
            signalled = SigtermInEvaluation()
            t = trainer(HeterMoEStrategy(mode=mode, plan=plan), world, callbacks=[signalled], limit_val_batches=1.0)
            loader = DataLoader(rows(4 * world * BATCH[world]), batch_size=BATCH[world])  # 4 batches a rank
            try:
                getattr(t, fn)(predictor(seed=0), loader)
                raised = False
            except SIGTERMException:
                raised = True
            out[mode, fn] = {"raised": raised, "ran": signalled.ran, "heard": t.received_sigterm}
    return out


@pytest.mark.slow
def test_a_sigterm_in_validate_test_or_predict_stops_every_rank_before_the_next_batch():
    """An evaluation on its own (a preempted test or predict job): rank 0's SIGTERM stops
    every rank before the third of four batches' step, with Lightning's SIGTERMException, in
    ep and zebra. The quiet handler only notes the signal, so the evaluation ran to its end (the
    scheduler's grace running out meanwhile); Lightning's own would stop the signalled rank
    alone and leave the others waiting in the next batch's collectives."""
    per_rank = run_ranks(2, evaluations_stopped_by_sigterm, 2, timeout=120.0)
    for key in per_rank[0]:
        assert [r[key] for r in per_rank] == [{"raised": True, "ran": 2, "heard": True}] * 2, (key, per_rank)


def main_job_signalled_in_its_final_validation(rank: int, output_dir: str) -> dict:
    from helpers_recipe import compose
    from lightning_hetermoe.training import train

    cfg = compose("trainer.max_steps=2", "+trainer.num_sanity_val_steps=0",
                  "cluster.time_scale=0.05", "data.val_windows=64",
                  "+callbacks.signalled._target_=helpers_exit.SigtermInFinalValidation")
    try:
        train(cfg, output_dir)
    except SIGTERMException as err:
        return {"code": err.code}
    return {"code": "finished"}


@pytest.mark.slow
def test_a_sigterm_in_the_main_job_s_final_validation_ends_it_as_preempted(tmp_path):
    """The validation after training is stopped too, on every rank, and the job says so: rank
    0 exits 143 (its summary's status), the other rank 0 (a launcher would take its code for
    a failure). The validation ran to its end and the job exited 0, as if finished."""
    from lightning_hetermoe.training import PREEMPTED_EXIT

    per_rank = run_ranks(2, main_job_signalled_in_its_final_validation, str(tmp_path), timeout=120.0)
    assert [r["code"] for r in per_rank] == [PREEMPTED_EXIT, None], per_rank
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped in the final validation, after step 2: the job got SIGTERM", summary
    assert summary["steps"] == 2 and summary["step_time_s"] > 0, summary
