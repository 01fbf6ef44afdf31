"""recipes/plan.py and recipes/paper.py run end to end and write their files."""

import csv
import json
import os
import sys

from lightning_hetermoe.plan import Plan
import pytest
import warm_script

# every test here starts processes: each forked from the tests' fork server (warm_script),
# which imported torch and Lightning once, where a new interpreter spent seconds on them
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, cwd=ROOT):
    proc = warm_script.run([sys.executable, *args], cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_plan_recipe_writes_plan_summary_and_gantt(tmp_path):
    # run from another directory: the recipe finds ../conf relative to itself
    out = run(
        [
            os.path.join(ROOT, "recipes/plan.py"),
            "model=d2",
            "cluster=o3",
            "data.seq_len=8192",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert "HeterMoE plan" in out and "ep_ideal" in out
    plan = Plan.from_json(str(tmp_path / "plan.json"))
    assert plan.seq_len == 8192 and plan.world_size == 9 and plan.model == "d2"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["schedules"]) == {"zebra", "distep", "ep", "ep_balanced", "ep_ideal", "datacentric"}
    zebra = summary["schedules"]["zebra"]
    assert (
        zebra["tokens_per_s"] > 0
        and abs(zebra["tokens_per_s"] - plan.predicted["zebra"]["tokens_per_s"]) < 1e-6 * zebra["tokens_per_s"]
    )
    runnable = {k: v["tokens_per_s"] for k, v in summary["schedules"].items() if k != "ep_ideal" and "error" not in v}
    assert summary["fastest_predicted"] == max(runnable, key=runnable.get)
    png = tmp_path / "gantt_zebra.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_paper_recipe_writes_table(tmp_path):
    out = run(
        [
            "recipes/paper.py",
            "clusters=[o3]",
            "models=[d2]",
            "seq_lens=[16384]",  # one length: 4K adds two thirds of the run
            "workers=1",
            "utilization.cluster=o3",
            "utilization.seq_len=4096",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert "HeterMoE / EP" in out
    with open(tmp_path / "paper_table.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["cluster", "model", "seq_len", "schedule", "tokens_per_s"]
    assert {r["schedule"] for r in rows} == {"zebra", "distep", "ep", "ep_balanced", "ep_ideal"}
    assert {r["cluster"] for r in rows} == {"o3", "a40x2_v100x2", "a40x4"}
    assert {r["model"] for r in rows} == {"d2", "d1_8e"}
    tps = {(r["cluster"], r["seq_len"], r["schedule"]): float(r["tokens_per_s"]) for r in rows}
    assert tps[("o3", "16384", "zebra")] > tps[("o3", "16384", "distep")]
    md = (tmp_path / "paper_table.md").read_text()
    assert "| claim | paper |" in md and "1.67x" in md and "Asym-EA" in md


def test_a_mix_the_model_does_not_fit_is_one_line_alone_and_a_row_in_a_sweep(tmp_path):
    """A plan the planner refuses: a run alone exits 1 with the planner's reason on one line
    (no stack trace) and a summary.json that says it; a sweep over mixes goes on and its
    table has the refused mix's row with that reason beside the others'."""
    proc = warm_script.run([sys.executable, "recipes/plan.py", "model=mixtral_8x7b", "cluster=o3",
                            f"hydra.run.dir={tmp_path / 'alone'}"], cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[plan] no plan for mixtral_8x7b on o3: experts exceed total memory"), last
    summary = json.loads((tmp_path / "alone" / "summary.json").read_text())
    assert summary["error"] in last and summary["schedules"] == {} and not (tmp_path / "alone" / "plan.json").exists()

    bad = warm_script.run([sys.executable, "recipes/plan.py", "precision=fp8", f"hydra.run.dir={tmp_path / 'bad'}"],
                          cwd=ROOT, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("[plan] config error: precision='fp8' is invalid")

    run(["recipes/plan.py", "-m", "model=d2,mixtral_8x7b", "cluster=o3", "data.seq_len=8192", "plan.gantt=[]",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    fitted = [r for r in rows if "model=d2" in r["overrides"]]
    refused = [r for r in rows if "model=mixtral_8x7b" in r["overrides"]]
    assert fitted and all(r["status"] == "ok" for r in fitted if r["schedule"] == "zebra"), fitted
    assert len(refused) == 1 and refused[0]["status"].startswith("no plan for mixtral_8x7b on o3: experts exceed"), \
        refused
    assert refused[0]["cluster"] == "o3"


@pytest.mark.slow
@pytest.mark.parametrize("recipe, override, line", [
    ("plan.py", "data.seq_len=0", "[plan] config error: data.seq_len=0 is invalid: must be in [1, model.max_seq_len="),
    ("plan.py", "data.global_batch_tokens=5", "[plan] config error: data.global_batch_tokens=5 is invalid: must be "
                                              "at least one sequence"),
    ("profile_devices.py", "cluster=o1", "[profile] config error: profile: cannot measure ['a40', 'v100'] from this "
                                         "process (it has 'cpu')"),
])
def test_a_bad_shape_or_a_cluster_this_process_cannot_measure_is_one_line(tmp_path, recipe, override, line):
    if recipe == "profile_devices.py" and torch_sees_a_gpu():
        pytest.skip("this machine has a GPU: the process measures what it has")
    proc = warm_script.run([sys.executable, f"recipes/{recipe}", override, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                           timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-1000:]


def torch_sees_a_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
