"""The LM head's cross-entropy a chunk of tokens at a time (``model/loss.py``), against the
naive ``F.cross_entropy(F.linear(h, W).float(), t)``: the value and both gradients, in fp32,
under bf16 autocast and under an fp16 loss scale; and what it holds at once."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hetermoe.configs import ConfigError, ModelConfig
from lightning_hetermoe.model.loss import linear_cross_entropy
from reference import make_model

V, D = 50, 16


def case(seed: int = 0, shape=(3, 20), ignored: int = 5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) / 4).requires_grad_()
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[:ignored] = -100
    return h, w, t


def naive(h, w, t):
    return F.cross_entropy(F.linear(h, w).float().reshape(-1, V), t.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 7, 60, 1000])
def test_every_chunking_gives_the_naive_loss_and_both_gradients_in_fp32(chunk):
    h, w, t = case()
    want = naive(h, w, t)
    gh, gw = torch.autograd.grad(want * 2.5, [h, w])
    got = linear_cross_entropy(h, w, t, chunk=chunk)
    gh2, gw2 = torch.autograd.grad(got * 2.5, [h, w])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh2, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw2, gw, rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_it_stays_with_the_naive_loss_and_the_fp32_truth():
    h, w, t = case(1)
    truth = naive(h, w, t)
    gh, gw = torch.autograd.grad(truth, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = naive(h, w, t)
        got = linear_cross_entropy(h, w, t, chunk=16)
    rh, rw = torch.autograd.grad(ref, [h, w])
    bh, bw = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32 and bh.dtype == h.dtype and bw.dtype == w.dtype

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    # as close to the fp32 truth as the naive bf16 path is (bf16 rounding at other points)
    assert abs(float(got.detach() - truth.detach())) < 1e-2 and abs(float(ref.detach() - truth.detach())) < 1e-2
    for mine, theirs, true in ((bh, rh, gh), (bw, rw, gw)):
        assert rel(mine, true) < 1e-2 and rel(mine, theirs) < 1e-2, (rel(mine, true), rel(theirs, true))


def test_a_loss_scale_reaches_the_gradients_as_the_naive_path_gives_them():
    # fp16 loss scaling: the gradients kept are unscaled, the backward multiplies them
    h, w, t = case(2)
    scale = 2.0 ** 16
    gh, gw = torch.autograd.grad(naive(h, w, t) * scale, [h, w])
    sh, sw = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk=9) * scale, [h, w])
    torch.testing.assert_close(sh, gh, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(sw, gw, rtol=1e-5, atol=1e-3)


def test_only_the_inputs_that_want_a_gradient_get_one_and_no_grad_only_computes_the_loss():
    h, w, t = case(3)
    frozen = w.detach()
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, frozen, t, chunk=8), [h])
    (want,) = torch.autograd.grad(naive(h, frozen, t), [h])
    torch.testing.assert_close(gh, want, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        value = linear_cross_entropy(h, w, t, chunk=8)
    assert not value.requires_grad
    torch.testing.assert_close(value, naive(h, w, t).detach(), rtol=1e-6, atol=1e-6)


def test_every_target_ignored_gives_nan_as_cross_entropy_does():
    h, w, t = case(4)
    t.fill_(-100)
    assert math.isnan(float(linear_cross_entropy(h, w, t).detach())) and math.isnan(float(naive(h, w, t).detach()))


def test_bad_arguments_are_refused_naming_them():
    h, w, t = case()
    with pytest.raises(ValueError, match="chunk=0"):
        linear_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:, :-1])
    with pytest.raises(ConfigError, match="model.loss_chunk_tokens"):
        ModelConfig(loss_chunk_tokens=0)


class Largest(TorchDispatchMode):
    """The largest tensor any operation allocated (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel() * o.element_size())
        return out


def test_no_tensor_holds_more_than_one_chunk_of_logits():
    g = torch.Generator().manual_seed(5)
    n, vocab, chunk = 2048, 512, 128
    h = torch.randn(n, D, generator=g).requires_grad_()
    w = (torch.randn(vocab, D, generator=g) / 4).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    with Largest() as chunked:
        linear_cross_entropy(h, w, t, chunk=chunk).backward()
    with Largest() as whole:
        F.cross_entropy(F.linear(h, w).float(), t).backward()
    assert whole.largest >= n * vocab * 4  # every token's fp32 logits at once
    # one chunk's fp32 logits, or the head's own gradient (the weight's size), at most
    assert chunked.largest <= max(chunk * vocab * 4, vocab * D * 4), chunked.largest


def test_the_model_s_loss_is_the_naive_loss_of_its_logits_with_every_gradient():
    model = make_model(4)
    tokens = torch.randint(0, model.model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    targets = tokens.roll(-1, 1)
    targets[0, :3] = -100
    torch.manual_seed(7)  # the routers' jitter draws alike in both forwards
    out = model.losses((tokens, targets))
    mine = torch.autograd.grad(out["ce"], list(model.parameters()), allow_unused=True)
    torch.manual_seed(7)
    logits, _ = model.model(tokens)
    want = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    theirs = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(out["ce"], want, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), mine, theirs, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=name)



