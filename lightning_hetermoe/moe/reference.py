"""Naive per-token MoE, written for clarity and used only by tests.

It reads the same parameters as :class:`~.layer.MoELayer` and draws router noise with the
same calls in the same order, so that under one seed both must agree to fp32 rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .layer import MoELayer


def reference_routing(layer: MoELayer, x: Tensor) -> tuple[list[list[int]], list[list[Tensor]], Tensor, Tensor]:
    """Per-token choices and weights, plus all-expert probs and clean logits (for losses)."""
    cfg, router = layer.cfg, layer.router
    xf = x.float()
    E, k = cfg.num_experts, cfg.top_k
    if cfg.router == "switch" and router.training and cfg.jitter_eps > 0:
        xf = xf * torch.empty_like(xf).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
    w = router.weight.float()
    clean = torch.stack([w @ xf[t] for t in range(x.shape[0])])
    noisy = clean
    if cfg.router == "noisy_topk" and router.training:
        std = torch.stack([F.softplus(router.noise_weight.float() @ xf[t]) for t in range(x.shape[0])])
        noisy = clean + torch.randn_like(clean) * std
    gshard_u = torch.rand(x.shape[0]) if (cfg.router == "gshard" and router.training) else None

    choices, weights = [], []
    for t in range(x.shape[0]):
        probs = torch.softmax(noisy[t], 0)
        order = sorted(range(E), key=lambda e: (-float(noisy[t][e].detach()), e))[:k]
        if cfg.router == "noisy_topk":
            sel = torch.stack([noisy[t][e] for e in order])
            ws = list(torch.softmax(sel, 0))
        elif cfg.router == "switch":
            ws = [probs[order[0]]]
        else:
            sel = torch.stack([probs[e] for e in order])
            ws = list(sel / sel.sum()) if cfg.normalize_topk else list(sel)
        keep = [True] * k
        if gshard_u is not None:
            keep[1] = bool(gshard_u[t] < 2.0 * float(ws[1].detach()))
        choices.append([e if kp else -1 for e, kp in zip(order, keep)])
        weights.append(ws)

    if cfg.capacity_factor > 0:
        cap = math.ceil(cfg.capacity_factor * x.shape[0] * k / E)
        used = [0] * E
        for j in range(k):
            for t in range(x.shape[0]):
                e = choices[t][j]
                if e < 0:
                    continue
                if used[e] < cap:
                    used[e] += 1
                else:
                    choices[t][j] = -1
    return choices, weights, torch.softmax(noisy, -1), clean


def reference_expert(layer: MoELayer, e: int, xt: Tensor) -> Tensor:
    ex = layer.experts
    h = xt @ ex.w_up[e]
    if ex.b_up is not None:
        h = h + ex.b_up[e]
    if ex.activation == "swiglu":
        gate, up = h[: ex.d_ff], h[ex.d_ff:]
        a = gate * torch.sigmoid(gate) * up
    else:
        a = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    y = a @ ex.w_down[e]
    if ex.b_down is not None:
        y = y + ex.b_down[e]
    return y


def reference_shared_expert(layer: MoELayer, xt: Tensor) -> Tensor:
    sh = layer.shared_expert
    h = xt @ sh.w_up
    if sh.b_up is not None:
        h = h + sh.b_up
    if sh.activation == "swiglu":
        gate, up = h[: sh.w_down.shape[0]], h[sh.w_down.shape[0]:]
        a = gate * torch.sigmoid(gate) * up
    else:
        a = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    y = a @ sh.w_down
    if sh.b_down is not None:
        y = y + sh.b_down
    return y if sh.gate is None else torch.sigmoid(sh.gate[0] @ xt) * y


def reference_moe(layer: MoELayer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (output, balance_loss, z_loss) computed one token at a time."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    choices, weights, probs, clean = reference_routing(layer, x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(shape[-1], dtype=x.dtype)
        for e, w in zip(choices[t], weights[t]):
            if e >= 0:
                acc = acc + w.to(x.dtype) * reference_expert(layer, e, x[t])
        if layer.shared_expert is not None:
            acc = acc + reference_shared_expert(layer, x[t])
        rows.append(acc)
    out = torch.stack(rows).view(shape)

    E = layer.num_experts
    # Balance loss counts router choices before capacity (what the router asked for).
    asked = torch.zeros(E)
    for t in range(x.shape[0]):
        order = sorted(range(E), key=lambda e: (-float(probs[t][e].detach()), e))[: layer.top_k]
        for e in order:
            asked[e] += 1
    frac = asked / (x.shape[0] * layer.top_k)
    balance = E * sum(frac[e] * probs[:, e].mean() for e in range(E))
    z = sum(torch.logsumexp(clean[t], 0) ** 2 for t in range(x.shape[0])) / x.shape[0]
    return out, balance, z
