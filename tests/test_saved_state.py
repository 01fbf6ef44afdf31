"""Saved state: saving never touches live state; a checkpoint taken mid-epoch on one world
size and mode resumes on another exactly where the uninterrupted run would be. Sharded
checkpoints (the default) are written by every rank, each its own part; full ones (one
file) stay available; the offline tool turns a sharded one into the full file."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from lightning_hetermoe.ckpt.consolidate import consolidate
from reference import assert_same_params, data, make_model, reference_fit, trainer, whole_state

pytestmark = pytest.mark.slow

WINDOWS = 24  # 3 global batches of 8 per epoch
EPOCHS = 3
STEPS = EPOCHS * WINDOWS // 8
NUM_EXPERTS = 4


def model(seed: int = 0):
    # AdamW's moments and step counts make the optimizer state matter on resume.
    return make_model(NUM_EXPERTS, seed=seed, optim=OptimConfig())


def fit_with_step_checkpoints(rank: int, world: int, ckpt_dir: str, mode: str, plan=None, fmt: str = "sharded"):
    m = model(seed=rank)
    every = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    t = trainer(HeterMoEStrategy(mode=mode, plan=plan, checkpoint_format=fmt), world, max_epochs=EPOCHS,
                callbacks=[every], enable_checkpointing=True)
    t.fit(m, datamodule=data(world, windows=WINDOWS))
    return m.state_dict() if rank == 0 else None


def save_both(rank: int, world: int, ep_dir: str, zebra_dir: str, plan) -> list | None:
    """Step checkpoints under ep (full files) and under zebra (sharded), in one start of the ranks."""
    out = [fit_with_step_checkpoints(rank, world, ep_dir, "ep", fmt="full"),
           fit_with_step_checkpoints(rank, world, zebra_dir, "zebra", plan)]
    return out if rank == 0 else None


def resume_each(rank: int, world: int, cases: list[tuple[str, str, object, str]]):
    """Several resumes (checkpoint, mode, plan, checkpoint_format) in one start of the ranks,
    each on a model built on the meta device (anything: the checkpoint decides). ``sharded``:
    the resumed run's optimizer state sharded over replicas (ZeRO-1), as a large model's;
    ``auto`` (the default): this small model's, kept whole."""
    out = []
    for ckpt, mode, plan, fmt in cases:
        t = trainer(HeterMoEStrategy(mode=mode, plan=plan, checkpoint_format=fmt), world, max_epochs=EPOCHS)
        with t.init_module(empty_init=True):
            m = model(seed=100 + rank)
        t.fit(m, datamodule=data(world, windows=WINDOWS), ckpt_path=ckpt)
        out.append(whole_state(t))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Step checkpoints saved by ep (full) and zebra (1 attention + 1 expert rank, R=2, sharded)
    on 2 ranks; the zebra step-4 checkpoint consolidated offline; then resumed on 4 ranks under
    ep, datacentric and zebra (2 attention + 2 expert ranks, Asym-EA), and the full and the
    consolidated files under ep. Two starts of the ranks."""
    from helpers_zebra import make_test_plan

    ep_dir, zebra_dir = str(tmp_path_factory.mktemp("ep")), str(tmp_path_factory.mktemp("zebra"))
    plan2 = make_test_plan(2, [0], R=2, num_experts=NUM_EXPERTS)
    saved = run_ranks(2, save_both, 2, ep_dir, zebra_dir, plan2)[0]
    consolidated = Path(tmp_path_factory.mktemp("whole")) / "step=4.ckpt"
    consolidate(f"{zebra_dir}/step=4.ckpt", consolidated)
    plan4 = make_test_plan(4, [0, 1], R=3, num_experts=NUM_EXPERTS, placement=[[2, 2, 3, 0], [2, 3, 3, 1]])
    cases = [(f"{zebra_dir}/step=4.ckpt", "ep", None, "sharded"), (f"{zebra_dir}/step=4.ckpt", "datacentric", None,
                                                                    "sharded"),
             (f"{zebra_dir}/step=4.ckpt", "zebra", plan4, "sharded"), (f"{ep_dir}/step=4.ckpt", "ep", None, "sharded"),
             (str(consolidated), "ep", None, "sharded"), (f"{zebra_dir}/step=4.ckpt", "ep", None, "auto"),
             (f"{ep_dir}/step=4.ckpt", "datacentric", None, "auto")]
    resumed = run_ranks(4, resume_each, 4, cases)[0]
    m = model()
    return {"ep_dir": Path(ep_dir), "zebra_dir": Path(zebra_dir), "consolidated": consolidated, "saved": saved,
            "resumed": resumed, "initial": copy.deepcopy(m.state_dict()),
            "expected": reference_fit(m, STEPS, windows=WINDOWS)}


def test_saving_changes_nothing_in_either_format(runs):
    # Saving every 2 steps across 3 epochs: training goes on and ends as without checkpoints.
    for saved in runs["saved"]:
        assert_same_params(saved, runs["expected"], runs["initial"])
    for d in (runs["ep_dir"], runs["zebra_dir"]):
        names = sorted(p.name for p in d.glob("*.ckpt"))
        assert names == [f"step={s}.ckpt" for s in (2, 4, 6, 8)], names
    assert (runs["ep_dir"] / "step=4.ckpt").is_file() and (runs["zebra_dir"] / "step=4.ckpt").is_dir()


def test_a_sharded_checkpoint_is_written_by_every_rank_each_its_part(runs):
    from lightning_hetermoe.ckpt import read_metadata

    ckpt = runs["zebra_dir"] / "step=4.ckpt"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # rank 0 is the attention rank (the dense part), rank 1 holds every expert (the plan):
    # each wrote what it holds, weights and optimizer state; nothing was gathered anywhere
    md = read_metadata(ckpt)
    files = {}
    for index, info in md.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    assert files, "the checkpoint lists no tensors"
    for key, where in files.items():
        expected = "__1_0.distcp" if ".experts." in key else "__0_0.distcp"
        assert where == {expected}, (key, where)
    assert any(".experts." in k and k.startswith("optimizer_states.") for k in files)


def test_the_consolidated_checkpoint_is_the_full_format(runs):
    full = torch.load(runs["ep_dir"] / "step=4.ckpt", weights_only=False)
    whole = torch.load(runs["consolidated"], weights_only=False)
    assert full["state_dict"].keys() == whole["state_dict"].keys()
    for name, t in full["state_dict"].items():
        torch.testing.assert_close(whole["state_dict"][name], t, rtol=1e-5, atol=1e-5, msg=name)
    w_up = whole["state_dict"]["model.blocks.0.moe.experts.w_up"]
    assert w_up.shape[0] == NUM_EXPERTS, "a consolidated checkpoint holds every expert"
    a, b = full["optimizer_states"][0], whole["optimizer_states"][0]
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert a["state"].keys() == b["state"].keys()
    # the weights' tolerance: ep and zebra sum gradients in different orders (one Adam moment
    # of 4096 differed by 1.4e-6 on an AVX-512 CPU)
    for i in a["state"]:
        for key, t in a["state"][i].items():
            torch.testing.assert_close(b["state"][i][key], t, rtol=1e-5, atol=1e-5, msg=f"{i}.{key}")
    assert whole["epoch"] == full["epoch"] == 1 and whole["global_step"] == full["global_step"] == 4


def test_a_consolidation_stopped_half_way_leaves_the_file_already_there_as_it_was(runs, tmp_path, monkeypatch):
    out = tmp_path / "whole.ckpt"
    out.write_bytes(runs["consolidated"].read_bytes())
    before = out.read_bytes()
    real_save = torch.save

    def half_then_stopped(obj, f):
        real_save({"state_dict": {}}, f)  # some of the file written
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        consolidate(f"{runs['zebra_dir']}/step=4.ckpt", out)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["whole.ckpt"]


RESUMES = ["zebra->ep", "zebra->datacentric", "zebra->zebra 2+2", "full ep->ep", "consolidated->ep",
           "zebra->ep at the default format", "full ep->datacentric at the default format"]


@pytest.mark.parametrize("case", RESUMES)
def test_resumes_mid_epoch_on_another_world_and_mode_as_if_uninterrupted(runs, case):
    i = RESUMES.index(case)
    assert_same_params(runs["resumed"][i], runs["expected"], runs["initial"])


def test_a_consolidation_says_how_much_it_has_read_and_when_it_writes(runs, tmp_path):
    """The offline command says this every 5 s (a large model's checkpoint takes minutes);
    here every tensor: the bytes add up to what the checkpoint saved."""
    from lightning_hetermoe.ckpt.consolidate import saved_bytes

    lines: list[str] = []
    source = f"{runs['zebra_dir']}/step=4.ckpt"
    consolidate(source, tmp_path / "whole.ckpt", progress_every_s=0.0, say=lines.append)
    total = saved_bytes(source)
    reads = [line for line in lines if " GB read " in line]
    assert len(reads) > 3 and reads[-1].startswith(f"[hetermoe] consolidate: {total / 1e9:,.2f} of {total / 1e9:,.2f} "
                                                   f"GB read (100%)"), lines
    assert lines[-1].startswith("[hetermoe] consolidate: read in ") and lines[-1].endswith(f"writing {tmp_path / 'whole.ckpt'}")


def test_a_checkpoint_missing_a_piece_file_is_named_incomplete_before_anything_is_read(runs, tmp_path, capsys):
    """A sharded checkpoint whose directory lacks a piece file its .metadata names (a rank
    that wrote elsewhere, a copy that left a file behind): the offline command said it in a
    page of DCP's traceback from deep in the read; now one line naming the file, no output
    written, and the same for the loader (and the strategy's resume, which reads the same meta)."""
    import shutil

    import lightning_hetermoe
    from lightning_hetermoe.ckpt.__main__ import main
    from lightning_hetermoe.ckpt.dcp import CheckpointFormatError

    copy_dir = tmp_path / "step=4.ckpt"
    shutil.copytree(runs["zebra_dir"] / "step=4.ckpt", copy_dir)
    pieces = sorted(p.name for p in copy_dir.glob("*.distcp"))
    assert len(pieces) == 2, pieces  # one per rank
    (copy_dir / pieces[1]).unlink()
    assert main(["consolidate", str(copy_dir), str(tmp_path / "whole.ckpt")]) == 2
    said = capsys.readouterr().err.strip()
    assert said == (f"[hetermoe] consolidate: {copy_dir} is incomplete: its .metadata names 1 piece file(s) that are "
                    f"not in it ({pieces[1]}): every rank writes its part into the checkpoint's directory, so a rank "
                    f"that wrote elsewhere (a disk of its node's own) or a copy that left files behind loses them; "
                    f"copy the checkpoint whole, or save it again on a file system every node sees"), said
    assert not (tmp_path / "whole.ckpt").exists()
    with pytest.raises(CheckpointFormatError, match=rf"is incomplete: .* \({re.escape(pieces[1])}\)"):
        lightning_hetermoe.load_checkpoint(copy_dir)
