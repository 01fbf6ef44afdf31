"""The best checkpoint of a run loads back in one call, in every mode: a small model's is
Lightning's single file (``checkpoint_format="auto"``), which ``load_from_checkpoint``
reads; a model above the threshold saves a sharded directory, which
``lightning_hetermoe.load_checkpoint`` reads. Either way the loaded model equals the
trained one at the best step."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

import lightning_hetermoe
from harness import run_ranks
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan
from lightning_hetermoe import HeterMoEStrategy, MoELanguageModel, OptimConfig, staging
from lightning_hetermoe.ckpt import CheckpointFormatError, is_sharded_checkpoint
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.profile import memory
from reference import data, make_model, trainer, whole_state

MODES = ("auto", "ep", "zebra", "distep", "datacentric")
LARGE = ("ep", "zebra")  # above the threshold: sharded directories


class Snapshots(L.Callback):
    """The whole model (every expert gathered: a collective) at each validation, by step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.at[trainer.global_step] = {k: v.detach().cpu().clone() for k, v in whole_state(trainer).items()}


def _strategy(mode: str, world: int) -> HeterMoEStrategy:
    plan = make_test_plan(world, [0], R=2) if mode in ("zebra", "distep") else None
    return HeterMoEStrategy(mode=mode, plan=plan)  # checkpoint_format: the default, auto


def best_checkpoints(rank: int, world: int, root: str, runs: list[tuple[str, float | None]]) -> dict:
    """Each run: ModelCheckpoint on val_loss and EarlyStopping; ``threshold``: the small-state
    line in this process (``None``: the default), as a user's larger model would cross it."""
    out = {}
    default = memory.SMALL_STATE_BYTES
    for mode, threshold in runs:
        memory.SMALL_STATE_BYTES = default if threshold is None else threshold
        model = make_model(4, seed=0, optim=OptimConfig())
        where = os.path.join(root, f"{mode}-{threshold}")
        ckpt = ModelCheckpoint(dirpath=where, monitor="val_loss", mode="min", save_top_k=1, filename="{step}")
        stop = EarlyStopping(monitor="val_loss", mode="min", patience=1, min_delta=1e9)  # stops at step 8
        snaps = Snapshots()
        t = trainer(_strategy(mode, world), world, max_steps=40, callbacks=[ckpt, stop, snaps],
                    enable_checkpointing=True, limit_val_batches=2, val_check_interval=4, limit_train_batches=12)
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out[(mode, threshold)] = {"best": ckpt.best_model_path, "step": t.global_step,
                                  "snapshots": snaps.at if rank == 0 else None,
                                  "sharded": t.strategy.sharded_checkpoints}
    memory.SMALL_STATE_BYTES = default
    return out


def _best_step(path: str) -> int:
    return int(re.search(r"step=(\d+)", os.path.basename(path)).group(1))


def _assert_equal(loaded: MoELanguageModel, want: dict[str, torch.Tensor], what: str) -> None:
    got = loaded.state_dict()
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{what}: {name}")


@pytest.mark.slow
def test_the_best_checkpoint_loads_in_one_call_in_every_mode_small_as_a_file_large_as_a_directory(tmp_path):
    runs = [(mode, None) for mode in MODES] + [(mode, 0.0) for mode in LARGE]
    per_rank = run_ranks(2, best_checkpoints, 2, str(tmp_path), runs)
    fresh = make_model(4, seed=0, optim=OptimConfig()).state_dict()
    for key in runs:
        got = per_rank[0][key]
        assert per_rank[1][key]["best"] == got["best"] and got["step"] == 8, (key, got["step"])
        want = got["snapshots"][_best_step(got["best"])]
        assert any(not torch.equal(want[n], fresh[n]) for n in want), key  # trained: the comparison means something
        if key[1] is None:  # small: Lightning's own file and its own loader
            assert os.path.isfile(got["best"]) and not got["sharded"], key
            loaded = MoELanguageModel.load_from_checkpoint(got["best"], map_location="cpu")
        else:  # above the threshold: a directory, and the one documented call
            assert is_sharded_checkpoint(got["best"]) and got["sharded"], key
            loaded = lightning_hetermoe.load_checkpoint(got["best"], MoELanguageModel)
            assert lightning_hetermoe.load_checkpoint(got["best"])["global_step"] == _best_step(got["best"])
            # the pack's own LightningModule takes the directory in Lightning's call too
            _assert_equal(MoELanguageModel.load_from_checkpoint(got["best"]), want, f"{key} load_from_checkpoint")
        assert isinstance(loaded, MoELanguageModel) and loaded.model_cfg == make_model(4).model_cfg, key
        _assert_equal(loaded, want, str(key))


