"""Routers: map tokens to experts. All routing math runs in fp32.

Every router returns a :class:`RouterOutput`; the load-balancing loss and the router
z-loss are part of it, never kept in module state or globals, so that callers (and the
zebra executor, which runs one micro-batch at a time) decide how to sum them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ROUTERS, MoEConfig
from .balance import LocalBalance


@dataclass
class RouterOutput:
    indices: Tensor  # [T, k] expert id per token and choice, long
    weights: Tensor  # [T, k] fp32 combine weights
    keep: Tensor  # [T, k] bool; False where the router itself declined a choice (GShard)
    probs: Tensor  # [T, E] fp32 softmax over all experts (for the balancing loss)
    logits: Tensor  # [T, E] fp32 (for the z-loss)
    gate_loss: Tensor | None = None  # a custom gate's own auxiliary loss, already weighted (scalar)


def load_balancing_loss(probs: Tensor, indices: Tensor, num_experts: int) -> Tensor:
    """Switch/GShard auxiliary loss over these tokens: E * sum_e f_e * P_e (see ``balance.py``).

    f_e is the fraction of routing choices sent to expert e (not differentiable), P_e the
    mean router probability of e. It is 1 for perfectly uniform routing.
    """
    if probs.shape[-1] != num_experts:
        raise ValueError(f"probs have {probs.shape[-1]} experts, expected {num_experts}")
    return LocalBalance()(probs, indices)


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss: mean squared log-partition, keeps router logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class Router(nn.Module):
    """Linear gate ``d_model -> num_experts``; subclasses choose experts from its logits."""

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(d_model))

    def logits(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: Tensor) -> RouterOutput:
        raise NotImplementedError


class TopKRouter(Router):
    """Softmax over all experts, keep the top k, renormalise the kept weights to sum to 1
    (``normalize=False``: keep the softmax probabilities as they are)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool = True) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.normalize = normalize

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True) if self.normalize else top_p
        keep = torch.ones_like(top_i, dtype=torch.bool)
        return RouterOutput(top_i, weights, keep, probs, logits)


class SwitchRouter(Router):
    """Switch Transformer: top-1, weight = the chosen probability (not renormalised).

    While training, the router input is multiplied by uniform noise in [1-eps, 1+eps].
    """

    def __init__(self, d_model: int, num_experts: int, jitter_eps: float) -> None:
        super().__init__(d_model, num_experts, top_k=1)
        self.jitter_eps = jitter_eps

    def forward(self, x: Tensor) -> RouterOutput:
        x = x.float()
        if self.training and self.jitter_eps > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        logits = self.logits(x)
        probs = logits.softmax(-1)
        top_p, top_i = probs.max(-1, keepdim=True)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        return RouterOutput(top_i, top_p, keep, probs, logits)


class GShardRouter(Router):
    """GShard top-2: weights renormalised over the two choices; while training the second
    expert is kept only with probability min(1, 2 * g2) (g2 its renormalised weight).
    Capacity limits are applied by the layer (see :mod:`.capacity`)."""

    def __init__(self, d_model: int, num_experts: int) -> None:
        super().__init__(d_model, num_experts, top_k=2)

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(2, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        if self.training:
            u = torch.rand(top_i.shape[0], device=x.device)
            keep = keep.clone()
            keep[:, 1] = u < 2.0 * weights[:, 1].detach()
        return RouterOutput(top_i, weights, keep, probs, logits)


class NoisyTopKRouter(Router):
    """Shazeer et al. 2017: logits + N(0,1) * softplus(x W_noise) while training; softmax
    over the k largest noisy logits."""

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__(d_model, num_experts, top_k)
        self.noise_weight = nn.Parameter(torch.zeros(num_experts, d_model))

    def forward(self, x: Tensor) -> RouterOutput:
        clean = self.logits(x)
        logits = clean
        if self.training:
            std = F.softplus(F.linear(x.float(), self.noise_weight.float()))
            logits = clean + torch.randn_like(clean) * std
        top_l, top_i = logits.topk(self.top_k, dim=-1)
        weights = top_l.softmax(-1)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        return RouterOutput(top_i, weights, keep, logits.softmax(-1), clean)


def build_router(cfg: MoEConfig, d_model: int) -> Router:
    if cfg.router == "topk":
        return TopKRouter(d_model, cfg.num_experts, cfg.top_k, normalize=cfg.normalize_topk)
    if cfg.router == "switch":
        return SwitchRouter(d_model, cfg.num_experts, cfg.jitter_eps)
    if cfg.router == "gshard":
        return GShardRouter(d_model, cfg.num_experts)
    if cfg.router == "noisy_topk":
        return NoisyTopKRouter(d_model, cfg.num_experts, cfg.top_k)
    raise ValueError(f"moe.router={cfg.router!r} is invalid: must be one of {ROUTERS}")
