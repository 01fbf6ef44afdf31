"""Zebra's micro-batches keep no 16-bit copy of a parameter for their backward: each saved
cast of a parameter is kept as the parameter and cast again when read
(``strategy/backends/zebra/cast_copies.py``). Gradients are bit for bit those of the saved
copies; under zebra the hooks are on in the fibers (attention) and in the executor's thread
(the expert rounds)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from harness import run_ranks
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan
from lightning_hetermoe import HeterMoEStrategy
from lightning_hetermoe.strategy.backends.zebra import cast_copies
from reference import data, make_model, trainer


def _forward_backward(hooks: bool, autocast: bool = True):
    """The tiny model's loss and backward under bf16 autocast, with the recast hooks (as
    the fibers enter them) or without; what each saved tensor was packed as, and the
    gradients."""
    model = make_model(4, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    packed: list = []

    def pack(t):
        out = cast_copies._pack(t) if hooks else t
        packed.append((out, t.dtype, tuple(t.shape)))
        return out

    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, cast_copies._unpack), amp:
        loss = model.losses((tokens, tokens))["loss"]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return packed, grads, model


def test_every_saved_cast_of_a_weight_is_kept_as_the_weight_and_the_gradients_do_not_change():
    packed, grads, model = _forward_backward(hooks=True)
    recast = [p for p, _, _ in packed if isinstance(p, cast_copies._Recast)]
    params = {id(p): n for n, p in model.named_parameters()}
    names = sorted({params[id(r.param)] for r in recast})
    # the linear layers save a transposed view of their cast weight, the experts the cast itself
    assert any(n.endswith("qkv.weight") for n in names) and any("w_up" in n for n in names), names
    assert any("w_down" in n for n in names) and any(n.endswith("proj.weight") for n in names), names
    # nothing 16-bit the size of a weight is kept as itself: the activations are kept
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
    kept = [(d, s) for p, d, s in packed if isinstance(p, torch.Tensor) and d == torch.bfloat16
            and (s in weight_shapes or s[::-1] in weight_shapes)]
    assert not kept, kept
    assert any(isinstance(p, torch.Tensor) and d == torch.bfloat16 for p, d, _ in packed), "activations stay"
    _, plain, _ = _forward_backward(hooks=False)
    assert grads.keys() == plain.keys()
    for name in grads:
        assert torch.equal(grads[name], plain[name]), name


def test_without_autocast_nothing_is_recast():
    packed, _, _ = _forward_backward(hooks=True, autocast=False)
    assert packed and not any(isinstance(p, cast_copies._Recast) for p, _, _ in packed)


def test_a_cast_of_an_activation_or_a_non_contiguous_weight_is_kept_as_it_is():
    w = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(3, 6, requires_grad=True)
    assert cast_copies._cast_parameter(x.to(torch.bfloat16)) is None  # a leaf, not a parameter
    assert cast_copies._cast_parameter(w.to(torch.bfloat16)) is w
    assert cast_copies._cast_parameter(w.to(torch.bfloat16).t()) is w  # a view of it
    assert cast_copies._cast_parameter(w.t().to(torch.bfloat16)) is None  # cast of a view: not rebuilt
    assert cast_copies._cast_parameter(w.to(torch.float64)) is None  # not a 16-bit cast
    view = w.to(torch.bfloat16).t()[1:]
    assert torch.equal(cast_copies._unpack(cast_copies._pack(view)), view)


def test_a_gradient_of_the_gradient_reaches_the_weight_through_a_recast():
    """Under ``create_graph=True`` the saved cast of a weight is part of the gradient's graph:
    autograd gives the recast the saved cast's place in it, and the second derivative equals
    the saved copy's."""
    def second(hooks: bool):
        w = torch.nn.Parameter(torch.randn(5, 4, generator=torch.Generator().manual_seed(2)))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
        hooked = torch.autograd.graph.saved_tensors_hooks(cast_copies._pack, cast_copies._unpack)
        with hooked if hooks else contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, w)  # saves a transposed view of w's cast
        (gx,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
        (gw,) = torch.autograd.grad(gx.float().square().sum(), w)
        return gw

    plain = second(hooks=False)
    assert plain.abs().sum() > 0  # the weight is on the gradient's path: the check is not vacuous
    assert torch.equal(second(hooks=True), plain)


def _fit_bf16(rank: int, world: int, recast: bool, Rs: tuple[int, ...] = (2,)) -> list[dict]:
    """Zebra, one attention and one expert rank, bf16-mixed, a fit at each R micro-batches
    (the same seed): the recasts each rank's backward made, and the weights after three steps."""
    import lightning_hetermoe.strategy.backends.zebra.backend as zebra_backend

    made = {"n": 0}
    unpack = cast_copies._unpack

    def counting(saved):
        made["n"] += isinstance(saved, cast_copies._Recast)
        return unpack(saved)

    cast_copies._unpack = counting
    if not recast:
        zebra_backend.recast_saved_weights = contextlib.nullcontext
    out = []
    for R in Rs:
        made["n"] = 0
        model = make_model(4, seed=0)
        t = trainer(HeterMoEStrategy(mode="zebra", plan=make_test_plan(2, [0], R=R)), world, max_steps=3,
                    precision="bf16-mixed")
        t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out.append({"recasts": made["n"], "state": {k: v.clone() for k, v in model.state_dict().items()}})
    return out


@pytest.mark.slow
def test_zebra_recasts_on_both_ranks_and_trains_as_with_the_copies_kept():
    """At R = 2 both ranks recast and train as with the casts kept. At R = 1 one micro-batch
    in flight keeps one cast of each weight, as one process does: no hooks, so no recasts
    (they cost a call into Python per saved tensor)."""
    on = run_ranks(2, _fit_bf16, 2, True, (2, 1))
    off = run_ranks(2, _fit_bf16, 2, False)
    # rank 0 attends (its linear layers' weights), rank 1 runs the expert rounds (the experts')
    assert on[0][0]["recasts"] > 0 and on[1][0]["recasts"] > 0, [r[0]["recasts"] for r in on]
    assert off[0][0]["recasts"] == off[1][0]["recasts"] == 0
    for rank in range(2):
        for name, value in on[rank][0]["state"].items():
            assert torch.equal(value, off[rank][0]["state"][name]), (rank, name)
    assert on[0][1]["recasts"] == on[1][1]["recasts"] == 0, [r[1]["recasts"] for r in on]
