"""What the strategy decides at set-up: the routing the predictions assume is the one the
freshly initialised routers give sampled warm-up batches (the planner places experts at
half of them pooled, predictions average the step over the other half), measured without
disturbing training."""

from __future__ import annotations

import copy
import os

import torch

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, MoELayer, OptimConfig
from reference import assert_same_params, data, make_model, reference_fit, trainer
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 3


def fit_predicted(rank: int, world: int) -> dict:
    from lightning_hetermoe import ExpertLoadMonitor
    from lightning_hetermoe.training import timing_summary

    model = make_model(4, seed=rank, optim=OptimConfig())
    strategy = HeterMoEStrategy(mode="ep", cluster={"name": "two", "devices": ["a40", "v100"]})
    monitor = ExpertLoadMonitor(plots=False)
    first = next(m for m in model.modules() if isinstance(m, MoELayer))
    calls = []  # (training, tokens) of every forward of the first MoE layer on this rank
    first.register_forward_pre_hook(lambda mod, args: calls.append((mod.training, args[0].shape[:-1].numel())))
    trainer(strategy, world, max_steps=STEPS, callbacks=[monitor]).fit(model, datamodule=data(world))
    trained = next(i for i, (training, _) in enumerate(calls) if training)
    even = [[0.25] * 4] * 2
    timed = monitor.step_shares(skip=1)
    return {"load": strategy.clock.expert_load, "batches": strategy.clock.batch_loads,
            "prediction": strategy.prediction, "even": strategy.predict(expert_load=even),
            "each": [strategy.predict(expert_load=b) for b in strategy.clock.batch_loads or []],
            "timed": timed, "each_timed": [strategy.predict(expert_load=b)["step_time_s"] for b in timed],
            "summary": timing_summary({"step_time_s": 1.0, "timing_warmup_steps": 1}, strategy, None, None, monitor),
            "state": model.state_dict(), "warmup_tokens": [n for _, n in calls[:trained]],
            "gloo_lazy": os.environ.get("TORCH_GLOO_LAZY_INIT")}


def shares_by_hand(model, tokens) -> list[list[float]]:
    counts = []
    hooks = [m.register_forward_hook(lambda mod, args, out: counts.append(out[1].tokens_per_expert.double()))
             for m in model.modules() if isinstance(m, MoELayer)]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return [(c / c.sum()).tolist() for c in counts]


def close(a, b) -> bool:
    return torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))


