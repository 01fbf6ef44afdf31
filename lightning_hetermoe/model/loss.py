"""The LM head and its cross-entropy, a chunk of tokens at a time.

``F.cross_entropy(head(h).float(), targets)`` holds every token's logits at once: the head's
output (2 bytes per token and vocabulary entry under mixed precision), its fp32 copy (4),
the log-softmax the backward keeps (4) and, in the backward, the fp32 gradient and its
cast (6). For a 16K-token micro-batch of a 32K vocabulary that is over 7 GB, growing with
the micro-batch; the memory model plans with one chunk (``ModelConfig.loss_chunk_tokens``)
of 6 bytes per entry. :func:`linear_cross_entropy` keeps to that: for ``chunk`` tokens at a
time it forms the logits and, in one pass from them, their fp32 log-probabilities (the
loss reads the targets' entries) and, where a gradient is wanted, the softmax minus the
one-hot target in place of those and both of the head's gradient GEMMs at once (the
fused-linear-cross-entropy idea), so the backward only scales what the forward left: no
GEMM runs twice, and nothing of a chunk outlives it but its share of the two gradients
(the hidden states', the size of ``h``; the head's, the size of its weight, summed over the
chunks in fp32). Besides the GEMMs' own traffic, ``bench/loss.py`` counts 34 bytes per
token and vocabulary entry here against the whole-logits loss's 38 under bf16 on the CPU,
whose log-softmax copies its 16-bit input to fp32 first (CUDA's reads it as it is: 6
fewer here, none fewer there, where the whole-logits loss copies the logits itself).

On a CUDA device each chunk's rows (their loss, then the softmax minus the one-hot target
in place of the logits) run on one Triton kernel (``kernels/cross_entropy.py``): two
reads of the logits and one write, 6 bytes at 16 bits, beside the GEMM's write of them.

The gradients are kept unscaled (``softmax - onehot``, entries within [-1, 1], well inside
fp16's range) and multiplied in the backward by the incoming gradient over the number of targets:
under fp16 loss scaling the values the GEMMs see are those of an unscaled loss, neither
underflowing nor scaled into overflow. The GEMMs run in the caller's autocast dtype (the
weight cast once per call), as the head's own ``nn.Linear`` would.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import cross_entropy


DEFAULT_LOSS_CHUNK = 4096  # ModelConfig.loss_chunk_tokens's default


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                         chunk: int = DEFAULT_LOSS_CHUNK) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=...)``
    (the mean over targets that are not ``ignore_index``; NaN where there are none, as
    there), ``chunk`` tokens at a time. ``hidden`` ``[..., d]``, ``weight`` ``[V, d]``,
    ``targets`` the shape of ``hidden`` without its last dimension."""
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy chunk={chunk!r} is invalid: must be >= 1 (tokens per chunk)")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must have the hidden states' shape without their last "
                         f"dimension {tuple(hidden.shape[:-1])}")
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk, wants_grad)


def _compute_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head's ``nn.Linear`` would run in here: autocast's, else the weight's."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk: int,
                wants_grad: bool) -> Tensor:
        compute = _compute_dtype(hidden, weight)
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        kept = t != ignore_index
        safe = torch.where(kept, t, torch.zeros_like(t))  # an index a gather can read; its row counts zero
        w = weight.to(compute)  # once, not per chunk
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if wants_grad and hidden.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if wants_grad and weight.requires_grad else None
        with torch.autocast(h.device.type, enabled=False):  # the dtypes are explicit from here
            for lo in range(0, h.shape[0], chunk):
                hc, tc, kc = h[lo:lo + chunk].to(compute), safe[lo:lo + chunk], kept[lo:lo + chunk]
                logits = torch.mm(hc, w.t())
                if cross_entropy.runs_fused(logits):
                    # each row's loss and, in place of the logits, softmax - onehot: one kernel
                    total += (cross_entropy.cross_entropy_rows(logits, tc, wants_grad) * kc).sum()
                    if not wants_grad:
                        continue
                    g = logits
                else:
                    # one pass from the head's output to fp32 log-probabilities (no fp32 copy of the logits)
                    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
                    del logits
                    total -= (logp.gather(1, tc[:, None]).squeeze(1) * kc).sum()
                    if not wants_grad:
                        continue
                    # softmax - onehot, in place of the log-probabilities
                    g = logp.exp_().scatter_add_(1, tc[:, None], torch.full_like(logp[:, :1], -1.0)).to(compute)
                    del logp
                # an ignored row's share is taken out of the GEMMs' [chunk, d] operands, not out
                # of this [chunk, V] one
                keep = kc[:, None].to(compute)
                if grad_h is not None:
                    grad_h[lo:lo + chunk] = torch.mm(g, w) * keep
                if grad_w is not None:
                    grad_w += torch.mm(g.t(), hc * keep)
        count = kept.sum().to(torch.float32)
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None), count)
        ctx.layout = (hidden.shape, grad_h is not None, grad_w is not None)
        return total / count

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        shape, has_h, has_w = ctx.layout
        saved = list(ctx.saved_tensors)
        scale = grad_out.float() / saved.pop()
        grad_h = (saved.pop(0) * scale).reshape(shape) if has_h else None
        grad_w = saved.pop(0) * scale if has_w else None
        return grad_h, grad_w, None, None, None, None