def weights_only_checkpoints(rank: int, world: int, root: str, runs: list[tuple[str, str]]) -> dict:
    """Each run: 4 steps with ModelCheckpoint(save_weights_only=True); then a validation of
    another model from that checkpoint, and a fit resumed from it."""
    out = {}
    for mode, fmt in runs:
        plan = make_test_plan(world, [0], R=2) if mode in ("zebra", "distep") else None
        strategy = lambda: HeterMoEStrategy(mode=mode, plan=plan, checkpoint_format=fmt)  # noqa: E731
        model = make_model(4, seed=0, optim=OptimConfig())
        ckpt = ModelCheckpoint(dirpath=os.path.join(root, f"{mode}-{fmt}"), save_weights_only=True,
                               every_n_train_steps=4, filename="{step}")
        trainer(strategy(), world, max_steps=4, callbacks=[ckpt], enable_checkpointing=True).fit(
            model, datamodule=data(world))
        other = make_model(4, seed=1, optim=OptimConfig())
        trainer(strategy(), world, limit_val_batches=2).validate(other, datamodule=data(world),
                                                                 ckpt_path=ckpt.last_model_path or ckpt.best_model_path)
        try:
            trainer(strategy(), world, max_steps=8).fit(make_model(4, seed=2, optim=OptimConfig()),
                                                        datamodule=data(world), ckpt_path=ckpt.best_model_path)
            resumed = None
        except KeyError as err:
            resumed = str(err)
        out[(mode, fmt)] = {"path": ckpt.best_model_path, "trained": model.state_dict(),
                            "validated": other.state_dict(), "resume_error": resumed}
    return out


@pytest.mark.slow
def test_a_weights_only_checkpoint_loads_in_either_format_and_a_resume_from_it_fails_as_lightning_s_does(tmp_path):
    """``ModelCheckpoint(save_weights_only=True)``: the checkpoint holds the trained weights and
    no optimizer state in either format; it loads in one call and into a validation under the
    strategy; a fit resumed from it fails as Lightning's own file does (a sharded directory
    said only "0 optimizer(s)")."""
    runs = [("ep", "full"), ("zebra", "sharded")]  # zebra: the dense weights on the attention rank alone
    per_rank = run_ranks(2, weights_only_checkpoints, 2, str(tmp_path), runs)
    for key in runs:
        got = per_rank[0][key]
        fresh = make_model(4, seed=0, optim=OptimConfig()).state_dict()
        assert any(not torch.equal(got["trained"][n], fresh[n]) for n in fresh), key  # it trained
        assert is_sharded_checkpoint(got["path"]) == (key[1] == "sharded"), key
        saved = lightning_hetermoe.load_checkpoint(got["path"])
        assert "optimizer_states" not in saved and saved["global_step"] == 4, (key, sorted(saved))
        _assert_equal(lightning_hetermoe.load_checkpoint(got["path"], MoELanguageModel), got["trained"], str(key))
        for rank in (0, 1):  # every rank validated the saved weights, and holds them whole after
            for name, value in got["trained"].items():
                torch.testing.assert_close(per_rank[rank][key]["validated"][name], value, rtol=0, atol=0)
        assert got["resume_error"] is not None and "contains only the model" in got["resume_error"], key
        assert per_rank[1][key]["resume_error"] == got["resume_error"], key


