"""Expert-parallel training on real gloo processes equals single-process training on the
global batch, at the default loss coefficients (balance and z-loss on), for the optimizers,
accumulation and clipping users run, with every rank seeded differently (the strategy must
start all ranks from rank 0's weights, experts included)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from lightning_hetermoe.model_contract import moe_layers
from reference import assert_same_params, data, make_model, reference_fit, trainer

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 5

CASES = {
    2: [
        dict(name="adamw"),
        dict(name="adam_l2", optim=dict(name="adam", weight_decay=0.05)),
        dict(name="sgd_nesterov", optim=dict(name="sgd", lr=0.1, momentum=0.9, nesterov=True, warmup_steps=0)),
        dict(name="accumulate_clip", accumulate=2, clip=0.05),
        # At these tiny shapes kernel launches dominate, so the slow device launches slowly.
        dict(name="speed_split", strategy=dict(batch_split="speed", cluster=dict(
            name="mix", devices=["a40", "slow"], custom_devices={"slow": {"base": "v100", "launch_overhead_s": 1e-4}}))),
        # EP groups of one: each rank holds every expert and dispatches as one device
        dict(name="groups_of_one", strategy=dict(expert_parallel_size=1)),
    ],
    4: [
        dict(name="adamw_uneven", num_experts=3),  # 1+1+1+0 experts
        dict(name="replicas_clip", num_experts=8, clip=0.05, strategy=dict(expert_parallel_size=2)),
        dict(name="sgd_accumulate", optim=dict(name="sgd", lr=0.1, momentum=0.9, nesterov=True, warmup_steps=0),
             accumulate=2),
    ],
}


def build(case: dict, seed: int):
    return make_model(case.get("num_experts", 4), seed=seed, optim=OptimConfig(**case.get("optim", {})))


class Dispatchers(L.Callback):
    """Whether each MoE layer's dispatcher ran as one device (``alone``) in the first step
    (the strategy puts the layers' own back at the end of fit)."""

    def __init__(self) -> None:
        self.alone: list[bool] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.alone is None:
            self.alone = [getattr(layer.dispatcher, "alone", None) is not None for _, layer in moe_layers(pl_module)]


def fit_cases(rank: int, world: int, cases: list[dict]) -> list[dict] | None:
    out = []
    for case in cases:
        model = build(case, seed=rank)  # differently seeded ranks: rank 0's weights must win
        strategy = HeterMoEStrategy(**{"mode": "ep", **case.get("strategy", {})})
        seen = Dispatchers()
        t = trainer(strategy, world, max_steps=STEPS, accumulate_grad_batches=case.get("accumulate", 1),
                    gradient_clip_val=case.get("clip"), callbacks=[seen])
        t.fit(model, datamodule=data(world))
        out.append({k: v.clone() for k, v in model.state_dict().items()})
        if case["name"] == "speed_split":
            out[-1]["__shares__"] = torch.tensor(strategy.backend.shares)
        if case["name"] == "groups_of_one":  # no exchange with itself, no count read on the host
            out[-1]["__alone__"] = torch.tensor(seen.alone)
    return out if rank == 0 else None


@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.standin) if w == 2 else w for w in sorted(CASES)])
def test_distributed_equals_single_process_at_default_settings(world):
    cases = CASES[world]
    results = run_ranks(world, fit_cases, world, cases)[0]
    for case, actual in zip(cases, results, strict=True):
        model = build(case, seed=0)
        initial = copy.deepcopy(model.state_dict())
        expected = reference_fit(model, STEPS, accumulate=case.get("accumulate", 1), clip=case.get("clip"))
        if case.get("clip"):
            unclipped = reference_fit(model, STEPS, accumulate=case.get("accumulate", 1))
            gap = (expected["model.head.weight"] - unclipped["model.head.weight"]).abs().max()
            assert gap > 1e-4, f"{case['name']}: clipping never bit, the clip check would be vacuous"
        alone = actual.pop("__alone__", None)
        assert alone is None or bool(alone.all()), f"{case['name']}: a layer exchanged within a group of one"
        shares = actual.pop("__shares__", None)
        if shares is not None:
            assert shares.tolist()[0] > shares.tolist()[1], f"a40 must get the larger share: {shares.tolist()}"
        assert_same_params(actual, expected, initial)
