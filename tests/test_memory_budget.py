"""Memory is a budget: each rank's state priced per mode (sharded optimizer state included),
a mode that cannot fit refused before launch with what would fit, and a rank that passes its
device's budget (``cluster.memory_scale``) at run time stopped with its name and what it held."""

from __future__ import annotations

import dataclasses
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


def test_the_zebra_gradient_sync_is_priced_at_one_bucket_beside_the_state():
    """Zebra sums its dense gradients through one reused buffer of at most one bucket: the
    memory model adds that bucket to an attention rank (or the whole dense part where it is
    smaller), not the dense gradients' size, and never counts it as activations."""
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.profile.memory import GRAD_BUCKET_BYTES, activation_bytes, working_bytes
    from lightning_hetermoe.strategy.backends.zebra import backend as zebra_backend

    assert zebra_backend.BUCKET_BYTES == GRAD_BUCKET_BYTES  # the size the strategy syncs in is the one priced
    small = dataclasses.replace(make_model(4).model_cfg, activation_checkpointing=True)
    large = ModelConfig(d_model=2048, n_layers=4, moe=MoEConfig(num_experts=4), activation_checkpointing=True)
    for cfg in (small, large):  # checkpointed: the activations are what attention_bytes counts beside the state
        mem = MemoryModel(cfg)
        dense_grads = mem.attention_stack_params() * 4
        assert mem.grad_sync_bytes() == min(GRAD_BUCKET_BYTES, dense_grads) > 0
        state = mem.attention_stack_params() * mem.bytes_per_param
        act = activation_bytes(cfg, tokens_in_flight=64, mb_tokens=32, act_bytes=2)
        assert mem.attention_bytes(tokens_in_flight=64, mb_tokens=32) == pytest.approx(
            state + mem.grad_sync_bytes() + act)
    assert MemoryModel(large).grad_sync_bytes() == GRAD_BUCKET_BYTES < MemoryModel(large).attention_stack_params() * 4
    for mode, want in (("zebra", GRAD_BUCKET_BYTES), ("distep", GRAD_BUCKET_BYTES), ("ep", 10 ** 9), ("single", 0)):
        assert working_bytes(mode, layer_expert_bytes=0, local_layer_expert_bytes=0, dense_bytes=10 ** 9) == want, mode
    assert working_bytes("zebra", layer_expert_bytes=0, local_layer_expert_bytes=0, dense_bytes=1000) == 1000
