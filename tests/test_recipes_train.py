"""The main job end to end, in subprocesses, as a user runs it (including a multirun sweep)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"first_loss", "final_loss", "val_loss", "tokens_per_s", "strategy", "cluster", "world_size", "steps"}


def run_recipe(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def test_main_job_runs_and_writes_summary(tmp_path):
    proc = run_recipe("trainer.max_steps=12", "trainer.limit_val_batches=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["strategy"] == "hetermoe:ep" and summary["cluster"] == "cpu2"
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    assert summary["tokens_per_s"] > 0


def test_multirun_sweep_runs_each_job_once(tmp_path):
    """Each child must re-run its own job, not the whole sweep (Lightning's default)."""
    proc = run_recipe("-m", "cluster=cpu1,cpu2", "trainer.max_steps=3", "trainer.limit_val_batches=1",
                      f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1"], summaries
    got = [json.loads(p.read_text()) for p in summaries]
    assert [(s["cluster"], s["world_size"]) for s in got] == [("cpu1", 1), ("cpu2", 2)]
    # A re-run sweep would start extra jobs: Hydra prints one "Launching" line per job.
    assert proc.stdout.count("#0 :") == 1 and proc.stdout.count("#1 :") == 1, proc.stdout[-2000:]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("override,field", [
    ("model.moe.top_k=9", "moe.top_k"),
    ("model.d_model=30", "model.d_model"),
    ("strategy.mode=bogus", "mode='bogus'"),
    ("model.moe.router=hash", "moe.router"),
    ("data.seq_len=512", "data.seq_len"),
    ("+strategy.ep_size=2", "ep_size"),
    ("trainer.devices=3", "cluster 'cpu2' names 2 devices"),
])
def test_bad_config_is_rejected_naming_the_field(tmp_path, override, field):
    from lightning_hetermoe.training import train

    with pytest.raises(ValueError) as err:
        train(compose(override), tmp_path)
    assert field in str(err.value)
    assert not (tmp_path / "summary.json").exists()


def test_bad_config_on_the_command_line_fails_before_any_process_starts(tmp_path):
    proc = run_recipe("model.moe.top_k=9", f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode != 0
    assert "moe.top_k=9 is invalid" in proc.stderr
    assert "Initializing distributed" not in proc.stderr + proc.stdout
