"""The main job's config read whole before Lightning and torch load (``run_config``): the
groups as checked dataclasses, and a model whose training state cannot fit the machine's
memory on CPU processes refused with the numbers."""

from __future__ import annotations

import pytest
from helpers_recipe import compose

from lightning_hetermoe import run_config
from lightning_hetermoe.configs import ConfigError, ModelConfig, OptimConfig
from lightning_hetermoe.profile.memory import MemoryModel


def test_the_default_job_reads_into_checked_groups_with_a_process_per_device():
    run = run_config.read_run_config(compose())
    assert run.model.name == "tiny" and run.cluster.name == "emu_a40_v100_d1_8k"
    assert run.trainer["devices"] == run.cluster.world_size == 2 and run.trainer["accelerator"] == "cpu"
    assert set(run.strategy) <= set(run_config.STRATEGY_FIELDS) and run.init_on_meta is False


@pytest.mark.parametrize("optim, precision, nodes, per_param", [
    (OptimConfig(), "32-true", 1, 16),  # fp32 weight and gradient, AdamW's two fp32 moments
    (OptimConfig(name="sgd", momentum=0.0), "32-true", 1, 8),  # no optimizer state
    (OptimConfig(), "bf16-true", 1, 8),  # every tensor at 2 bytes
    (OptimConfig(), "bf16", 1, 16),  # Lightning's alias of bf16-mixed: fp32 weights, as 32-true
    (OptimConfig(), "32-true", 4, 4),  # four machines share it
])
def test_a_model_is_refused_on_cpu_exactly_where_its_state_passes_the_available_memory(monkeypatch, optim, precision,
                                                                                        nodes, per_param):
    model = ModelConfig()
    need = MemoryModel(model).model_params() * per_param
    trainer = {"accelerator": "cpu", "precision": precision, "num_nodes": nodes}
    monkeypatch.setattr(run_config, "available_host_bytes", lambda: need)
    run_config.check_host_memory(model, optim, trainer)  # fits, just
    monkeypatch.setattr(run_config, "available_host_bytes", lambda: need * 0.999)
    with pytest.raises(ConfigError, match=rf"model 'tiny' does not fit this machine's memory: trainer.accelerator=cpu "
                                          rf"keeps .* {per_param * nodes:g} bytes a parameter"):
        run_config.check_host_memory(model, optim, trainer)
    monkeypatch.setattr(run_config, "available_host_bytes", lambda: None)  # the system does not say: no judgement
    run_config.check_host_memory(model, optim, trainer)


def test_the_available_memory_is_read_where_the_system_says_it():
    import os

    available = run_config.available_host_bytes()
    if not os.path.exists("/proc/meminfo"):
        assert available is None
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < available <= total


@pytest.mark.parametrize("field, valid", [("router", "ROUTERS"), ("activation", "ACTIVATIONS"),
                                          ("expert_backend", "EXPERT_BACKENDS")])
def test_the_default_model_config_names_every_value_a_choice_field_takes(field, valid):
    """The default model's YAML is where a user reads what a field takes: its comment names
    each value the config accepts, so a router or backend added in code is not missing
    there."""
    import re
    from pathlib import Path

    from lightning_hetermoe import configs

    text = (Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny.yaml").read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{field}:"))
    comment = line.partition("#")[2]
    named = set(re.findall(r"[a-z_]+", comment))
    assert set(getattr(configs, valid)) <= named, (line, getattr(configs, valid))
