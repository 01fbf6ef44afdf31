"""A resumed fit plans at the routing its checkpoint's last steps had: the load monitor's
history, read from the checkpoint (a file or a sharded directory) without its tensors,
becomes the strategy's ``expert_load`` before the set-up plans (the warm-up would sample a
fresh router: the checkpoint's weights are loaded after the strategy lays the model out)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers_recipe import compose
from lightning_hetermoe import ExpertLoadMonitor
from lightning_hetermoe.ckpt.loading import checkpoint_state
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.routing_record import RoutingRecord
from lightning_hetermoe.run_config import read_run_config
from lightning_hetermoe.training import resolve_ckpt_name, resumed_from, resumed_routing

KEY = ExpertLoadMonitor.__qualname__  # the callback's state key in Lightning's checkpoint dict


def _history(steps: int, layers: int = 2, experts: int = 4) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(steps)
    return torch.randint(0, 50, (steps, layers, experts), generator=g).tolist()


def _naive_shares(history: list[list[list[int]]]) -> list[list[float]]:
    layers, experts = len(history[0]), len(history[0][0])
    out = []
    for l in range(layers):
        total = [sum(step[l][e] for step in history) for e in range(experts)]
        out.append([t / sum(total) for t in total])
    return out


@pytest.mark.parametrize("steps, last, used", [(100, 64, slice(-64, None)), (10, 64, slice(1, None)),
                                               (1, 64, slice(0, None))])
def test_the_saved_routing_is_the_mean_share_of_the_last_recorded_steps(steps, last, used):
    """The newest ``last`` steps; a short history without its first step (a fresh router's),
    as the run's own record leaves it out; one step alone is that step."""
    history = _history(steps)
    record = ExpertLoadMonitor.saved_routing({"callbacks": {KEY: {"history": history}}}, "tiny", last=last)
    kept = history[used]
    assert record.steps == len(kept) and record.model == "tiny"
    assert torch.allclose(torch.tensor(record.mean_share), torch.tensor(_naive_shares(kept)), rtol=0, atol=1e-12)
    assert record.choices_per_step == pytest.approx(sum(sum(s[0]) for s in kept) / len(kept))
    assert record.source == f"the checkpoint's last {len(kept)} recorded steps"


@pytest.mark.parametrize("checkpoint", [{}, {"callbacks": {}}, {"callbacks": {KEY: {"history": []}}},
                                        {"callbacks": {KEY: {"history": [[[0, 0], [3, 1]], [[0, 0], [2, 2]]]}}}],
                         ids=["no callbacks", "no monitor", "no step", "a layer without a choice"])
def test_a_checkpoint_without_a_recorded_routing_gives_none(checkpoint):
    assert ExpertLoadMonitor.saved_routing(checkpoint, "tiny") is None


def test_a_checkpoint_file_is_read_without_its_tensors(tmp_path):
    """Memory-mapped: the callbacks come back, the tensors are not read into memory."""
    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"w": torch.arange(6.0)}, "callbacks": {KEY: {"history": [[[1, 2]]]}}}, path)
    state = checkpoint_state(path)
    assert state["callbacks"][KEY]["history"] == [[[1, 2]]]
    assert torch.equal(state["state_dict"]["w"], torch.arange(6.0))
    # its path is enough: the same record as from the dict
    assert ExpertLoadMonitor.saved_routing(path, "m") == ExpertLoadMonitor.saved_routing(state, "m")
    assert ExpertLoadMonitor.saved_routing(path, "m").mean_share == [[1 / 3, 2 / 3]]
    (tmp_path / "not.ckpt").write_text("{}")
    with pytest.raises(ConfigError, match=r"ckpt_path='.*not\.ckpt' is not a checkpoint"):
        checkpoint_state(tmp_path / "not.ckpt")


def _saved(tmp_path, history, name="x.ckpt"):
    path = tmp_path / name
    torch.save({"callbacks": {KEY: {"history": history}}}, path)
    return path


def test_the_main_job_resuming_plans_at_the_checkpoint_s_routing_unless_told_otherwise(tmp_path):
    """tiny has 2 MoE layers of 8 experts; the user's own strategy.expert_load wins, and
    resume_routing=false keeps the warm-up."""
    path = _saved(tmp_path, _history(5, 2, 8))
    got = resumed_routing(read_run_config(compose(f"ckpt_path={path}")))["expert_load"]
    assert torch.allclose(torch.tensor(got.mean_share), torch.tensor(_naive_shares(_history(5, 2, 8)[1:])))
    assert resumed_routing(read_run_config(compose(f"ckpt_path={path}", "resume_routing=false")))["expert_load"] is None
    mine = tmp_path / "mine.json"
    RoutingRecord(model="tiny", mean_share=[[1 / 8] * 8] * 2, steps=1, choices_per_step=1.0).to_json(str(mine))
    given = resumed_routing(read_run_config(compose(f"ckpt_path={path}", f"strategy.expert_load={mine}")))
    assert given["expert_load"] == str(mine)
    # another model's routing (4 experts a layer): not planned at; loading the checkpoint says what differs
    other = _saved(tmp_path, _history(5, 2, 4), "other.ckpt")
    assert resumed_routing(read_run_config(compose(f"ckpt_path={other}"))).get("expert_load") is None
    with pytest.raises(ConfigError, match=r"resume_routing='yes' is invalid: must be true .* or false"):
        read_run_config(compose(f"ckpt_path={path}", "resume_routing=yes"))