def test_checkpoint_format_auto_draws_the_init_on_meta_line():
    from lightning_hetermoe.strategy.arguments import CHECKPOINT_FORMATS, StrategyArguments

    assert StrategyArguments().checkpoint_format == "auto" and "auto" in CHECKPOINT_FORMATS
    assert HeterMoEStrategy().args.checkpoint_format == "auto"
    line = memory.SMALL_STATE_BYTES / memory.TRAINING_BYTES_PER_PARAM  # parameters at the line
    assert memory.small_training_state(line) and not memory.small_training_state(line + 1)
    from omegaconf import OmegaConf

    conf = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "strategy", "hetermoe.yaml"))
    assert conf.checkpoint_format == "auto"


def test_load_checkpoint_says_what_is_wrong_with_the_path(tmp_path):
    with pytest.raises(CheckpointFormatError, match=r"load_checkpoint path=.*nothing.*: no such file or directory$"):
        lightning_hetermoe.load_checkpoint(tmp_path / "nothing")
    (tmp_path / ".nothing.partial-1a2b").mkdir()  # the first save of it, killed before its end
    with pytest.raises(CheckpointFormatError, match=r"nothing': no such file or directory; beside it, "
                                                    r"\.nothing\.partial-1a2b is a save of it that did not finish"):
        lightning_hetermoe.load_checkpoint(tmp_path / "nothing")
    # where the system cannot swap two names, a save killed between its two renames leaves
    # the earlier checkpoint whole beside the missing one: the message says how to get it back
    (tmp_path / ".nothing.old-3c4d").mkdir()
    with pytest.raises(CheckpointFormatError, match=r"nothing': no such file or directory; beside it, "
                                                    r"\.nothing\.old-3c4d is its earlier copy, whole, moved aside by "
                                                    r"a save that did not finish: rename it to nothing to use it$"):
        lightning_hetermoe.load_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointFormatError, match=r"is a directory but not a sharded checkpoint"):
        lightning_hetermoe.load_checkpoint(tmp_path)


# (mode, attention ranks, checkpoint format, ZeRO-1, a validate between fit and the save):
# rank 0 an expert rank under zebra (a whole file there made its fused Adam step read
# moments sized for no experts: SIGSEGV)
AFTER_FIT = [("ep", None, "auto", False, False), ("zebra", [1], "auto", False, False),
             ("distep", [0], "sharded", False, False), ("datacentric", None, "auto", False, False),
             ("ep", None, "sharded", True, False), ("zebra", [1], "sharded", False, True)]


def save_after_fit_then_resume(rank: int, world: int, root: str) -> dict:
    out = {}
    for mode, attention, fmt, zero, validate in AFTER_FIT:
        plan = make_test_plan(world, attention, R=2) if attention is not None else None

        def strategy() -> HeterMoEStrategy:
            return HeterMoEStrategy(mode=mode, plan=plan, checkpoint_format=fmt, shard_optimizer_state=zero)

        name = f"{mode}-{fmt}-{zero}-{validate}"
        first = make_model(4, seed=0, optim=OptimConfig())
        t = trainer(strategy(), world, max_steps=3, limit_val_batches=2)
        t.fit(first, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        if validate:  # lays the model out and gathers it back again: the optimizer follows
            t.validate(first, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]), verbose=False)
        path = os.path.join(root, name + ".ckpt")
        t.save_checkpoint(path)
        resumed = make_model(4, seed=3, optim=OptimConfig())
        t2 = trainer(strategy(), world, max_steps=4)
        t2.fit(resumed, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]), ckpt_path=path)
        out[name] = {k: v.clone() for k, v in resumed.state_dict().items()}
    return out


