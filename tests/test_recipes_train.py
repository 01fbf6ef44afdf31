"""The main job end to end, in subprocesses, as a user runs it (including a multirun sweep)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_script
import torch

from helpers_exit import EXIT_S, run_to_exit
from helpers_recipe import compose
from lightning_hetermoe.emulate import FAITHFUL_SLIP

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"first_loss", "final_loss", "val_loss", "tokens_per_s", "strategy", "cluster", "world_size", "steps"}


def run_recipe(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = warm_script.run([sys.executable, str(ROOT / "recipes" / "train.py"), *args], cwd=ROOT, env=env,
                           timeout=timeout)
    return proc


@pytest.mark.slow
def test_main_job_trains_zebra_on_the_emulated_mix_and_tracks_the_simulator(tmp_path):
    # README's main job, timed to its exit too (issue #38: every entry point exits within
    # seconds of its work ending; the output is stdout and stderr together)
    code, out, exit_after_s = run_to_exit([sys.executable, str(ROOT / "recipes" / "train.py"), "trainer.max_steps=12",
                                           "trainer.limit_val_batches=2", f"hydra.run.dir={tmp_path}"],
                                          "[hetermoe] wrote ", cwd=ROOT)
    assert code == 0, out[-3000:]
    assert exit_after_s < EXIT_S and "terminate called" not in out, (exit_after_s, out[-2000:])
    assert "LeafSpec" not in out, "Lightning's deprecation noise under torch 2.13 is filtered"
    assert "Tip:" not in out and "GPU available: False" in out, "Lightning's advert is muted, its facts are not"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["strategy"] == "hetermoe:zebra" and summary["cluster"] == "emu_a40_v100_d1_8k"
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    assert summary["tokens_per_s"] > 0 and summary["workload_tokens_per_s"] > summary["tokens_per_s"]
    assert "HeterMoE plan: model d1 on cluster emu_a40_v100_d1_8k" in out, "the plan is printed"
    # and at the end, how the step kept to that prediction (test_prediction_verdict.py)
    verdict = next(line for line in out.splitlines() if line.startswith("[hetermoe] prediction: "))
    assert f"{summary['step_time_s']:.4g} s measured, {summary['predicted_step_time_s']:.4g} s predicted" in verdict
    assert summary["predicted_at_routing"] == "the initial routers' on sampled batches"
    # output is not a terminal here: a progress line instead of a redrawn bar
    assert "[hetermoe] step 10/12, train_loss" in out and "it/s]" not in out
    assert (tmp_path / "plan.json").is_file()
    # the routing its steps had, for a plan at it (recipes/plan.py plan.expert_load=...)
    routing = json.loads((tmp_path / "expert_load.json").read_text())
    assert routing["model"] == "tiny" and routing["steps"] == 11
    assert [len(layer) for layer in routing["mean_share"]] == [8, 8]
    # The emulated clock is honest about itself, and the real executor keeps to the
    # simulator's step time for the same plan (loose: CI machines are noisy).
    emulation = summary["emulation"]
    assert emulation["padded_tasks"] > 0 and 0 <= emulation["overrun_fraction"] <= 1
    assert emulation["faithful"] == (emulation["slip_fraction"] <= FAITHFUL_SLIP) and emulation["slip_fraction"] >= 0
    assert ("warning" in emulation) != emulation["faithful"]
    assert abs(summary["step_time_rel_error"]) < 0.25, summary
    # every rank's memory prediction counts what its experts keep for their backward: each
    # routed row of its ZP group's tokens (all in flight under zebra) leaves the row, the
    # answer and SwiGLU's gate and up, in fp32 here; a rank without experts keeps none
    import yaml

    plan = json.loads((tmp_path / "plan.json").read_text())
    tiny = yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text())
    seq_len = yaml.safe_load((ROOT / "conf" / "data" / "pydoc.yaml").read_text())["seq_len"]
    moe, (group,) = tiny["moe"], plan["zp_groups"]
    members = group["attention_ranks"] + group["expert_ranks"]
    rows = sum(plan["seqs_per_rank"][r] for r in group["attention_ranks"]) * seq_len * moe["top_k"] / moe["num_experts"]
    for report in summary["memory"]["ranks"]:
        held = sum(members[q] == report["rank"] for layer in plan["placement"] for q in layer)
        want = held * rows * (2 * tiny["d_model"] + 2 * moe["d_ff"]) * 4 / 1e9
        assert report["predicted"]["expert_rows"] == pytest.approx(want, rel=1e-6), (report, held)
    assert max(report["predicted"]["expert_rows"] for report in summary["memory"]["ranks"]) > 0


@pytest.mark.slow
def test_multirun_sweep_runs_each_job_once_and_a_refused_job_is_a_row(tmp_path):
    """The default mode works on one CPU and on an emulated GPU mix (auto picks what each can
    run; two CPUs are the failure tests' cluster), and each child re-runs its own job, not the
    whole sweep (Lightning's default). A job whose config is refused (``strategy.mode=zebar``)
    is refused before any process starts and is a row saying why; the sweep goes on to the
    next (it once ended the whole sweep, the valid jobs never run, no table)."""
    proc = run_recipe("-m", "cluster=cpu1,emu_a40_v100_d1_4k", "strategy.mode=zebar,auto", "trainer.max_steps=3",
                      "trainer.limit_val_batches=1", "logger=[csv,tensorboard]", "trainer.log_every_n_steps=2",
                      "callbacks.load_monitor.log_every_n_steps=2", f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # jobs in Hydra's order, the last override varying fastest: 0 and 2 refused, 1 and 3 trained
    assert proc.stderr.count("[hetermoe] config error: strategy mode='zebar' is invalid") == 2, proc.stderr[-3000:]
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1", "2", "3"], summaries
    got = [json.loads(p.read_text()) for p in summaries]
    assert all(got[j]["error"].startswith("config error: strategy mode='zebar'") for j in (0, 2)), got
    trained = [got[1], got[3]]
    assert not any("error" in s for s in trained)
    assert [(s["cluster"], s["world_size"]) for s in trained] == [("cpu1", 1), ("emu_a40_v100_d1_4k", 2)]
    assert trained[0]["strategy"] == "hetermoe:single" and all(s["mode"] == "auto" for s in trained)
    assert proc.stdout.count("hetermoe[auto]: chose") == 1, "the two-rank job prints its choice and runner-up"
    # A re-run sweep would start extra jobs: Hydra prints one "Launching" line per job.
    assert all(proc.stdout.count(f"#{j} :") == 1 for j in range(4)), proc.stdout[-2000:]
    # ... and the sweep ends as one result: a table row per job, and a plot
    rows = list(csv.DictReader(open(tmp_path / "sweep_summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert all(rows[j]["status"].startswith("config error: strategy mode='zebar' is invalid") for j in (0, 2)), rows
    assert all(rows[j]["status"] == "ok" and float(rows[j]["tokens_per_s"]) > 0 for j in (1, 3)), rows
    assert "cluster=cpu1" in rows[1]["overrides"] and "cluster=emu_a40_v100_d1_4k" in rows[3]["overrides"]
    assert (tmp_path / "sweep_summary.md").read_text().count("\n") == 6  # header, rule, four rows
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    # every job's metrics reach both loggers (job 3: two ranks, the schedule auto chose)
    metrics = next((tmp_path / "3").glob("logs/version_*/metrics.csv"))
    logged = list(csv.DictReader(open(metrics)))
    columns = set(logged[0])
    for name in ("train_loss", "perf/tokens_per_s", "perf/step_time_s", "moe_load/max_over_mean",
                 "moe_load/layer0_max_over_mean", "grad_norm"):
        assert name in columns, sorted(columns)
    assert any(r["train_loss"] for r in logged) and any(r["perf/tokens_per_s"] for r in logged)
    assert all(float(r["grad_norm"]) > 0 for r in logged if r["grad_norm"])  # the global norm, every 2 steps
    events = list((tmp_path / "3").glob("tensorboard/version_*/events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 500, "TensorBoard event file with the metrics"


def test_a_launch_outside_hydra_asks_whether_hydra_runs_without_importing_it(monkeypatch):
    """Every fit, validate and test asks; a run without Hydra (a plain script, each of the
    tests' ranks) imported Hydra's 150 modules to hear no. A Hydra job has it imported
    already, and the multirun test above covers that side."""
    from lightning_hetermoe.strategy import launchers

    for name in [m for m in sys.modules if m == "hydra" or m.startswith("hydra.")]:
        monkeypatch.delitem(sys.modules, name)
    assert launchers._hydra_in_use() is False
    assert not [m for m in sys.modules if m == "hydra" or m.startswith("hydra.")]


@pytest.mark.parametrize("overrides,message", [
    (["model.moe.top_k=9"], "model.moe.top_k=9 is invalid: must be in [1, num_experts=8]"),
    (["model.d_model=30"], "model.d_model=30 is invalid"),
    (["strategy.mode=bogus"], "mode='bogus' is invalid"),
    (["model.moe.router=hash"], "model.moe.router='hash' is invalid"),
    (["data.seq_len=512"], "data.seq_len=512 is invalid"),
    (["+strategy.ep_size=2"], "strategy: unknown field(s) ['ep_size']"),
    (["trainer.devices=3"], "cluster 'emu_a40_v100_d1_8k' names 2 devices"),
    (["cluster.devices=[cpu,foo]"], "cluster.devices[1]='foo' is invalid: unknown device 'foo'"),
    (["cluster.devices=[mygpu,cpu]", "+cluster.custom_devices={mygpu:{memory_gb:24}}"],
     "cluster.custom_devices.mygpu: missing field(s) ['fp16_tflops', 'mem_bw_gbps', 'flash_attention']"),
    (["cluster.devices=[mygpu,cpu]", "+cluster.custom_devices={mygpu:{base:a40,memory_gbs:24}}"],
     "cluster.custom_devices.mygpu: unknown field(s) ['memory_gbs']"),
    (["model.moe.expert_backend=triton"], "model.moe.expert_backend='triton' cannot run on cpu"),
    (["data.corpus=wikipedia"], "data.corpus='wikipedia' is invalid: must be one of ('pydoc_topics', 'tokenized')"),
    (["data=tokenized", "data.path=/nonexistent/corpus"], "data.path='/nonexistent/corpus' is invalid: no such directory"),
    (["data.path=/some/dir"], "data.path='/some/dir' is invalid: is read only with data.corpus=tokenized"),
    (["data.num_workers=-1"], "data.num_workers=-1 is invalid: must be an integer >= 0"),
    (["trainer.max_steps=1.5"], "trainer.max_steps=1.5 is invalid: must be an integer"),
    (["+model.d_modle=32"], "model: unknown field(s) ['d_modle']"),
    (["trainer.precision=fp77"], "trainer: Precision 'fp77' is invalid. Allowed precision values:"),
    (["trainer.val_check_interval=-3"], "trainer: You have passed invalid value -3 for val_check_interval"),
    pytest.param(["trainer.accelerator=gpu"], "trainer.accelerator='gpu' is invalid here: torch sees no GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (["model=mixtral_8x7b"], "model 'mixtral_8x7b' does not fit this machine's memory: trainer.accelerator=cpu"),
    (["ckpt_path=/no/such.ckpt"], "ckpt_path='/no/such.ckpt' is invalid: no such file or directory"),
])
def test_bad_config_is_rejected_naming_the_field(tmp_path, overrides, message):
    """Rejected in the launching process (``train`` here), before any rank exists."""
    from lightning_hetermoe.configs import ConfigError
    from lightning_hetermoe.training import train

    with pytest.raises(ConfigError) as err:
        train(compose(*overrides), tmp_path)
    assert message in str(err.value)
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_bad_config_on_the_command_line_is_one_line_before_any_process_starts(tmp_path):
    proc = run_recipe("cluster.devices=[cpu,foo]", f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["[hetermoe] config error: cluster.devices[1]='foo' is invalid: unknown device 'foo'; known "
                     "devices: a10, a100, a100_40gb, a10g, a40, b200, cpu, h100, h200, l4, l40s, mi250x, mi300x, "
                     "rtx4090, rtx6000_ada, rtx_a6000, t4, v100 (define others under cluster.custom_devices)"], proc.stderr
    assert "Initializing distributed" not in proc.stderr + proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("override, named", [
    ("strategy.mode=zebar", "strategy mode='zebar' is invalid"),
    ("trainer.max_steps=1.5", "trainer.max_steps=1.5 is invalid: must be an integer"),
    ("strategy.plan=no_such_plan.json", "no such file"),
    ("init_on_meta=maybe", "init_on_meta='maybe' is invalid"),
    ("model=mixtral_8x7b", "need at least 747 GB"),
    ("trainer.devices=3", "cluster 'emu_a40_v100_d1_8k' names 2 devices but the trainer runs 3 processes"),
    ("strategy.mode=ep strategy.expert_parallel_size=3", "expert_parallel_size=3 is invalid: must divide the world"),
])
def test_a_config_error_is_named_before_lightning_or_torch_is_imported(tmp_path, override, named):
    """Every config group is read and checked before the run loads Lightning and torch
    (seconds): ``-X importtime`` lists each module the process imported, on stderr."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "recipes" / "train.py"), *override.split(),
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "lightning_hetermoe.run_config" in imported and not imported & {"torch", "lightning"}, \
        sorted(imported & {"torch", "lightning"})
    errors = [line for line in lines if line.startswith("[hetermoe] config error:")]
    assert len(errors) == 1 and named in errors[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_torchrun_launches_the_ranks_and_the_pack_spawns_none(tmp_path):
    """``torchrun --nproc_per_node=2 recipes/train.py``: Lightning's TorchElastic environment
    sees processes that already exist; the strategy's launcher must not start more."""
    from harness import free_port

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "recipes" / "train.py"), "cluster=cpu2", "strategy.mode=ep", "trainer.max_steps=3",
           "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    # two ranks, each started by torchrun: exactly two "Initializing distributed" lines, no third process
    assert (proc.stdout + proc.stderr).count("Initializing distributed:") == 2


