"""A run's routing kept as a file (``expert_load.json``, the load monitor's) and a plan made
at it (``recipes/plan.py plan.expert_load=...``)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import warm_script

from lightning_hetermoe import ExpertLoadMonitor
from lightning_hetermoe.configs import ConfigError, ModelConfig, from_cfg
from lightning_hetermoe.plan import Plan
from lightning_hetermoe.routing_record import FILE_NAME, RoutingRecord, read_routing
from reference import SEQ, data, make_model

ROOT = Path(__file__).resolve().parents[1]


def test_a_fit_writes_the_routing_its_steps_had_and_it_reads_back_for_the_same_model_shape(tmp_path):
    monitor = ExpertLoadMonitor(output_dir=str(tmp_path))
    model = make_model(4)
    with mock.patch.dict(os.environ):
        L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  num_sanity_val_steps=0, callbacks=[monitor]).fit(model, datamodule=data(1))
    record = read_routing(tmp_path / FILE_NAME, model.model_cfg, "plan.expert_load")
    assert record.steps == 3, "the steps after the first"
    assert record.mean_share == monitor.mean_share(1) and record.shape == (model.model_cfg.n_layers, 4)
    # every choice of the global batch (8 sequences), in every layer
    assert record.choices_per_step == 8 * SEQ * model.model_cfg.moe.top_k
    hottest = [max(row) * 4 for row in monitor.mean_share(1)]
    assert record.hottest_over_mean() == pytest.approx(max(hottest)) and min(hottest) >= 1.0
    # a model of another shape is refused, both shapes named
    other = replace(model.model_cfg, moe=replace(model.model_cfg.moe, num_experts=8))
    with pytest.raises(ConfigError, match=r"plan\.expert_load=.* holds 2 layers x 4 experts .* has 2 x 8"):
        read_routing(tmp_path / FILE_NAME, other, "plan.expert_load")


def test_what_is_not_a_routing_record_is_refused_naming_the_field(tmp_path):
    model = from_cfg(ModelConfig, {"n_layers": 1, "moe": {"num_experts": 2}})
    with pytest.raises(ConfigError, match=r"plan\.expert_load='.*nowhere\.json': no such file"):
        read_routing(tmp_path / "nowhere.json", model, "plan.expert_load")
    bad = tmp_path / "bad.json"
    for text, why in (("{}", "model"), (json.dumps({"model": "m", "mean_share": [[0.7, 0.7]], "steps": 1,
                                                     "choices_per_step": 2.0}), "summing to 1"),
                      (json.dumps({"model": "m", "mean_share": [[1.0], [0.5, 0.5]], "steps": 1,
                                   "choices_per_step": 2.0}), "every row as long")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"plan\.expert_load=.* is not a routing record .*{why}"):
            read_routing(bad, model, "plan.expert_load")


@pytest.mark.slow
def test_the_plan_recipe_prices_a_routing_record_instead_of_even_routing(tmp_path):
    """d2 on o3 at even routing and at a record whose layers send a third of their choices to
    one expert: the same recipe predicts zebra slower at the skewed routing, and says why; it
    places the experts at the record (which expert goes where), faster than id order there."""
    model = from_cfg(ModelConfig, _yaml("model/d2.yaml"))
    E, layers = model.moe.num_experts, model.n_layers
    hot = 1 / 3
    share = [[hot] + [(1 - hot) / (E - 1)] * (E - 1) for _ in range(layers)]
    record = tmp_path / FILE_NAME
    RoutingRecord(model="d2", mean_share=share, steps=10, choices_per_step=1e6).to_json(str(record))
    # one sweep, one process (each recipe process spends seconds importing): even routing,
    # the record placed at, the record in id order (and even in id order, which is not read)
    sweep = tmp_path / "sweep"
    proc = warm_script.run([sys.executable, str(ROOT / "recipes" / "plan.py"), "-m", "model=d2", "cluster=o3",
                            "data.seq_len=8192", "plan.gantt=[]", f"plan.expert_load=null,{record}",
                            "plan.place_at_load=true,false", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = {}
    for job in sweep.iterdir():
        if (job / "summary.json").exists():
            overrides = (job / ".hydra" / "overrides.yaml").read_text()
            skewed, placed = "expert_load=null" not in overrides, "place_at_load=true" in overrides.lower()
            jobs[(skewed, placed)] = job
    assert len(jobs) == 4, sorted(jobs)
    names = {"even": (False, True), "skewed": (True, True), "id_order": (True, False)}
    summaries = {n: json.loads((jobs[k] / "summary.json").read_text()) for n, k in names.items()}
    assert f"the hottest expert {hot * E:.2f}x the mean" in proc.stdout
    assert summaries["even"]["expert_load"] is None
    assert summaries["skewed"]["expert_load"]["hottest_over_mean"] == pytest.approx(hot * E)
    even, skewed, by_id = (summaries[n]["schedules"]["zebra"]["tokens_per_s"] for n in ("even", "skewed", "id_order"))
    assert skewed < even, (skewed, even)
    plans = {n: Plan.from_json(str(jobs[names[n]] / "plan.json")) for n in ("skewed", "id_order")}
    assert plans["skewed"].placed_at_load and not plans["id_order"].placed_at_load
    assert skewed >= by_id, (skewed, by_id)
    # the sweep ends as one table: a row per job and schedule (a plan sweep measures nothing)
    import csv

    rows = list(csv.DictReader(open(sweep / "sweep_summary.csv")))
    assert {r["job"] for r in rows} == {"0", "1", "2", "3"}
    assert {r["schedule"] for r in rows} == {"zebra", "distep", "ep", "ep_balanced", "ep_ideal", "datacentric"}
    assert all(float(r["predicted_tokens_per_s"]) > 0 and not r["tokens_per_s"] for r in rows if r["status"] == "ok")
    assert (sweep / "sweep.png").stat().st_size > 1000 and (sweep / "sweep_summary.md").is_file()


def _yaml(rel: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / rel), resolve=True)