@pytest.mark.slow
def test_a_checkpoint_saved_after_fit_resumes_as_one_process_s_does_in_every_mode(tmp_path):
    """``trainer.fit`` then ``trainer.save_checkpoint`` (what the main job's
    ``save_checkpoint=`` does), then a new fit from it: the run ends with the model whole
    on every rank, and the optimizer now follows it (each expert's moments gathered), so
    the checkpoint holds every expert's state as one process's does. Before, it held the
    writing rank's own experts' moments: resumed, the experts trained apart (2e-3 after one
    step) in every mode, and under zebra a rank's fused Adam read moments sized for none.
    A ``validate`` between the fit and the save lays the model out and gathers it back as
    new parameters: the optimizer follows them (else a sharded save skipped the experts)."""
    got = run_ranks(2, save_after_fit_then_resume, 2, str(tmp_path), timeout=240)[0]
    # one process, the same steps: 3, saved after fit, resumed to 4 (Lightning's own resume
    # from a checkpoint saved after fit, data position included)
    one = trainer("auto", 1, max_steps=3)
    model = make_model(4, seed=0, optim=OptimConfig())
    one.fit(model, datamodule=data(1, GLOBAL[2], windows=WINDOWS[2]))
    path = str(tmp_path / "one.ckpt")
    one.save_checkpoint(path)
    again = make_model(4, seed=3, optim=OptimConfig())
    trainer("auto", 1, max_steps=4).fit(again, datamodule=data(1, GLOBAL[2], windows=WINDOWS[2]), ckpt_path=path)
    want = again.state_dict()
    for name, state in got.items():
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=f"{name}: {key}")