def test_predictions_assume_the_routing_of_the_initial_routers_on_held_out_warm_up_batches():
    from lightning_hetermoe.strategy.routing_warmup import MERGE_TOKENS, WARMUP_BATCHES, WARMUP_TOKENS

    got = run_ranks(2, fit_predicted, 2)
    assert got[0]["load"] == got[1]["load"] and got[0]["batches"] == got[1]["batches"], \
        "every rank predicts with the same routing"
    # by hand: rank 0's initial model (every rank starts from it: the ranks were seeded
    # apart, and each forwards its half of every batch), eval mode, global batches of 8
    # samples drawn from a seeded permutation of the dataset, as many as hold the warm-up's
    # tokens (at most WARMUP_BATCHES, as the dataset allows)
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    dataset = data(1, 8).train_set
    seq_len = dataset[0][0].shape[0]
    want = min(WARMUP_BATCHES, -(-WARMUP_TOKENS // (8 * seq_len)), len(dataset) // 8)
    assert want >= 2, "the test needs batches to plan on and batches to predict on"
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    model.eval()
    by_hand = [shares_by_hand(model, torch.stack([dataset[i][0] for i in order[b * 8:(b + 1) * 8]]))
               for b in range(want)]
    # the strategy had gloo connect pairs on first use (where the environment did not say)
    assert [r["gloo_lazy"] for r in got] == [os.environ.get("TORCH_GLOO_LAZY_INIT", "1")] * 2
    # each rank forwarded its own 4 sequences of each batch, not rank 0 all 8; this small
    # model's chunks all in one forward (fewer tokens than MERGE_TOKENS)
    assert 4 * seq_len * want <= MERGE_TOKENS
    assert [r["warmup_tokens"] for r in got] == [[4 * seq_len * want]] * 2
    half = want // 2
    # the planner places at the pooled shares of the first half ...
    pooled = [[sum(b[l][e] for b in by_hand[:half]) / half for e in range(4)] for l in range(2)]
    assert close(got[0]["load"], pooled)
    # ... and every prediction is the mean over the other half, each batch at its own routing
    assert len(got[0]["batches"]) == want - half
    for measured, expected in zip(got[0]["batches"], by_hand[half:], strict=True):
        assert close(measured, expected)
    each = [p["step_time_s"] for p in got[0]["each"]]
    assert got[0]["prediction"]["step_time_s"] == pytest.approx(sum(each) / len(each), rel=1e-12)
    assert len(set(each)) > 1, "the batches route differently: the mean is over something"
    mean = sum(each) / len(each)
    spread = (sum((t - mean) ** 2 for t in each) / len(each)) ** 0.5 / mean
    assert got[0]["summary"]["predicted_step_time_batch_spread"] == pytest.approx(spread, rel=1e-9) and spread > 0
    skews = [max(max(row) * len(row) for row in b) for b in by_hand[half:]]
    assert min(skews) > 1.05, f"the initial routers are uneven (max/mean {min(skews):.3f}): the test would be vacuous"
    assert got[0]["prediction"]["expert_load_max_over_mean"] == pytest.approx(sum(skews) / len(skews), rel=1e-12)
    # uneven routing makes the busiest expert rank the step's bottleneck: a slower prediction
    assert got[0]["prediction"]["step_time_s"] > got[0]["even"]["step_time_s"]
    # measured beside it: the timed steps' own routing (the warm-up step left out), the
    # step averaged over them
    timed, summary = got[0]["timed"], got[0]["summary"]
    assert len(timed) == STEPS - 1 and timed[0] != timed[1]
    assert summary["predicted_step_time_at_measured_load_s"] == pytest.approx(
        sum(got[0]["each_timed"]) / len(timed), rel=1e-12)
    assert summary["expert_load_max_over_mean"] == pytest.approx(
        sum(max(max(row) * len(row) for row in t) for t in timed) / len(timed), rel=1e-12)
    assert summary["step_time_rel_error"] == pytest.approx(1.0 / got[0]["prediction"]["step_time_s"] - 1)
    # measuring it changed nothing: the run is still one process's training
    model.train()
    assert_same_params(got[0]["state"], reference_fit(make_model(4, seed=0, optim=OptimConfig()), STEPS), initial)


SKEWED = [[0.55, 0.15, 0.15, 0.15], [0.1, 0.2, 0.3, 0.4]]


def fit_at_a_routing_record(rank: int, world: int, path: str) -> dict:
    from lightning_hetermoe.configs import ConfigError

    strategy = HeterMoEStrategy(mode="ep", cluster={"name": "two", "devices": ["a40", "v100"]}, expert_load=path)
    trainer(strategy, world, max_steps=1).fit(make_model(4, seed=rank, optim=OptimConfig()), datamodule=data(world))
    out = {"load": strategy.clock.expert_load, "batches": strategy.clock.batch_loads,
           "prediction": strategy.prediction, "at_record": strategy.predict(expert_load=SKEWED)}
    # zebra plans at the record and, by default, chooses which expert goes where at it
    zebra = HeterMoEStrategy(mode="zebra", cluster={"name": "two", "devices": ["a40", "v100"]}, expert_load=path)
    trainer(zebra, world, max_steps=1).fit(make_model(4, seed=rank, optim=OptimConfig()), datamodule=data(world))
    out["placed_at_load"] = zebra.plan.placed_at_load
    out["zebra_load"] = zebra.clock.expert_load
    other = HeterMoEStrategy(mode="ep", cluster={"name": "two", "devices": ["a40", "v100"]}, expert_load=path)
    try:
        trainer(other, world, max_steps=1).fit(make_model(8, seed=rank, optim=OptimConfig()), datamodule=data(world))
    except ConfigError as err:
        out["refused"] = str(err)
    return out


def test_a_routing_record_replaces_the_warm_up_routing(tmp_path):
    """strategy expert_load: an earlier run's measured routing (its expert_load.json) is what
    the run plans and predicts at, on every rank (zebra's plan chooses its experts' ids at
    it); a record of another model shape is refused
    at set-up on every rank, both shapes named."""
    from lightning_hetermoe import RoutingRecord

    path = tmp_path / "expert_load.json"
    RoutingRecord(model="tiny", mean_share=SKEWED, steps=5, choices_per_step=256.0).to_json(str(path))
    got = run_ranks(2, fit_at_a_routing_record, 2, str(path))
    for rank in got:
        assert rank["load"] == SKEWED and rank["batches"] == [SKEWED]
        assert rank["prediction"]["step_time_s"] == pytest.approx(rank["at_record"]["step_time_s"], rel=1e-12)
        assert rank["prediction"]["expert_load_max_over_mean"] == pytest.approx(0.55 * 4)
        assert "strategy expert_load holds 2 layers x 4 experts" in rank["refused"] and "has 2 x 8" in rank["refused"]
        assert rank["zebra_load"] == SKEWED and rank["placed_at_load"] is True
