"""Memory is a budget: each rank's state priced per mode (sharded optimizer state included),
a mode that cannot fit refused before launch with what would fit, and a rank that passes its
device's budget (``cluster.memory_scale``) at run time stopped with its name and what it held."""

from __future__ import annotations

import re

import pytest

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy
from lightning_hetermoe.cluster import get_device
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.profile.memory import MemoryModel, RankMemory, spread_memory
from lightning_hetermoe.strategy.memory_watch import MemoryBudgetError
from reference import data, make_model, trainer


def test_rank_state_prices_sharded_optimizer_state_and_memory_proportional_shares():
    plain = RankMemory.of(dense_params=100, expert_params=50)
    sharded = RankMemory.of(dense_params=100, expert_params=50, dense_shards=4)
    assert plain.state == 150 * 16 and sharded.optimizer == (25 + 50) * 8
    cfg = make_model(8).model_cfg
    a40, v100 = get_device("a40"), get_device("v100")
    dc = spread_memory(cfg, "datacentric", [a40, v100])
    experts = [m.weights / 4 - MemoryModel(cfg).attention_stack_params() for m in dc]
    assert experts[0] / experts[1] == pytest.approx(a40.memory_gb / v100.memory_gb)
    ep = spread_memory(cfg, "ep", [a40, v100], shard_optimizer_state=False)
    ep_sharded = spread_memory(cfg, "ep", [a40, v100])
    dense = MemoryModel(cfg).attention_stack_params()
    assert ep[0].optimizer - ep_sharded[0].optimizer == pytest.approx(dense * 8 / 2)


def test_a_mode_that_cannot_fit_is_refused_before_launch_with_what_would_fit():
    cluster = {"name": "small", "devices": ["cpu", "cpu"], "memory_scale": 2e-6}
    t = trainer(HeterMoEStrategy(mode="ep", cluster=cluster), 2)
    with pytest.raises(ConfigError, match=r"mode='ep' does not fit: rank \d \(cpu.*What would fit.*such devices"):
        t.fit(make_model(4), datamodule=data(2))


def fit_over_budget(rank: int) -> str:
    # one process: 16 GB x 1e-5 = 160 kB for a model whose state alone is ~240 kB
    cluster = {"name": "tiny", "devices": ["cpu"], "memory_scale": 1e-5}
    t = trainer(HeterMoEStrategy(cluster=cluster), 1, max_steps=2)
    try:
        t.fit(make_model(4), datamodule=data(1))
    except MemoryBudgetError as err:
        assert t.strategy.memory.budget == pytest.approx(16e9 * 1e-5)
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_rank_past_its_budget_ends_the_run_naming_it_and_what_it_held():
    (message,) = run_ranks(1, fit_over_budget)  # its own process: a failed fit leaves a process group behind
    assert re.search(r"rank 0 \(single device cpu\) used .* over its budget of 160 kB \(memory_scale 1e-05\); it "
                     r"held weights .*optimizer state", message), message
