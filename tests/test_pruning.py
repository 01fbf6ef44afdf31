"""Lightning's ``ModelPruning`` under the strategy: pruning what every rank holds whole (the
dense weights under ep and data-centric) trains as one process does with the same callback;
pruning what a rank holds a share of, or none of (the experts in every mode, anything under
zebra and distep, whose expert ranks hold no dense weights), is refused before anything
trains, naming what works, where it used to fail when the fit ended."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelPruning

from harness import run_ranks
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.model_contract import moe_layers
from reference import data, make_model, trainer

STEPS = 4  # the first epoch's end comes at max_steps: pruned there, made permanent as the fit ends
AMOUNT = 0.3  # of every weight and bias, by one threshold over all of them (the callback's default)


def _experts(model) -> list:
    return [(layer.experts, "w_up") for _, layer in moe_layers(model)]


def _dense_weights(state: dict) -> list[torch.Tensor]:
    return [v for k, v in state.items() if k.endswith(("weight", "bias")) and ".experts." not in k]


def prune_and_fit(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        model = make_model(4, seed=0, optim=OptimConfig())
        strategy = "auto" if world == 1 else HeterMoEStrategy(**case)
        t = trainer(strategy, world, max_steps=STEPS, callbacks=[ModelPruning("l1_unstructured", amount=AMOUNT)])
        try:
            t.fit(model, datamodule=data(world, GLOBAL[2], windows=WINDOWS[2]))
        except ConfigError as err:
            out.append({"refused": str(err), "steps": t.global_step})
            continue
        out.append({"state": {k: v.clone() for k, v in model.state_dict().items()}, "steps": t.global_step})
    return out


@pytest.mark.slow
def test_pruning_the_dense_weights_trains_like_one_process_under_ep_and_datacentric_and_is_refused_at_set_up_where_auto_runs_zebra():
    cases = [dict(mode="ep"), dict(mode="datacentric"),
             dict(mode="auto", plan=make_test_plan(2, [0], R=2))]  # auto runs what a given plan was made for
    per_rank = run_ranks(2, prune_and_fit, 2, cases)
    one = prune_and_fit(0, 1, [{}])[0]
    pruned = torch.cat([w.flatten() for w in _dense_weights(one["state"])])
    assert one["steps"] == STEPS and abs(float((pruned == 0).float().mean()) - AMOUNT) < 0.01  # it pruned
    for c, case in enumerate(cases[:2]):
        got = per_rank[0][c]
        assert got["steps"] == STEPS and got["state"].keys() == one["state"].keys(), case
        for k, v in one["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"{case}: {k}")
            assert torch.equal(got["state"][k] == 0, v == 0) or ".experts." in k, (case, k)  # the same mask
    for rank in (0, 1):  # chosen at set-up, said alike on every rank, before a step
        got = per_rank[rank][2]
        assert got["steps"] == 0 and "ModelPruning does not work under strategy mode='zebra' on 2 ranks" in \
            got["refused"], got


@pytest.mark.parametrize("mode", ["zebra", "distep"])
def test_pruning_under_zebra_or_distep_is_refused_before_any_process_starts_naming_what_works(mode):
    t = trainer(HeterMoEStrategy(mode=mode, plan=make_test_plan(2, [0], R=2)), 2, max_steps=1,
                callbacks=[ModelPruning("l1_unstructured", amount=AMOUNT)])
    with pytest.raises(ConfigError, match=f"ModelPruning does not work under strategy mode='{mode}' on 2 ranks: the "
                                          f"expert ranks hold none of the dense weights.*Prune under mode='ep' or "
                                          f"'datacentric'"):
        t.fit(make_model(4, optim=OptimConfig()), datamodule=data(2, 8))


@pytest.mark.parametrize("mode", ["ep", "datacentric"])
def test_pruning_the_experts_is_refused_before_any_process_starts_where_each_rank_holds_a_share(mode):
    model = make_model(4, optim=OptimConfig())
    t = trainer(HeterMoEStrategy(mode=mode), 2, max_steps=1,
                callbacks=[ModelPruning("l1_unstructured", amount=AMOUNT, parameters_to_prune=_experts(model))])
    with pytest.raises(ConfigError, match=r"ModelPruning does not work on the experts under HeterMoEStrategy on 2 "
                                          r"ranks: each rank holds a share.*given model\.blocks\.0\.moe\.experts, "
                                          r"model\.blocks\.1\.moe\.experts: prune the dense weights only"):
        t.fit(model, datamodule=data(2, 8))


def test_what_set_up_chose_decides_and_groups_of_one_rank_may_prune_their_whole_experts():
    model = make_model(4, optim=OptimConfig())
    dense, experts = ModelPruning("l1_unstructured"), ModelPruning("l1_unstructured", parameters_to_prune=_experts(model))
    args = HeterMoEStrategy(mode="auto").args
    args.check_callbacks([dense, experts], model, 2, True)  # auto: set-up checks what it chose
    with pytest.raises(ConfigError, match="mode='distep' on 4 ranks"):
        args.check_callbacks([dense], model, 4, True, schedule="distep")
    with pytest.raises(ConfigError, match="on the experts"):
        args.check_callbacks([experts], model, 4, True, schedule="ep", ep_size=2)
    args.check_callbacks([dense, experts], model, 4, True, schedule="ep", ep_size=1)  # every expert on every rank
    args.check_callbacks([dense], model, 4, True, schedule="ep", ep_size=4)
    args.check_callbacks([dense, experts], model, 4, False, schedule="zebra")  # it prunes only in fit
    args.check_callbacks([dense, experts], model, 1, True, schedule="single")
