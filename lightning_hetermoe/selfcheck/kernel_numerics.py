"""The Triton expert MLP against the pure-torch path in fp32/bf16/fp16 (output and every
gradient), and one grouped GEMM over 4.5M rows against torch. The Triton path takes the
fused SwiGLU kernels where it runs them (CUDA); the reference keeps torch's ops, so those
kernels are checked too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .report import Context, Failed, Skip, joined

# Largest |triton - reference| over the largest |reference|, per tensor. The reference is
# grouped_mlp_torch in fp32 on the same (rounded) inputs, so the bound is the dtype's own
# rounding: fp32 allows for a different summation order; bf16 keeps 8 mantissa bits,
# fp16 11, and each gradient passes through two to three roundings in that dtype.
KERNEL_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class KernelCase:
    name: str
    counts: list[int]  # rows per expert
    activation: str
    tokens: int  # rows of x; gather_idx repeats them as top-k routing does


@dataclass
class KernelShapes:
    d_model: int
    d_ff: int
    cases: list[KernelCase] = field(default_factory=list)


def kernel_shapes(ctx: Context) -> KernelShapes:
    # d_model and d_ff are not multiples of the interpreter's blocks (16/32) nor of the
    # GPU's, so partial tiles are exercised; counts are not multiples of BLOCK_M.
    if ctx.cuda:
        d_model, d_ff, large = (96, 160, 2048) if ctx.quick else (200, 344, 8192)
    else:
        d_model, d_ff, large = (40, 24, 96) if ctx.quick else (72, 56, 512)
    ragged_large = [large * w // 16 for w in (1, 5, 3, 7)]
    ragged_large[-1] += large - sum(ragged_large)
    cases = [KernelCase("ragged", [7, 19, 11, 30], "swiglu", 41),
             KernelCase("one-empty", [9, 0, 21], "gelu", 23),
             KernelCase("single", [37], "swiglu", 29),
             KernelCase(f"large M={large}", ragged_large, "gelu", large // 2)]
    return KernelShapes(d_model, d_ff, cases)


GRAD_NAMES = ("x", "w_up", "b_up", "w_down", "b_down")


def _kernel_inputs(case: KernelCase, shapes: KernelShapes, dtype: torch.dtype, device: torch.device,
                   seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w_up, b_up, w_down, b_down)`` in ``dtype``, gather_idx, counts, upstream gradient."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, d, f = len(case.counts), shapes.d_model, shapes.d_ff
    h = 2 * f if case.activation == "swiglu" else f

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    tensors = [randn(case.tokens, d), randn(E, d, h, scale=d ** -0.5), randn(E, h, scale=0.1),
               randn(E, f, d, scale=f ** -0.5), randn(E, d, scale=0.1)]
    counts = torch.tensor(case.counts, dtype=torch.long, device=device)
    M = sum(case.counts)
    gather_idx = torch.randint(0, case.tokens, (M,), device=device, generator=g)
    upstream = randn(M, d)
    return tensors, gather_idx, counts, upstream


def _forward_backward(fn: Callable, tensors: list[torch.Tensor], gather_idx: torch.Tensor, counts: torch.Tensor,
                      upstream: torch.Tensor, activation: str) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    x, w_up, b_up, w_down, b_down = leaves
    y = fn(x, gather_idx, counts, w_up, b_up, w_down, b_down, activation)
    y.backward(upstream.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().clamp_min(1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


def _compare_case(case: KernelCase, shapes: KernelShapes, dtype: torch.dtype, ctx: Context, seed: int,
                  backend: str = "triton") -> tuple[float, float, list[str]]:
    """The case's worst relative error, the torch path's own in ``dtype`` (what rounding alone
    costs, for scale), and what broke the contract outright."""
    from ..kernels import grouped_mlp, grouped_mlp_grouped_mm, swiglu
    from ..moe import grouped_mlp_torch

    tensors, gather_idx, counts, upstream = _kernel_inputs(case, shapes, dtype, ctx.device, seed)
    subject = grouped_mlp if backend == "triton" else grouped_mlp_grouped_mm
    got_y, got_grads = _forward_backward(subject, tensors, gather_idx, counts, upstream, case.activation)
    with swiglu.fused(False):  # the reference on torch's ops alone
        want_y, want_grads = _forward_backward(grouped_mlp_torch, [t.float() for t in tensors], gather_idx, counts,
                                               upstream.float(), case.activation)
        torch_y, torch_grads = _forward_backward(grouped_mlp_torch, tensors, gather_idx, counts, upstream,
                                                 case.activation)
    expected = [want_y, *want_grads]
    own = max(_relative_error(a, b) for a, b in zip([torch_y, *torch_grads], expected) if a is not None)
    problems, worst = [], 0.0
    for what, got, want in zip(("output", *GRAD_NAMES), [got_y, *got_grads], expected):
        if got is None:
            problems.append(f"{case.name}: no gradient for {what}")
            continue
        if got.shape != want.shape or got.dtype != dtype:
            problems.append(f"{case.name}: {what} is {got.dtype} {tuple(got.shape)}, want {dtype} "
                            f"{tuple(want.shape)}")
            continue
        err = _relative_error(got, want)
        worst = max(worst, err)
        if not err <= KERNEL_TOL[dtype]:  # also catches NaN
            problems.append(f"{case.name}: {what} off by {err:.1e} (tol {KERNEL_TOL[dtype]:.0e})")
    for e in (e for e, n in enumerate(case.counts) if n == 0):
        # an expert without rows must get exact zeros, not whatever was in the buffer
        dw_up, dw_down = got_grads[1], got_grads[3]
        if dw_up is not None and dw_down is not None and (dw_up[e].abs().max() != 0 or dw_down[e].abs().max() != 0):
            problems.append(f"{case.name}: expert {e} has no rows but a non-zero weight gradient")
    return worst, own, problems


def check_kernels(dtype: torch.dtype, backend: str = "triton") -> Callable[[Context], str]:
    """The ``backend``'s expert MLP (``triton``, or ``grouped_mm``: what ``auto`` takes on an
    H100) against the torch loop on torch's ops."""
    def check(ctx: Context) -> str:
        from ..kernels import grouped_mm_unavailable_reason, unavailable_reason

        why = unavailable_reason(ctx.device) if backend == "triton" else grouped_mm_unavailable_reason(ctx.device)
        if why:
            raise Skip(why)
        if dtype == torch.bfloat16 and ctx.cuda and torch.cuda.get_device_capability(ctx.device) < (8, 0):
            raise Skip("bf16 needs compute capability >= 8.0")
        shapes = kernel_shapes(ctx)
        worst, own, problems = 0.0, 0.0, []
        for seed, case in enumerate(shapes.cases):
            err, torch_err, found = _compare_case(case, shapes, dtype, ctx, seed, backend)
            worst, own, problems = max(worst, err), max(own, torch_err), problems + found
        where = "GPU" if ctx.cuda else "interpreter" if backend == "triton" else "CPU"
        detail = (f"{len(shapes.cases)} cases ({', '.join(c.name for c in shapes.cases)}), d_model "
                  f"{shapes.d_model}, d_ff {shapes.d_ff}, {where}: worst error {worst:.1e} vs fp32 "
                  f"(tol {KERNEL_TOL[dtype]:.0e}; torch path in {DTYPE_NAMES[dtype]}: {own:.1e})")
        if problems:
            raise Failed(joined(problems) + "; " + detail)
        return detail

    return check


