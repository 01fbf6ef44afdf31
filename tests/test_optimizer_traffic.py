"""What the plan prices for a step's tail: the bytes a clipped optimizer step streams per
parameter (``optimizer_step_traffic``), against the bytes torch's own steps and the pack's
clip read and write, counted operation by operation on the CPU."""

from __future__ import annotations

import pytest
import torch

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.cluster.devices import get_device
from lightning_hetermoe.configs import ModelConfig, OptimConfig
from lightning_hetermoe.plan import make_plan
from lightning_hetermoe.profile.cost_model import CostModel, optimizer_step_traffic
from lightning_hetermoe.strategy.grad_norm import clip_, squared_norm, unfold
from lightning_hetermoe.strategy.run_clock import RunClock

from helpers_bench import load_bench


# bench/optimizer_step.py's counter: every tensor an operation reads, and every one it may write
Traffic = load_bench("clip_norm").Traffic


def torch_optimizer(o: OptimConfig, params, fused: bool) -> torch.optim.Optimizer:
    """The optimizer the pack's model builds from ``o`` (``model.lm``), fused or torch's
    multi-tensor step."""
    how = {"fused": True} if fused else {"foreach": True}
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum, **how)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(params, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, **how)


def counted_step(o: OptimConfig) -> float:
    """Bytes per parameter of one clipped step as the strategy takes it: the global norm,
    the clip (folded into a fused step, else every gradient scaled), the step."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1 << 16, 3 << 15, 5000)]
    fused = o.fused in (True, "auto")
    opt = torch_optimizer(o, params, fused)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 100  # the clip at 1.0 binds
    opt.step()  # the state exists from the second step on, as in training
    traffic = Traffic()
    with traffic:
        grads = [p.grad for p in params]
        norm = squared_norm(grads, "cpu").sqrt()
        clip_(opt, grads, norm, 1.0)
        opt.step()
    unfold(opt)
    return traffic.bytes / sum(p.numel() for p in params)


CONFIGS = [OptimConfig(), OptimConfig(fused=False), OptimConfig(fused=False, weight_decay=0.1),
           OptimConfig(name="adam", fused=False, weight_decay=0.1), OptimConfig(name="adam"),
           OptimConfig(name="sgd"), OptimConfig(name="sgd", fused=False),
           OptimConfig(name="sgd", momentum=0.9), OptimConfig(name="sgd", momentum=0.9, fused=False, weight_decay=0.1)]


@pytest.mark.parametrize("o", CONFIGS, ids=lambda o: f"{o.name}-fused={o.fused}-wd={o.weight_decay}-m={o.momentum}")
def test_the_priced_traffic_is_what_the_clipped_step_reads_and_writes(o):
    # the scalars a step reads beside the tensors (lr, step counts, the clip's coefficient)
    # add a few bytes over 200K parameters
    assert counted_step(o) == pytest.approx(optimizer_step_traffic(o), abs=0.05)


def test_the_pack_s_default_is_the_cost_model_s_own_and_a_user_s_optimizer_is_torch_s_default_adamw():
    assert optimizer_step_traffic(OptimConfig()) == CostModel().optimizer_bytes_per_param == 36.0
    assert optimizer_step_traffic(None) == optimizer_step_traffic(OptimConfig(fused=False)) == 88.0


def test_the_plan_and_the_run_s_clock_time_the_step_s_tail_with_the_run_s_optimizer():
    model, seq_len = ModelConfig(), 64
    cluster = ClusterConfig(name="mix", devices=["a40", "v100"])
    steps = {}
    for name, o in {"sgd": OptimConfig(name="sgd"), "adamw": OptimConfig(),
                    "adamw unfused": OptimConfig(fused=False)}.items():
        plan = make_plan(cluster, model, seq_len=seq_len, global_batch_tokens=16 * seq_len, optimizer=o)
        steps[name] = plan.predicted["zebra"]["step_time_s"]
        clock = RunClock(cluster, None, rank=0)
        clock.bind(model, 8, seq_len, 2, cluster.specs(), optimizer=o)
        v100 = get_device("v100")
        assert clock.timer.optimizer(v100, 1e9) == pytest.approx(CostModel().elementwise_time(
            v100, 1e9 * optimizer_step_traffic(o)))
    assert steps["sgd"] < steps["adamw"] < steps["adamw unfused"], steps
