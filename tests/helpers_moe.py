"""The MoE layer against the naive per-token reference (output, auxiliary losses, every
gradient, in fp32), and eager against ``torch.compile`` for an expert backend."""

import torch

from lightning_hetermoe.configs import MoEConfig
from lightning_hetermoe.moe import MoELayer
from lightning_hetermoe.moe.reference import reference_moe

RTOL = 1e-5


def rel_err(actual, expected) -> float:
    return float((actual.detach() - expected.detach()).abs().max() / expected.detach().abs().max().clamp_min(1e-6))


def assert_close(actual, expected, what):
    err = rel_err(actual, expected)
    assert err <= RTOL, f"{what}: max relative error {err:.2e} > {RTOL}"


def run_both(cfg: MoEConfig, d_model=7, tokens=13, train=True, seed=0, prepare=None):
    torch.manual_seed(seed)
    layer = MoELayer(d_model, cfg)
    layer.train(train)
    with torch.no_grad():
        if prepare is not None:
            prepare(layer)
        if layer.experts.b_up is not None:
            layer.experts.b_up.normal_()
            layer.experts.b_down.normal_()
        if hasattr(layer.router, "noise_weight"):
            layer.router.noise_weight.normal_(std=0.3)
    x = torch.randn(tokens, d_model, requires_grad=True)
    upstream = torch.randn(tokens, d_model)

    torch.manual_seed(100)
    y, aux = layer(x)
    loss = (y * upstream).sum() + aux.balance_loss + aux.z_loss
    grads = torch.autograd.grad(loss, [x] + list(layer.parameters()), allow_unused=True)

    torch.manual_seed(100)
    yr, balance, z = reference_moe(layer, x)
    loss_r = (yr * upstream).sum() + balance + z
    grads_r = torch.autograd.grad(loss_r, [x] + list(layer.parameters()), allow_unused=True)
    return layer, (y, aux, grads), (yr, balance, z, grads_r)


def check(cfg, **kw):
    layer, (y, aux, grads), (yr, balance, z, grads_r) = run_both(cfg, **kw)
    assert_close(y, yr, "output")
    assert_close(aux.balance_loss, balance, "balance loss")
    assert_close(aux.z_loss, z, "z loss")
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, g, gr in zip(names, grads, grads_r, strict=True):
        if gr is None:
            assert g is None or g.abs().max() == 0, name
            continue
        assert g is not None, f"no gradient for {name}"
        assert_close(g, gr, f"grad of {name}")
    return layer, aux


def eager_and_compiled(expert_backend: str) -> tuple[list, list]:
    """A small layer on ``expert_backend`` run eager and under ``torch.compile`` (aot_eager):
    each run's output, input gradient and every parameter gradient."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_ff=16, jitter_eps=0.0, expert_backend=expert_backend)
    torch.manual_seed(0)
    layer = MoELayer(16, cfg)
    x = torch.randn(10, 16)
    outs = []
    for fn in (layer, torch.compile(layer, backend="aot_eager")):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y, _ = fn(xi)
        y.square().sum().backward()
        outs.append([y, xi.grad] + [p.grad.clone() for p in layer.parameters()])
    return outs[0], outs[1]