def check_kernels_tma(ctx: Context) -> str:
    """The Triton expert MLP in bf16 with its operands loaded by TMA descriptor
    (``kernels.tuning.tma_loads``: off by default until a GPU has timed it) against the
    torch loop: the ragged descriptors' bounds on this GPU's copy engine."""
    from ..kernels import tuning

    with tuning.tma_loads(True):
        if ctx.cuda and not tuning.uses_tma("cuda", torch.cuda.get_device_capability(ctx.device)):
            raise Skip("TMA is NVIDIA's copy engine, from compute capability 9.0 (Hopper) on")
        return "TMA loads: " + check_kernels(torch.bfloat16)(ctx)


LARGE_ROWS = 4_500_000  # past 65535 row tiles of 64: where a grid axis other than 0 stops launching


def check_large_gemm(ctx: Context) -> str:
    """One grouped GEMM over 4.5M rows (reachable in data-centric mode, where every rank runs
    every expert on its tokens) against torch, expert by expert."""
    from ..kernels import unavailable_reason
    from ..kernels.launch import grouped_gemm

    why = unavailable_reason(ctx.device)
    if why:
        raise Skip(why)
    E, K, N = 4, 64, 64
    g = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(LARGE_ROWS, K, device=ctx.device, dtype=torch.float16, generator=g)
    w = torch.randn(E, K, N, device=ctx.device, dtype=torch.float16, generator=g) / K ** 0.5
    counts = torch.tensor([LARGE_ROWS // 2, LARGE_ROWS // 4, 0, LARGE_ROWS - 3 * (LARGE_ROWS // 4)],
                          device=ctx.device, dtype=torch.int64)
    out = grouped_gemm(x, w, counts)
    worst, start = 0.0, 0
    for e, n in enumerate(counts.tolist()):
        want = x[start:start + n].float() @ w[e].float()
        if n:
            worst = max(worst, _relative_error(out[start:start + n].float(), want))
        start += n
    detail = f"{LARGE_ROWS:,} rows over {E} experts (one without rows), fp16: worst error {worst:.1e} vs fp32"
    if not worst <= KERNEL_TOL[torch.float16]:
        raise Failed(detail)
    return detail


def _sixteen_bits(ctx: Context) -> tuple[torch.dtype, torch.Generator]:
    """A fused kernel's check: skipped where the kernels cannot run; its dtype (bf16, or
    fp16 below sm80) and a seeded generator on the device."""
    from ..kernels import unavailable_reason

    why = unavailable_reason(ctx.device)
    if why:
        raise Skip(why)
    old_gpu = ctx.cuda and torch.cuda.get_device_capability(ctx.device) < (8, 0)
    return (torch.float16 if old_gpu else torch.bfloat16), torch.Generator(device=ctx.device).manual_seed(0)


def check_cross_entropy(ctx: Context) -> str:
    """The LM head's cross-entropy kernel (each row's loss, then softmax - onehot over the
    logits in their own dtype) against torch's fp32 log-softmax of the same logits: a
    chunk of D1's shape on a GPU (2048 tokens of a 32K vocabulary, bf16 where the device
    has it), a small one in the interpreter."""
    from ..kernels.launch import cross_entropy_rows

    dtype, g = _sixteen_bits(ctx)
    rows, vocab = (2048, 32768) if ctx.cuda else (24, 1000)
    logits = (torch.randn(rows, vocab, device=ctx.device, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=ctx.device, generator=g)
    logp = torch.log_softmax(logits.float(), dim=-1)
    want_loss = -logp.gather(1, targets[:, None]).squeeze(1)
    want_grad = logp.exp().scatter_add_(1, targets[:, None], torch.full_like(logp[:, :1], -1.0))
    got = logits.clone()
    loss = cross_entropy_rows(got, targets, write_grad=True)
    loss_err = _relative_error(loss, want_loss)
    grad_err = float((got.float() - want_grad).norm() / want_grad.norm())
    rounding = float((want_grad.to(dtype).float() - want_grad).norm() / want_grad.norm())
    detail = (f"{rows} x {vocab} {DTYPE_NAMES[dtype]} logits: loss {loss_err:.1e} from torch's fp32 log-softmax "
              f"(tol 1e-5), softmax - onehot {grad_err:.1e} (its {DTYPE_NAMES[dtype]} rounding {rounding:.1e}; tol "
              f"{KERNEL_TOL[dtype]:.0e})")
    if not (loss_err <= 1e-5 and grad_err <= KERNEL_TOL[dtype]):  # also catches NaN
        raise Failed(detail)
    return detail


def check_rms_norm(ctx: Context) -> str:
    """The model's RMSNorm on its kernels against torch's ops (the output and the gradients
    of the input and the weight): 16K tokens of width 1024 in bf16 with an fp32 weight, as
    under bf16-mixed, on a GPU; a small case in the interpreter."""
    from ..kernels import rms_norm
    from ..model.transformer import RMSNorm

    dtype, g = _sixteen_bits(ctx)
    rows, width = (16384, 1024) if ctx.cuda else (21, 40)
    norm = RMSNorm(width).to(ctx.device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, device=ctx.device, generator=g) + 0.5)
    x = (torch.randn(rows, width, device=ctx.device, generator=g) * 2).to(dtype)
    up = torch.randn(rows, width, device=ctx.device, generator=g)

    def run(fused: bool):
        xx = x.clone().requires_grad_()
        norm.weight.grad = None
        with rms_norm.fused(fused):
            if fused and not ctx.cuda:  # the interpreter: the kernels where CUDA would take them
                y = rms_norm.rms_norm(xx, norm.weight, norm.eps)[0]
            else:
                y = norm(xx)
        y.backward(up.to(y.dtype))
        return [y.detach(), xx.grad, norm.weight.grad.clone()]

    got, want = run(True), run(False)
    errs = [_relative_error(a, b) for a, b in zip(got, want)]
    detail = (f"{rows} x {width} {DTYPE_NAMES[dtype]}, fp32 weight: output {errs[0]:.1e}, input gradient "
              f"{errs[1]:.1e}, weight gradient {errs[2]:.1e} from torch's ops (tol {KERNEL_TOL[dtype]:.0e})")
    if not all(e <= KERNEL_TOL[dtype] for e in errs) or got[0].dtype != want[0].dtype:
        raise Failed(detail)
    return detail


def check_rotary(ctx: Context) -> str:
    """The attention's rotary embedding on its kernel against torch's ops (the output and
    the gradient): 8 sequences of 2048 positions, 16 heads of 64, bf16, laid out as the
    attention lays them, on a GPU; a small case in the interpreter."""
    from ..kernels import rotary
    from ..model.transformer import apply_rotary, rotary_tables

    dtype, g = _sixteen_bits(ctx)
    B, S, H, D = (8, 2048, 16, 64) if ctx.cuda else (2, 11, 3, 12)
    cos, sin = rotary_tables(S, D, ctx.device)
    x = torch.randn(B, S, H, D, device=ctx.device, generator=g).to(dtype)
    up = torch.randn(B, H, S, D, device=ctx.device, generator=g)

    def run(fused: bool):
        xx = x.clone().requires_grad_()
        with rotary.fused(fused):
            q = xx.transpose(1, 2)
            y = rotary.rotary(q, cos, sin) if fused and not ctx.cuda else apply_rotary(q, cos, sin)
        y.backward(up.to(y.dtype))
        return [y.detach(), xx.grad]

    errs = [_relative_error(a, b) for a, b in zip(run(True), run(False))]
    detail = (f"[{B}, {H}, {S}, {D}] {DTYPE_NAMES[dtype]}: output {errs[0]:.1e}, gradient {errs[1]:.1e} from "
              f"torch's ops (tol {KERNEL_TOL[dtype]:.0e})")
    if not all(e <= KERNEL_TOL[dtype] for e in errs):
        raise Failed(detail)
    return detail