class SigtermAtStep3(L.Callback):
    """Rank 0 gets SIGTERM after step 3, as a preempted job's ranks do: Lightning's handler,
    asked over the pack's host side, stops every rank before its next batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 3 and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


class RaiseAtStep3(L.Callback):
    """An error at the start of step 3 on the ranks named (one alone: an out-of-memory on
    one device)."""

    def __init__(self, ranks) -> None:
        self.ranks = list(ranks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 3 and trainer.global_rank in self.ranks:
            raise RuntimeError(f"injected error on rank {trainer.global_rank}")


def exception_checkpoints(rank: int, world: int, root: str, modes: tuple[str, ...]) -> dict | None:
    """Per mode: an uninterrupted run of 6 steps, and a run that a SIGTERM stops after step 3
    (OnExceptionCheckpoint saves) resumed from its checkpoint to step 6."""
    import contextlib
    import io

    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    out = {}
    for mode in modes:
        straight = make_model(4, seed=0)
        trainer(_strategy(mode, world), world, max_steps=6).fit(straight, datamodule=data(world))
        where = os.path.join(root, mode)
        t = trainer(_strategy(mode, world), world, max_steps=6, enable_checkpointing=True,
                    callbacks=[SigtermAtStep3(), OnExceptionCheckpoint(where)])
        err = io.StringIO()
        with pytest.raises(SIGTERMException), contextlib.redirect_stderr(err):
            t.fit(make_model(4, seed=0), datamodule=data(world))
        resumed = make_model(4, seed=rank)  # seeded apart: the checkpoint must set every weight
        again = trainer(_strategy(mode, world), world, max_steps=6)
        again.fit(resumed, datamodule=data(world), ckpt_path=os.path.join(where, "on_exception.ckpt"))
        out[mode] = {"straight": straight.state_dict(), "resumed": resumed.state_dict(), "step": again.global_step,
                     "stopped_at": t.global_step, "stderr": err.getvalue()}
    return out if rank == 0 else None


@pytest.mark.slow
def test_a_preempted_job_saves_the_exception_checkpoint_and_it_resumes_as_the_run_went_on():
    modes = ("ep", "zebra")  # the four modes saved and resumed alike when probed; these two keep it
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        got = run_ranks(2, exception_checkpoints, 2, root, modes)[0]
    for mode in modes:
        assert got[mode]["stopped_at"] == 3 and got[mode]["step"] == 6, mode
        assert "stopped: the job got SIGTERM" in got[mode]["stderr"], got[mode]["stderr"][-2000:]
        straight, resumed = got[mode]["straight"], got[mode]["resumed"]
        assert straight.keys() == resumed.keys()
        for name in straight:
            torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")


def one_rank_fails(rank: int, world: int, root: str, mode: str) -> None:
    """Rank 1 alone raises at step 3 with OnExceptionCheckpoint on; rank 1 records what it
    printed and how long it took to fail."""
    import contextlib
    import io
    import json
    import time

    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    plan = make_test_plan(world, [0], R=2) if mode in ("zebra", "distep") else None
    strategy = HeterMoEStrategy(mode=mode, plan=plan, progress_timeout_s=3)
    t = trainer(strategy, world, max_steps=6, enable_checkpointing=True,
                callbacks=[RaiseAtStep3([1]), OnExceptionCheckpoint(os.path.join(root, "ckpt"))])
    err, t0 = io.StringIO(), time.monotonic()
    try:
        with contextlib.redirect_stderr(err):
            t.fit(make_model(4, seed=0), datamodule=data(world))
    finally:
        if rank == 1:
            with open(os.path.join(root, "rank1.json"), "w") as f:
                json.dump({"stderr": err.getvalue(), "seconds": time.monotonic() - t0}, f)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ep", "zebra"])
def test_an_error_on_one_rank_alone_saves_nothing_says_so_and_ends_the_job(mode, tmp_path):
    """A save takes every rank. The rank that failed alone waited in it for peers that wait in
    the step it left: its own error was never reported, and the job ended only when a peer's
    progress watchdog called that peer stuck (with the watchdog off, never)."""
    import json

    with pytest.raises(RuntimeError, match="injected error on rank 1"):
        run_ranks(2, one_rank_fails, 2, str(tmp_path), mode, timeout=90)
    record = json.loads((tmp_path / "rank1.json").read_text())
    assert "did not save" in record["stderr"] and "rank(s) 0 did not ask for it within 3 s" in record["stderr"], record
    assert record["seconds"] < 30, record
    assert not (tmp_path / "ckpt" / "on_exception.ckpt").exists()


def save_cut_short(rank: int, world: int, root: str) -> dict:
    """A sharded checkpoint saved at step 2, then saved again under its name at step 4 cut
    short on its writer once every rank's pieces are written (before the meta), then again
    whole at step 6: what the directory holds after each."""
    import lightning_hetermoe.strategy.hetermoe as module

    path = os.path.join(root, "last.ckpt")
    model = make_model(4, seed=0, optim=OptimConfig())
    t = trainer(HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2), checkpoint_format="sharded"),
                world, max_steps=2)
    dm = data(world, GLOBAL[world], windows=WINDOWS[world])

    def files() -> dict[str, bytes]:
        return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}

    t.fit(model, datamodule=dm)
    t.save_checkpoint(path)
    first = files()
    t.fit_loop.epoch_loop.max_steps = 4
    t.fit(model, datamodule=dm)
    real_pieces, failed = module.save_pieces, []
    writer = t.strategy.backend.writes_checkpoints(rank)

    def pieces_then_stopped(*args, **kwargs):
        real_pieces(*args, **kwargs)
        if writer:
            raise KeyboardInterrupt("stopped before the meta")

    module.save_pieces = pieces_then_stopped
    try:  # the strategy's save alone: Trainer.save_checkpoint's barrier would wait on the stopped rank
        for where in (path, os.path.join(root, "new", "deeper", "step=4.ckpt")):  # a new path: its parents made
            try:
                t.strategy.save_checkpoint(t._checkpoint_connector.dump_checkpoint(), where)
            except KeyboardInterrupt:
                failed.append(rank)
            t.strategy.barrier("after a cut-short save")
    finally:
        module.save_pieces = real_pieces
    after_cut = files()
    if rank == 0:  # what a save killed before its end (SIGKILL: no clean-up ran) leaves beside it
        os.makedirs(os.path.join(root, ".last.ckpt.partial-killed"))
        open(os.path.join(root, ".last.ckpt.partial-killed", "__0_0.distcp"), "wb").write(b"half")
    t.fit_loop.epoch_loop.max_steps = 6
    t.fit(model, datamodule=dm)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        t.save_checkpoint(path)
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
    out = {"failed": failed, "first": first, "after_cut": after_cut, "last": files(), "step": meta["global_step"],
           "siblings": sorted(os.listdir(root)), "printed": printed.getvalue(), "writer": writer}

    # the step-8 save swapped in, the step-6 copy it replaced cannot be removed (a network file
    # system's busy file): the save has succeeded and training goes on; the step-10 save removes it
    def busy(old):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(old))

    for steps in (8, 10):
        t.fit_loop.epoch_loop.max_steps = steps
        t.fit(model, datamodule=dm)
        printed = io.StringIO()
        real_remove = staging._remove_old
        staging._remove_old = busy if steps == 8 else real_remove
        try:
            with contextlib.redirect_stderr(printed):
                t.save_checkpoint(path)
        finally:
            staging._remove_old = real_remove
        meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
        out[steps] = {"step": meta["global_step"], "siblings": sorted(os.listdir(root)), "printed": printed.getvalue()}

    # ModelCheckpoint drops a checkpoint it no longer keeps (save_top_k), one the file system
    # will not let go of: the run goes on (every rank meets the barrier after it)
    real_io_remove = t.strategy.checkpoint_io.remove_checkpoint
    t.strategy.checkpoint_io.remove_checkpoint = busy
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            t.strategy.remove_checkpoint(path)
    finally:
        t.strategy.checkpoint_io.remove_checkpoint = real_io_remove
    t.strategy.barrier("after a removal that failed")
    out["dropped"] = {"printed": printed.getvalue(), "there": os.path.isdir(path)}
    return out


@pytest.mark.slow
def test_a_sharded_save_cut_short_leaves_the_checkpoint_of_that_name_as_it_was(tmp_path):
    """The pieces and the meta are written under a hidden name beside the checkpoint and
    swapped in whole: before, a save into the same directory wrote the new pieces beside the
    old meta, and a save cut short between them left a checkpoint that was neither."""
    results = run_ranks(2, save_cut_short, 2, str(tmp_path))
    assert [len(r["failed"]) for r in results if r["writer"]] == [2] and sum(len(r["failed"]) for r in results) == 2, \
        "both saves stopped on their writer alone"
    r = results[0]
    assert r["after_cut"] == r["first"], "the step-2 checkpoint stays whole"
    assert r["step"] == 6 and r["last"].keys() == r["first"].keys() and r["last"] != r["first"]
    assert r["siblings"] == ["last.ckpt"], "no partial directory left beside it, a killed save's removed, " \
                                           "no directory made for the new path's save that was cut short"
    (said,) = [x["printed"] for x in results if x["writer"]]
    assert f"removed {tmp_path / '.last.ckpt.partial-killed'}: a save of last.ckpt that did not finish" in said
    (w,) = [x for x in results if x["writer"]]
    assert w[8]["step"] == 8 and "last.ckpt" in w[8]["siblings"] and len(w[8]["siblings"]) == 2, w[8]
    (left,) = [name for name in w[8]["siblings"] if name != "last.ckpt"]
    assert left.startswith(".last.ckpt.old-"), "the copy it could not remove is named for what it is"
    assert (f"saved {tmp_path / 'last.ckpt'}; its earlier copy, now {tmp_path / left}, could not be removed "
            f"(Device or resource busy): the next save of last.ckpt removes it") in w[8]["printed"], w[8]["printed"]
    assert w[10]["step"] == 10 and w[10]["siblings"] == ["last.ckpt"], w[10]
    assert f"removed {tmp_path / left}: an earlier copy of last.ckpt, replaced" in w[10]["printed"]
    assert w["dropped"]["printed"] == (f"[hetermoe] could not remove {tmp_path / 'last.ckpt'}, a checkpoint no longer "
                                       f"kept (Device or resource busy): training goes on; remove it by hand\n")
    assert w["dropped"]["there"] and all(not x["dropped"]["printed"] for x in results if not x["writer"])


def from_own_directories(rank: int, world: int, root: str) -> dict:
    """Each rank in a working directory of its own (as a node's own disk is): a sharded save
    to a relative path (what each rank's save says, what is left on each "disk"); the same
    job's save to storage every rank sees, copied into rank 0's directory alone; then resumes
    from relative paths (what each rank's fit says, and how long it took to say it)."""
    import shutil
    import time

    os.makedirs(os.path.join(root, f"node{rank}"))
    os.chdir(os.path.join(root, f"node{rank}"))

    def fit(steps: int, **kwargs):
        model = make_model(4, seed=0, optim=OptimConfig())
        t = trainer(HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2), checkpoint_format="sharded"),
                    world, max_steps=steps)
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]), **kwargs)
        return t

    t = fit(3)
    out: dict = {"writer": t.strategy.backend.writes_checkpoints(rank)}
    try:
        t.save_checkpoint(os.path.join("ckpt", "last.ckpt"))
        out["save"] = "saved"
    except ConfigError as err:
        out["save"] = str(err)
    out["left"] = sorted(os.listdir("."))
    t.save_checkpoint(os.path.join(root, "shared", "last.ckpt"))
    if rank == 0:
        shutil.copytree(os.path.join(root, "shared"), "ckpt")
    t.strategy.barrier("copied")
    for where in ("ckpt/last.ckpt", "nowhere/last.ckpt"):
        started = time.monotonic()
        try:
            fit(5, ckpt_path=where)
            out[where] = "resumed"
        except ConfigError as err:
            out[where] = str(err)
        out[where + " s"] = time.monotonic() - started
    out["shared"] = fit(5, ckpt_path=os.path.join(root, "shared", "last.ckpt")).global_step
    return out


