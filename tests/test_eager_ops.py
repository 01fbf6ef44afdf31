"""Eager calls of the kernels skip their custom ops' Python layers (``kernels/eager.py``):
the same values and gradients to the bit as through the op, no op on the profiler's
timeline, and under ``torch.compile`` the op is still what the graph holds."""

from __future__ import annotations

import pytest
import torch


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _run(fn, inputs, grad_of):
    """``fn``'s outputs and the gradients of ``inputs`` under a fixed upstream gradient
    (``grad_of``: which output carries it)."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*xs)
    y = out[grad_of] if isinstance(out, tuple) else out
    y.backward(torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape).to(y.dtype))
    return ([o.detach() for o in (out if isinstance(out, tuple) else (out,))],
            [x.grad for x in xs if x.requires_grad])


def _ops_seen(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("lightning_hetermoe::")}


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)  # no gradient (rotary's tables) on both paths alike
        assert x is None or (x.dtype == y.dtype and torch.equal(x, y))


def _eager_and_op(name):
    import importlib

    module = importlib.import_module(f"lightning_hetermoe.kernels.{name}")
    return getattr(module, name), getattr(module, f"{name}_op")


def _inputs(name):
    torch.manual_seed(3)
    if name == "rms_norm":
        return [torch.randn(3, 5, 24), torch.rand(24) + 0.5, 1e-6]
    half = torch.randn(7, 4)
    return [torch.randn(2, 3, 7, 8), torch.cos(half), torch.sin(half)]


@pytest.mark.parametrize("name", ["rms_norm", "rotary"])
def test_an_eager_call_equals_the_op_to_the_bit_and_skips_it(name):
    eager, op = _eager_and_op(name)
    inputs = _inputs(name)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]

    def call(fn):
        return lambda *ts: fn(*ts, *inputs[len(tensors):])

    got, want = _run(call(eager), tensors, 0), _run(call(op), tensors, 0)
    _same(got[0], want[0])
    _same(got[1], want[1])
    assert got[1][0] is not None, "the input's gradient was compared"
    assert _ops_seen(lambda: _run(call(op), tensors, 0)), "the op's own calls are on the timeline"
    assert not _ops_seen(lambda: _run(call(eager), tensors, 0)), "the eager call went through the op"


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_the_expert_mlp_eagerly_equals_its_op_to_the_bit(backend):
    """Both expert backends' MLPs: output and every gradient (input, weights, biases) the same
    through the eager ``autograd.Function`` as through the op, and no op on the timeline."""
    from lightning_hetermoe.kernels import grouped_mm, mlp

    module = {"triton": mlp, "grouped_mm": grouped_mm}[backend]
    op = {"triton": mlp.grouped_mlp_op, "grouped_mm": grouped_mm.grouped_mm_mlp_op}[backend]
    from lightning_hetermoe.configs import MoEConfig
    from lightning_hetermoe.moe import MoELayer

    torch.manual_seed(4)
    experts = MoELayer(8, MoEConfig(num_experts=3, top_k=1, d_ff=8, activation="swiglu", bias=True,
                                    expert_backend="torch")).experts
    ps = [experts.w_up.detach(), torch.randn_like(experts.b_up), experts.w_down.detach(),
          torch.randn_like(experts.b_down)]
    counts = torch.tensor([4, 0, 5])
    x, idx = torch.randn(6, 8), torch.randint(0, 6, (9,))

    def through(fn):
        return lambda x, *ps: fn(x, idx, counts, *ps, "swiglu", False)

    got, want = _run(through(module.mlp_eager), [x, *ps], 0), _run(through(op), [x, *ps], 0)
    _same(got[0], want[0])
    _same(got[1], want[1])
    assert len(got[1]) == 1 + len(ps)
    assert not _ops_seen(lambda: _run(through(module.mlp_eager), [x, *ps], 0))
    assert module.grouped_mlp(x, idx, counts, *ps, "swiglu").shape == got[0][0].shape


def test_under_torch_compile_the_graph_holds_the_op():
    """What dynamo traces is the custom op (opaque, with its fake), not the kernel launch."""
    from lightning_hetermoe.kernels import rms_norm

    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x, w = torch.randn(4, 24), torch.rand(24) + 0.5
    compiled = torch.compile(lambda x, w: rms_norm.rms_norm(x, w, 1e-6)[0] * 2, backend=backend, fullgraph=True)
    torch._dynamo.reset()
    y = compiled(x, w)
    assert any("lightning_hetermoe.rms_norm" in s for s in seen), seen
    assert torch.equal(y, rms_norm.rms_norm(x, w, 1e-6)[0] * 2)


def test_the_overhead_bench_times_both_paths_on_the_cpu(capsys):
    """``bench/op_overhead.py`` on the CPU: the stand-in op and the grouped_mm MLP, each
    through the op and eagerly, and the torch loop's Function with a separate setup_context
    beside its ctx-style one: a figure for both and their ratio."""
    from helpers_bench import load_bench

    result = load_bench("op_overhead").main(["--calls", "3", "--repeats", "1", "--rows", "16"])
    assert set(result["ops"]) == {"stand-in scale", "grouped_mm mlp", "torch loop mlp"}
    for row in result["ops"].values():
        assert row["op_us"] > 0 and row["eager_us"] > 0
        # the ratio is printed to 3 decimals, the microseconds to 2: a small ratio (a first
        # eager call that paid a warm-up, 3 calls) is off by its rounding, not 1% of itself
        assert row["op_over_eager"] == pytest.approx(row["op_us"] / row["eager_us"], rel=1e-2, abs=1e-3)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("{")
