"""The clipping norm's arithmetic against a naive float64 reference, and what it allocates.

The reference is what the backends computed before: each gradient copied to float64,
squared and summed. The norm must agree with it in every dtype as closely as an fp32
reduction of a chunk can (each tensor's norm in fp32, as Lightning's own clipping takes
it), and must not copy a gradient to do so: no operation of the norm may allocate more
elements than there are tensors, or chunks of them on the CPU (the reference allocates two
float64 copies of each)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hetermoe.strategy.grad_norm import CPU_CHUNK, scale_, squared_norm, squared_row_norms


# an fp32 reduction of a few thousand elements, against the float64 sum
FP32_SUM = 2e-5


def reference(tensors) -> float:
    return float(sum(t.double().square().sum() for t in tensors if t is not None))


class LargestAllocation(TorchDispatchMode):
    """The most elements any operation allocated (outputs that alias no input: views and
    in-place results are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        for ret, value in zip(func._schema.returns, outs if len(func._schema.returns) == len(outs) else [outs]):
            fresh = value if isinstance(value, (list, tuple)) else [value]
            if ret.alias_info is None:
                for t in fresh:
                    if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                        self.largest = t.numel()
        self.ops.append(str(func))
        return out


def grads(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(257, 129), (3000,), (8, 33, 17), (1,), (0, 5)]
    out: list[torch.Tensor | None] = [(torch.randn(s, generator=g) * 3).to(dtype) for s in shapes]
    return out[:2] + [None] + out[2:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_squared_norm_equals_the_float64_reference(dtype):
    ts = grads(dtype)
    got = squared_norm(ts, "cpu")
    assert got.dtype == torch.float64 and got.dim() == 0
    assert got.item() == pytest.approx(reference(ts), rel=FP32_SUM)


def test_mixed_dtypes_and_nothing_at_all():
    ts = grads(torch.float32) + grads(torch.bfloat16, seed=1)
    assert squared_norm(ts, "cpu").item() == pytest.approx(reference(ts), rel=FP32_SUM)
    empty = squared_norm([None, torch.zeros(0)], "cpu")
    assert empty.item() == 0.0 and empty.dtype == torch.float64


def test_large_gradients_stay_within_float64_rounding_of_the_reference():
    # 16.7M elements: one fp32 pass over the whole tensor drifts by ~1e-4 on the CPU (7% at
    # 268M); cut into chunks it does not
    g = torch.randn(1 << 24, generator=torch.Generator().manual_seed(3)) * 1e-3 + 1e-3
    h = torch.randn(300, 70, generator=torch.Generator().manual_seed(5))
    assert squared_norm([g, h], "cpu").item() == pytest.approx(reference([g, h]), rel=1e-6)
    w = g[: 1 << 22].view(2, 1 << 21)  # two expert slots of 2M elements each
    torch.testing.assert_close(squared_row_norms(w), w.double().square().sum(1), rtol=1e-6, atol=0)


def test_row_norms_equal_the_reference_per_expert_slot():
    w = torch.randn(6, 17, 9, generator=torch.Generator().manual_seed(4))
    got = squared_row_norms(w)
    want = w.double().square().reshape(6, -1).sum(1)
    assert got.dtype == torch.float64 and got.shape == (6,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_the_norm_copies_no_gradient():
    ts = [torch.randn(4096, 64), torch.randn(512, 512), torch.randn(10)]
    with LargestAllocation() as mode:
        squared_norm(ts, "cpu")
    # one value per tensor, or on the CPU per chunk of CPU_CHUNK elements
    assert mode.largest <= sum(-(-t.numel() // CPU_CHUNK) for t in ts), (mode.largest, mode.ops)
    with LargestAllocation() as old:  # the check can fail: the reference writes full copies
        reference(ts)
    assert old.largest == 512 * 512


def test_scale_multiplies_in_place_in_each_tensors_dtype():
    ts = [torch.randn(50, 3), torch.randn(7).to(torch.bfloat16), None, torch.randn(4, 4)]
    before = [t.clone() if t is not None else None for t in ts]
    coef = torch.tensor(0.37, dtype=torch.float64)
    ids = [id(t) for t in ts]
    scale_(ts, coef)
    assert [id(t) for t in ts] == ids
    for t, b in zip(ts, before):
        if t is None:
            continue
        assert t.dtype == b.dtype
        assert torch.equal(t, b * coef.to(b.dtype))


def test_a_torch_without_the_norms_dtype_argument_upcasts_16_bit_gradients(monkeypatch):
    ts = grads(torch.bfloat16)
    want = squared_norm(ts, "cpu").item()
    real = torch._foreach_norm

    def without_dtype(tensors, ord=2, **kwargs):
        if kwargs:
            raise TypeError("_foreach_norm() got an unexpected keyword argument 'dtype'")
        return real(tensors, ord)

    monkeypatch.setattr(torch, "_foreach_norm", without_dtype)
    assert squared_norm(ts, "cpu").item() == pytest.approx(want, rel=1e-6)


def test_a_sparse_gradient_counts_its_summed_rows():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2, 2, 7])).pow(2).sum().backward()  # row 2 twice: uncoalesced
    g = emb.weight.grad
    assert g.is_sparse and not g.is_coalesced()
    want = float(g.to_dense().double().square().sum())
    assert squared_norm([g, torch.ones(3)], "cpu").item() == pytest.approx(want + 3, rel=1e-6)
    scale_([g], torch.tensor(0.5, dtype=torch.float64))
    assert float(g.to_dense().double().square().sum()) == pytest.approx(want / 4, rel=1e-6)