@pytest.mark.slow
def test_a_checkpoint_some_rank_cannot_see_is_refused_on_every_rank_to_save_and_to_resume(tmp_path):
    """Every rank writes its part of a sharded checkpoint into the directory the writer made,
    and reads its part of one it resumes from. A rank that does not see that directory (a
    node's own disk; here a working directory of its own under a relative path) used to write
    its pieces into one of its own: the save said nothing, and the checkpoint lacked that
    rank's part (its .metadata naming a piece that was never beside it). A rank without a
    resume path used to fail alone (Lightning's FileNotFoundError) while its peers waited in
    the load's next collective. Now every rank refuses either at once with the same message
    naming the ranks, the refused save leaves nothing, a path no rank has says so, and the
    same job saves to and resumes from storage every rank sees."""
    results = run_ranks(2, from_own_directories, 2, str(tmp_path))
    (writer,) = [r for r, x in enumerate(results) if x["writer"]]
    said = {x["save"] for x in results}
    assert len(said) == 1, said
    (message,) = said
    assert message.startswith(f"the sharded checkpoint ckpt/last.ckpt cannot be saved: rank(s) [{1 - writer}] do not "
                              f"see the directory rank {writer} made for it (ckpt/.last.ckpt.partial-"), message
    assert "save checkpoints on a file system every node sees" in message
    assert [x["left"] for x in results] == [[], []], "no directory made for the refused save, on either disk"
    shared = tmp_path / "shared" / "last.ckpt"
    assert torch.load(shared / "meta.pt", weights_only=False)["global_step"] == 3
    assert sorted(p.name for p in shared.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for key, want in (("ckpt/last.ckpt", "ckpt_path='ckpt/last.ckpt' is invalid: rank(s) [1] do not see it (no such "
                                         "file or directory there), and every rank reads its part: resume from a "
                                         "checkpoint on a file system every node sees"),
                      ("nowhere/last.ckpt", "ckpt_path='nowhere/last.ckpt' is invalid: no such file or directory")):
        assert {r[key] for r in results} == {results[0][key]}, [r[key] for r in results]
        assert results[0][key].startswith(want), results[0][key]
        assert max(r[key + " s"] for r in results) < 30, [r[key + " s"] for r in results]
    assert [r["shared"] for r in results] == [5, 5]
