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
from lightning.pytorch.plugins import MixedPrecision, Precision

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.model.lm import MoELanguageModel, resolve_fused
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


# ---- optim.fused=auto: the fused step where it runs and can be clipped ----------------------

def cpu_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]


def test_auto_takes_the_fused_step_only_where_every_parameter_is_on_a_device_that_has_it():
    params = cpu_params()
    assert resolve_fused("auto", params) is True  # the CPU has torch's fused step, as GPUs do
    assert resolve_fused("auto", params, devices=("cuda",)) is None  # a device without it: torch's own default
    # one parameter elsewhere (not yet materialised) is enough to keep torch's default
    assert resolve_fused("auto", params + [torch.nn.Parameter(torch.empty(2, device="meta"))]) is None
    assert resolve_fused(True, params) is True and resolve_fused(False, params) is None


def test_auto_keeps_torch_s_step_where_the_precision_plugin_would_refuse_to_clip_it():
    params = cpu_params()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    # Lightning's own 16-mixed with clipping refuses a fused optimizer (the test above)
    assert resolve_fused("auto", params, plugin, 1.0) is None
    assert resolve_fused("auto", params, plugin, None) is True  # no clip: nothing to refuse
    # Lightning's bf16-mixed has no scaler and refuses all the same
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    assert resolve_fused("auto", params, bf16, 1.0) is None
    assert resolve_fused("auto", params, Precision(), 1.0) is True  # 32-true clips any optimizer
    for p in (plugin, bf16):
        clip_fused_too(p)  # what HeterMoEStrategy does to its plugin at set-up
        assert p.clips_fused
        assert resolve_fused("auto", params, p, 1.0) is True


def test_a_fused_setting_other_than_true_false_or_auto_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"optim\.fused='yes' is invalid: must be true, false or auto"):
        OptimConfig(fused="yes")


@pytest.mark.parametrize("setting, fused", [(True, True), ("auto", True), (False, None)])
def test_the_model_builds_its_optimizer_from_the_setting(setting, fused):
    model = make_model(4, optim=OptimConfig(fused=setting))  # outside a Trainer, on the CPU
    got = model.configure_optimizers()
    opt = got["optimizer"] if isinstance(got, dict) else got
    assert opt.defaults["fused"] is fused


class Recorder(MoELanguageModel):
    """Records the optimizer ``optim.fused=auto`` built, with the plugin as the strategy
    left it when Lightning builds the optimizers."""

    def configure_optimizers(self):
        got = super().configure_optimizers()
        self.auto = got["optimizer"].defaults["fused"]
        return got


def auto_under(strategy, precision: str) -> tuple[bool | None, int]:
    """What auto built, and the steps a clipped fit then took (a refused clip raises)."""
    model = make_model(4)
    model.__class__ = Recorder
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    t = trainer(strategy, 1, max_steps=2, plugins=[MixedPrecision(precision, "cpu", scaler=scaler)],
                gradient_clip_val=1.0)
    t.fit(model, datamodule=data(1))
    return model.auto, t.global_step


def auto_under_hetermoe(rank: int) -> list[tuple[bool | None, int]]:
    return [auto_under(HeterMoEStrategy(), precision) for precision in ("16-mixed", "bf16-mixed")]


@pytest.mark.slow
def test_under_the_strategy_auto_sees_a_plugin_that_clips_for_a_fused_optimizer():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    # clip_fused_too runs before the optimizers are built: auto takes the fused step, and
    # the clip runs under both mixed precisions (its own process: the strategy leaves a
    # process group behind)
    assert run_ranks(1, auto_under_hetermoe)[0] == [(True, 2), (True, 2)]
    # Lightning's own strategy leaves the plugin refusing: auto keeps torch's step, and the
    # clipped fit trains
    for precision in ("16-mixed", "bf16-mixed"):
        assert auto_under(SingleDeviceStrategy("cpu"), precision) == (None, 2)


# ---- the clip folded into the fused step (no loss scaler) -----------------------------------

def clipped_step(fold: bool, clip: float | None, optimizer: str) -> tuple[torch.Tensor, list[torch.Tensor], object]:
    """One clipped step of a fused ``optimizer`` on two parameters: the gradients scaled by
    ``clip / norm`` first, or the coefficient folded into the step (``clip=None``: no clip)."""
    from lightning_hetermoe.strategy.grad_norm import clip_, squared_norm, unfold

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(6, 5))]
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = cls(params, lr=0.1, weight_decay=0.1, fused=True, **({"momentum": 0.9} if optimizer == "sgd" else {}))
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 3  # a norm near 20: a clip at 1.0 bites
        if clip is not None:
            clip_(opt, [p.grad for p in params], squared_norm((p.grad for p in params), "cpu").sqrt(), clip, fold)
        opt.step()
        unfold(opt)
    return torch.cat([p.detach().flatten() for p in params]), [p.grad.clone() for p in params], opt


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_clip_folded_into_a_fused_step_lands_where_scaling_first_lands(optimizer):
    folded, folded_grads, opt = clipped_step(True, 1.0, optimizer)
    scaled, scaled_grads, _ = clipped_step(False, 1.0, optimizer)
    unclipped, _, _ = clipped_step(False, None, optimizer)
    # a division where the scaling multiplied: fp32 rounding apart
    torch.testing.assert_close(folded, scaled, rtol=1e-6, atol=1e-6)
    # the step leaves the clipped gradients behind, as the scaling does
    for f, s in zip(folded_grads, scaled_grads, strict=True):
        torch.testing.assert_close(f, s, rtol=1e-6, atol=1e-7)
    assert float(torch.cat([g.flatten() for g in folded_grads]).norm()) == pytest.approx(1.0, rel=1e-5)
    # the clip is what moved them, and no divisor outlives the step
    assert (unclipped - scaled).abs().max() > 1e-2
    assert getattr(opt, "grad_scale", None) is None


