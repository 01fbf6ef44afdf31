"""What the strategy decides at set-up: the routing the predictions assume is the one the
freshly initialised routers give a warm-up batch, measured without disturbing training."""

from __future__ import annotations

import copy

import torch

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, MoELayer, OptimConfig
from reference import assert_same_params, data, make_model, reference_fit, trainer
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 3


def fit_predicted(rank: int, world: int) -> dict:
    model = make_model(4, seed=rank, optim=OptimConfig())
    strategy = HeterMoEStrategy(mode="ep", cluster={"name": "two", "devices": ["a40", "v100"]})
    trainer(strategy, world, max_steps=STEPS).fit(model, datamodule=data(world))
    even = [[0.25] * 4] * 2
    return {"load": strategy.clock.expert_load, "prediction": strategy.prediction,
            "even": strategy.predict(expert_load=even), "state": model.state_dict()}


def test_predictions_assume_the_routing_of_the_initial_routers_on_a_warm_up_batch():
    got = run_ranks(2, fit_predicted, 2)
    assert got[0]["load"] == got[1]["load"], "rank 0 measures, every rank predicts with the same routing"
    # by hand: rank 0's initial model (every rank starts from it), eval mode, the global
    # batch's worth of samples in dataset order
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    dataset = data(1, 8).train_set
    tokens = torch.stack([dataset[i][0] for i in range(8)])
    counts = []
    hooks = [m.register_forward_hook(lambda mod, args, out: counts.append(out[1].tokens_per_expert.double()))
             for m in model.modules() if isinstance(m, MoELayer)]
    model.eval()
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    by_hand = [(c / c.sum()).tolist() for c in counts]
    for measured, expected in zip(got[0]["load"], by_hand, strict=True):
        assert measured == torch.tensor(expected).tolist() or torch.allclose(torch.tensor(measured),
                                                                               torch.tensor(expected))
    skew = max(max(row) * len(row) for row in by_hand)
    assert skew > 1.05, f"the initial routers are uneven (max/mean {skew:.3f}): the test would be vacuous"
    assert got[0]["prediction"]["expert_load_max_over_mean"] == skew
    # uneven routing makes the busiest expert rank the step's bottleneck: a slower prediction
    assert got[0]["prediction"]["step_time_s"] > got[0]["even"]["step_time_s"]
    # measuring it changed nothing: the run is still one process's training
    model.train()
    assert_same_params(got[0]["state"], reference_fit(make_model(4, seed=0, optim=OptimConfig()), STEPS), initial)