def test_ckpt_path_last_is_the_run_directory_s_own_save_first_and_planned_at_like_a_path(tmp_path):
    """The main job's ``ckpt_path=last``: what ``save_checkpoint`` wrote in this run directory
    (``last.ckpt`` for true or unset, its own name otherwise), resumed and planned at like a
    path given; where there is none, Lightning's to resolve (its checkpoint callbacks' last)."""
    def resolved(*overrides):
        cfg = compose(*overrides)
        return resolve_ckpt_name(read_run_config(cfg), cfg, tmp_path).ckpt_path

    assert resolved("ckpt_path=last", "save_checkpoint=true") == "last"  # nothing saved yet
    _saved(tmp_path, _history(5, 2, 8), "last.ckpt")
    assert resolved("ckpt_path=last", "save_checkpoint=true") == str(tmp_path / "last.ckpt")
    assert resolved("ckpt_path=last") == str(tmp_path / "last.ckpt")
    assert resolved("ckpt_path=last", "save_checkpoint=mine.ckpt") == "last"
    _saved(tmp_path, _history(3, 2, 8), "mine.ckpt")
    cfg = compose("ckpt_path=last", "save_checkpoint=mine.ckpt")
    run = resolve_ckpt_name(read_run_config(cfg), cfg, tmp_path)
    assert run.ckpt_path == str(tmp_path / "mine.ckpt")
    assert resumed_routing(run)["expert_load"].steps == 2  # its routing, as a path given would be
    # Lightning's SLURM requeue names its own saves in the run directory: none there is said at once
    with pytest.raises(ConfigError, match=r"ckpt_path='hpc' is invalid here: no hpc_ckpt_\*\.ckpt in the run dir"):
        resolved("ckpt_path=hpc")
    _saved(tmp_path, _history(3, 2, 8), "hpc_ckpt_1.ckpt")
    assert resolved("ckpt_path=hpc") == "hpc"  # Lightning's to resolve


def test_the_summary_says_which_checkpoint_loaded_or_that_a_name_found_none(tmp_path, capsys):
    own = tmp_path / "last.ckpt"
    assert resumed_from(None, None, own) == {}
    assert resumed_from("last", own, own) == {"resumed_from": str(own)}
    assert capsys.readouterr().out == ""
    got = resumed_from("last", None, own)
    assert got == {"resumed_from": None, "resume": "ckpt_path='last' named no checkpoint: trained from the start"}
    said = capsys.readouterr().out
    assert f"[hetermoe] ckpt_path='last' named no checkpoint (no {own} (save_checkpoint's)" in said
    assert said.rstrip().endswith("trained from the start")


@pytest.mark.slow
def test_a_resumed_fit_plans_and_predicts_at_the_routing_of_its_checkpoint(tmp_path):
    """Two real ranks: a fit saves a sharded checkpoint; the fit resumed from it plans at the
    routing its last steps had (the first run's own record: 3 steps after the first), with
    the experts placed at it, and prices its prediction there; what its own steps had is
    priced over its own timed steps."""
    from helpers_recipe import train_in_ranks

    quiet = ("trainer.limit_val_batches=0", "+trainer.num_sanity_val_steps=0", "final_validation=false",
             "cluster.time_scale=0.05", "strategy.checkpoint_format=sharded")
    train_in_ranks(2, tmp_path / "a", *quiet, "trainer.max_steps=4", "save_checkpoint=true")
    saved = RoutingRecord.from_json(str(tmp_path / "a" / "expert_load.json"))
    summary, printed = train_in_ranks(2, tmp_path / "b", *quiet, "trainer.max_steps=7",
                                      f"ckpt_path={tmp_path / 'a' / 'last.ckpt'}")
    assert "hetermoe: planning at the routing of the checkpoint's last 3 recorded steps (model 'tiny'" in printed
    assert summary["predicted_expert_load_max_over_mean"] == pytest.approx(saved.hottest_over_mean())
    assert summary["predicted_at_routing"] == "the checkpoint's last 3 recorded steps"
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["placed_at_load"] is True
    assert summary["resumed_from"].endswith("last.ckpt")
    # priced at the routing of its own timed steps (3 steps, the first the warm-up), not of the
    # steps before the resume, which the monitor's restored history holds too (6 of them)
    assert summary["steps"] == 7 and summary["timed_steps"] == 2
    assert len(summary["predicted_step_time_at_measured_load_by_step_s"]) == 2


@pytest.mark.slow
def test_a_checkpoint_callback_on_the_command_line_is_taken_and_its_last_is_what_last_resumes(tmp_path):
    """``+callbacks.ckpt._target_=...ModelCheckpoint`` (as conf/callbacks/default.yaml shows)
    turns the trainer's checkpointing on (``trainer.enable_checkpointing: null``; Lightning
    refused the callback beside the old ``false``), and a run in another directory with
    ``ckpt_path=last`` and no save of its own resumes from that callback's ``last.ckpt``,
    which its summary names."""
    from helpers_recipe import train_in_ranks

    ckpt = tmp_path / "ckpt"
    callback = ("+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint", "+callbacks.ckpt.save_last=true",
                f"+callbacks.ckpt.dirpath={ckpt}")
    job = ("cluster=cpu1", "trainer.limit_val_batches=1", "logger=none", "final_validation=false", *callback)
    first, _ = train_in_ranks(1, tmp_path / "first", *job, "trainer.max_steps=3")
    assert (ckpt / "last.ckpt").is_file() and "resumed_from" not in first, sorted(p.name for p in ckpt.iterdir())
    again, printed = train_in_ranks(1, tmp_path / "again", *job, "trainer.max_steps=5", "ckpt_path=last")
    assert again["resumed_from"] == str(ckpt / "last.ckpt") and again["steps"] == 5, again
    assert "named no checkpoint" not in printed
    # without a checkpoint callback the job keeps none of Lightning's own
    plain, _ = train_in_ranks(1, tmp_path / "plain", *job[:4], "trainer.max_steps=2")
    assert not list((tmp_path / "plain").rglob("*.ckpt")) and plain["steps"] == 2
