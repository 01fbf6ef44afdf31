"""The single-process dispatch reads nothing back from the device where every routing choice
is kept (the default: top-k, dropless, no padding): on a GPU a read-back (``.item()``,
``int(tensor)``) is a host sync that stops the host running ahead of the kernels. Syncs are
counted on the CPU as the ops that perform them (``aten._local_scalar_dense``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hetermoe.configs import MoEConfig
from lightning_hetermoe.kernels import grouped_mm_available, grouped_mm_unavailable_reason
from lightning_hetermoe.moe import LocalDispatcher, MoELayer
from lightning_hetermoe.moe.reference import reference_moe


class ReadBacks(TorchDispatchMode):
    """Counts the ops that read a tensor's value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def layer_of(backend: str = "grouped_mm", **moe) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=6, top_k=2, d_ff=24, expert_backend=backend, **moe)
    return MoELayer(16, cfg)


def read_backs(layer: MoELayer, x: torch.Tensor) -> int:
    with ReadBacks() as counter:
        y, aux = layer(x)
        (y.square().mean() + aux.balance_loss + aux.z_loss).backward()
    return counter.count


@pytest.fixture(autouse=True)
def grouped_mm_here():
    if not grouped_mm_available("cpu"):
        pytest.skip(grouped_mm_unavailable_reason("cpu"))


def test_every_choice_kept_reads_nothing_back():
    x = torch.randn(40, 16, requires_grad=True)
    assert read_backs(layer_of(), x) == 0
    # the counter sees the dispatch's read where choices can be dropped: a capacity limit,
    # a router that declines choices (GShard's second)
    assert read_backs(layer_of(capacity_factor=1.0), x) == 1
    assert read_backs(layer_of(router="gshard"), x) == 1
    # the torch loop reads its segment bounds on the host: the dispatch's one read serves it
    assert read_backs(layer_of("torch"), x) == 1


def test_the_sync_free_dispatch_computes_what_the_kept_mask_does():
    """``keep`` None (every choice kept) against the same call with the all-true mask: the
    same output and gradients, to the bit; and the layer against the naive reference."""
    layer = layer_of()
    x = torch.randn(40, 16)
    r = layer.route(x)
    assert bool(r.keep.all())
    results = []
    for keep in (None, r.keep):
        xx = x.clone().requires_grad_(True)
        layer.zero_grad()
        out = LocalDispatcher()(xx, r.indices, keep, layer.experts)
        out.square().sum().backward()
        results.append((out.detach(), xx.grad, [p.grad.clone() for p in layer.experts.parameters()]))
    (a, ga, pa), (b, gb, pb) = results
    assert torch.equal(a, b) and torch.equal(ga, gb) and all(torch.equal(p, q) for p, q in zip(pa, pb, strict=True))
    y, _ = layer(x)
    torch.testing.assert_close(y, reference_moe(layer, x)[0], rtol=1e-5, atol=1e-6)