@pytest.fixture
def fused_on_cpu(monkeypatch, triton_interpreter):
    """The cross-entropy kernel wherever the loss runs (the CPU here, through Triton's
    interpreter), as CUDA takes it."""
    from lightning_hetermoe.kernels import cross_entropy

    calls = []

    def everywhere(logits):
        calls.append(logits.shape)
        return True

    monkeypatch.setattr(cross_entropy, "runs_fused", everywhere)
    return calls


@pytest.mark.parametrize("chunk", [7, 1000])
def test_the_cross_entropy_kernel_gives_the_naive_loss_and_both_gradients(fused_on_cpu, chunk):
    """On the kernel (each row's loss, softmax - onehot in place of the logits): the naive
    loss and both gradients in fp32, over a vocabulary that spans the kernel's blocks and
    a partial one, ignored targets and chunks with a short last one; no-grad too."""
    h, w, t = case(5, shape=(3, 20))
    want = naive(h, w, t)
    gh, gw = torch.autograd.grad(want * 2.5, [h, w])
    got = linear_cross_entropy(h, w, t, chunk=chunk)
    gh2, gw2 = torch.autograd.grad(got * 2.5, [h, w])
    assert fused_on_cpu, "the kernel ran"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh2, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw2, gw, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk=chunk), want.detach(), rtol=1e-6, atol=1e-6)


def test_the_cross_entropy_kernel_under_bf16_autocast(fused_on_cpu):
    """bf16 logits: the kernel forms everything in fp32 from them and rounds the gradient
    once; as close to the fp32 truth as torch's ops on the same logits are."""
    from lightning_hetermoe.kernels import cross_entropy

    h, w, t = case(6)
    truth = naive(h, w, t)
    gh, gw = torch.autograd.grad(truth, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t, chunk=16)
    bh, bw = torch.autograd.grad(got, [h, w])
    with cross_entropy.fused(False), torch.autocast("cpu", dtype=torch.bfloat16):
        ops = linear_cross_entropy(h, w, t, chunk=16)
    oh, ow = torch.autograd.grad(ops, [h, w])

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    assert abs(float(got.detach() - ops.detach())) < 1e-5  # the same bf16 logits, fp32 after
    for mine, theirs, true in ((bh, oh, gh), (bw, ow, gw)):
        assert rel(mine, true) < 1e-2 and rel(mine, theirs) < 1e-2


def test_the_cross_entropy_rows_by_hand(triton_interpreter):
    """The kernel itself: each row's logsumexp - logit[target] and, in place, softmax -
    onehot; large logits (no overflow: the running maximum) and a row of one column."""
    from lightning_hetermoe.kernels import launch

    logits = torch.tensor([[1.0, 2.0, 3.0] + [0.0] * 40, [500.0, -500.0, 499.0] + [-1e4] * 40])
    targets = torch.tensor([2, 0])
    want_loss = torch.logsumexp(logits, 1) - logits[[0, 1], targets]
    want_grad = torch.softmax(logits, 1) - F.one_hot(targets, logits.shape[1])
    got = logits.clone()
    loss = launch.cross_entropy_rows(got, targets, write_grad=True)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(got, want_grad, rtol=1e-6, atol=1e-7)
    kept = logits.clone()
    torch.testing.assert_close(launch.cross_entropy_rows(kept, targets, write_grad=False), want_loss)
    assert torch.equal(kept, logits)
    one = torch.tensor([[3.0]])
    assert float(launch.cross_entropy_rows(one, torch.tensor([0]), True)) == 0.0 and float(one) == 0.0
    from lightning_hetermoe.kernels import cross_entropy

    assert not cross_entropy.runs_fused(logits)  # the CPU keeps torch's ops
    torch.library.opcheck(cross_entropy.cross_entropy_rows, (logits.clone(), targets, True),
                          test_utils=("test_schema", "test_faketensor"))


class HeadSized(TorchDispatchMode):
    """The most bytes that tensors of the head weight's shape held at once (results of
    operations, alive at the time: the weight's copies and its gradient's)."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape, self.alive, self.most = tuple(shape), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape:
                self.alive.append(weakref.ref(t))
        self.alive = [r for r in self.alive if r() is not None]
        held = {r().untyped_storage().data_ptr(): r().untyped_storage().nbytes() for r in self.alive}
        self.most = max(self.most, sum(held.values()))
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_the_memory_model_prices_every_head_sized_tensor_the_loss_holds(autocast):
    """The head's loss holds tensors of the head weight's size (its 16-bit cast, the fp32
    gradient it sums and each chunk's share before it is added, that gradient scaled): at
    no point more than the memory model's HEAD_GRAD_BYTES per entry."""
    from lightning_hetermoe.profile.memory import HEAD_GRAD_BYTES

    h, w, t = case(7)
    assert tuple(w.shape) == (V, D) and D != 7  # no chunk-sized [V, chunk] tensor takes the head's shape
    with HeadSized(w.shape) as seen, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(h, w, t, chunk=7)
    with HeadSized(w.shape) as seen_backward:
        loss.backward()
    most = max(seen.most, seen_backward.most)
    assert w.numel() * 4 <= most <= w.numel() * HEAD_GRAD_BYTES, (most, w.numel())