def test_only_a_fused_step_without_a_divisor_of_its_own_takes_the_clip():
    from lightning_hetermoe.strategy.grad_norm import step_takes_scale

    assert step_takes_scale(torch.optim.AdamW(cpu_params(), fused=True))
    assert not step_takes_scale(torch.optim.AdamW(cpu_params(), foreach=True))
    assert not step_takes_scale(torch.optim.AdamW(cpu_params()))
    taken = torch.optim.SGD(cpu_params(), lr=0.1, fused=True)
    taken.grad_scale = torch.tensor(8.0)  # a loss scaler's, for its own step
    assert not step_takes_scale(taken)


class SeesTheDivisor(MoELanguageModel):
    """Records the gradient divisor the optimizer's step reads, step by step."""

    def configure_optimizers(self):
        got = super().configure_optimizers()
        opt, step = got["optimizer"], got["optimizer"].step
        self.divisors = []

        def look() -> None:
            divisor = getattr(opt, "grad_scale", None)
            self.divisors.append(None if divisor is None else float(divisor))

        def recording(closure=None):
            if closure is None:  # a loss scaler ran the closure first, and set its own divisor
                look()
                return step()

            def closure_then_look():
                out = closure()  # the backward and the clip: the divisor is set by now
                look()
                return out
            return step(closure_then_look)

        opt.step = recording
        return got


def clipped_fit(strategy, plugins: list) -> tuple[dict, list]:
    model = make_model(4)
    model.__class__ = SeesTheDivisor
    t = trainer(strategy, 1, max_steps=4, plugins=plugins, gradient_clip_val=0.05)
    t.fit(model, datamodule=data(1))
    return {k: v.clone() for k, v in model.state_dict().items()}, model.divisors


def clipped_fits_under_hetermoe(rank: int) -> list[tuple[dict, list]]:
    return [clipped_fit(HeterMoEStrategy(), []),
            clipped_fit(HeterMoEStrategy(), [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])]


@pytest.mark.slow
def test_the_strategy_folds_its_clip_into_the_default_fused_step_and_lands_where_lightning_does():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    (folded, divisors), (_, under_scaler) = run_ranks(1, clipped_fits_under_hetermoe)[0]
    scale = 2.0 ** 16  # GradScaler's initial scale (no overflow in 4 steps of this model)
    reference, lightning_divisors = clipped_fit(SingleDeviceStrategy("cpu"), [])
    initial = {k: v.clone() for k, v in make_model(4).state_dict().items()}
    # the default AdamW's fused step divided by norm / clip: the clip binds at every step
    assert len(divisors) == 4 and all(d is not None and d > 1.0 for d in divisors), divisors
    # Lightning scales the gradients first (no divisor), and lands in the same place
    assert lightning_divisors == [None] * 4
    assert relative_gap(folded, reference, initial) < 1e-5
    # under a loss scaler the step unscales and clips: its divisor is the scale over the clip's
    # coefficient (the gradients still carry the scale when the norm reads them)
    assert len(under_scaler) == 4 and all(d is not None and d > scale for d in under_scaler), under_scaler


def scaled_clipped_steps(folded: bool, overflow_at: int | None = None) -> tuple[torch.Tensor, list, float]:
    """Three fp16-style steps of a fused AdamW under the agreeing scaler, clipped at 1.0:
    unscaled, clipped and stepped in the fused step (``unscale_in_step_``), or unscaled,
    scaled by the clip and stepped as Lightning does; step ``overflow_at`` overflows."""
    from lightning_hetermoe.strategy.grad_norm import clip_, squared_norm
    from lightning_hetermoe.strategy.precision import AgreedGradScaler

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(6, 5))]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    scaler = AgreedGradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.zeros(()))  # what the loss's scaling does first: the scale exists from here
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 3 * scaler.get_scale()  # as backward leaves them under the scale
        if step == overflow_at:
            params[1].grad[2, 3] = float("inf")
        if folded:
            scaler.unscale_in_step_(opt, squared_norm((p.grad for p in params), "cpu").sqrt(), 1.0)
        else:
            scaler.unscale_(opt)
            clip_(opt, [p.grad for p in params], squared_norm((p.grad for p in params), "cpu").sqrt(), 1.0, fold=False)
        scaler.step(opt)
        scaler.update()
    return torch.cat([p.detach().flatten() for p in params]), [p.grad.clone() for p in params], scaler.get_scale()


@pytest.mark.parametrize("overflow_at", [None, 1])
def test_the_fused_step_unscales_and_clips_where_unscaling_and_scaling_first_land(overflow_at):
    folded, folded_grads, folded_scale = scaled_clipped_steps(True, overflow_at)
    first, first_grads, first_scale = scaled_clipped_steps(False, overflow_at)
    torch.testing.assert_close(folded, first, rtol=1e-6, atol=1e-6)
    # an overflow skips the same step and backs the scale off alike
    assert folded_scale == first_scale == (SCALE if overflow_at is None else SCALE / 2)
    if overflow_at is None:  # the gradients left behind: unscaled and clipped, both ways
        for f, s in zip(folded_grads, first_grads, strict=True):
            torch.testing.assert_close(f, s, rtol=1e-5, atol=1e-7)
    # and the clip is what moved them: unclipped, the first step alone lands elsewhere
    unclipped = scaled_clipped_steps(True, overflow_at=0)[0]  # overflow at the first: one step fewer
    assert (unclipped - folded).abs().max() > 1e-3
