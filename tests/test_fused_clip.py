"""Gradient clipping with a fused optimizer under 16-mixed, which Lightning refuses.

A fused optimizer unscales inside its own step, so Lightning does not unscale before the
clip and refuses to clip at all. The strategy unscales such an optimizer first (torch's
``GradScaler`` allows it: the step then skips its own unscaling) and clips as for any
optimizer. By hand on one process: the step is SGD's on the unscaled, clipped gradient;
on real gloo processes in ep and zebra: fused and unfused SGD land together, and where the
clip is what moved them (a control without it lands far away)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from lightning_hetermoe.strategy.precision import clip_fused_too
from reference import data, make_model, relative_gap, trainer
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan

SCALE = 2.0 ** 10


def scaled_step(patched: bool, clip: float):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50))
    grad = torch.randn(50) * 3  # norm ~21: the clip at 1.0 bites
    w.grad = grad * SCALE  # as backward leaves it under a loss scale
    opt = torch.optim.SGD([w], lr=0.1, fused=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=SCALE))
    if patched:
        clip_fused_too(plugin)
    plugin.scaler.scale(torch.zeros(()))  # what the loss's scaling does first: the scale exists from here
    before = w.detach().clone()
    plugin.clip_gradients(opt, clip)
    plugin.scaler.step(opt)
    plugin.scaler.update()
    return before, grad, w.detach().clone()


def test_lightning_refuses_to_clip_for_a_fused_optimizer():
    with pytest.raises(RuntimeError, match="fused"):
        scaled_step(patched=False, clip=1.0)


def test_the_step_is_sgd_on_the_unscaled_clipped_gradient():
    before, grad, after = scaled_step(patched=True, clip=1.0)
    clipped = grad * (1.0 / (grad.norm() + 1e-6))
    torch.testing.assert_close(after, before - 0.1 * clipped, rtol=1e-5, atol=1e-6)


def test_without_clipping_the_fused_step_unscales_itself():
    before, grad, after = scaled_step(patched=True, clip=0.0)
    torch.testing.assert_close(after, before - 0.1 * grad, rtol=1e-5, atol=1e-6)


STEPS = 6
SGD = dict(name="sgd", lr=0.05, momentum=0.9, warmup_steps=0)


def fit(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        model = make_model(4, seed=rank, optim=OptimConfig(**SGD, fused=case["fused"]))
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        t = trainer(HeterMoEStrategy(mode=case["mode"], plan=case.get("plan")), world, max_steps=STEPS,
                    plugins=[plugin], gradient_clip_val=case["clip"])
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out.append({"state": {k: v.clone() for k, v in model.state_dict().items()},
                    "scale": float(t.precision_plugin.scaler.get_scale())})
    return out


@pytest.mark.slow
def test_fused_sgd_clipped_under_fp16_lands_where_unfused_sgd_lands_in_ep_and_zebra():
    plan = make_test_plan(2, [0], R=2)
    cases = [dict(mode=m, plan=plan if m == "zebra" else None, fused=f, clip=c)
             for m in ("ep", "zebra") for f, c in ((True, 0.05), (False, 0.05), (False, None))]
    per_rank = run_ranks(2, fit, 2, cases)
    initial = {k: v.clone() for k, v in make_model(4, seed=0, optim=OptimConfig(**SGD)).state_dict().items()}
    for m in range(2):
        fused, unfused, unclipped = (per_rank[0][3 * m + i] for i in range(3))
        mode = cases[3 * m]["mode"]
        assert fused["scale"] == unfused["scale"], (mode, fused["scale"], unfused["scale"])
        # the same steps in another kernel: rounding apart
        assert relative_gap(fused["state"], unfused["state"], initial) < 1e-3, mode
        # and the clip is what moved them: without it SGD lands far from both
        assert relative_gap(unclipped["state"], unfused["state"], initial) > 0.1, mode
