"""Routers: map tokens to experts. All routing math runs in fp32; the gate's logits are
computed in fp32 too unless ``moe.router_dtype=input`` asks for the hidden states' dtype
(what Mixtral, Qwen-MoE and OLMoE do), and then only rounded there before fp32 takes over.

Every router returns a :class:`RouterOutput`; the load-balancing loss and the router
z-loss are part of it, never kept in module state or globals, so that callers (and the
zebra executor, which runs one micro-batch at a time) decide how to sum them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import ROUTERS, MoEConfig
from ..seeded_init import draw_seed, fill_, fill_normal_, generator, initialise
from .balance import LocalBalance, mean_over_real


@dataclass
class RouterOutput:
    indices: Tensor  # [T, k] expert id per token and choice, long
    weights: Tensor  # [T, k] fp32 combine weights
    keep: Tensor  # [T, k] bool; False where the router itself declined a choice (GShard)
    probs: Tensor  # [T, E] fp32 softmax over all experts (for the balancing loss)
    logits: Tensor  # [T, E] fp32 (for the z-loss)
    gate_loss: Tensor | None = None  # a custom gate's own auxiliary loss, already weighted (scalar)


def fp32_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in fp32, also under autocast: autocast recasts a linear's operands to
    its fp16/bf16 whatever their dtype, and a gate in fp16 rounds its logits to ~1e-3 (near
    ties between experts decided by rounding) and makes every routing term after it fp16,
    the aux losses included, where a loss scale of 2**16 no longer fits."""
    kind = x.device.type
    off = torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext()
    with off:
        return F.linear(x.float(), weight.float())


def input_dtype_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` as a model's own linear computes it: in ``x``'s dtype (the weight cast
    to it), autocast applying as to any linear; the result returned in fp32. A converted
    Hugging Face Mixtral/Qwen/OLMoE routes by logits rounded this way, and top-k choices on
    near ties follow the rounding, so matching their choices needs the same rounding."""
    return F.linear(x, weight.to(x.dtype)).float()


GATE_LINEAR = {"float32": fp32_linear, "input": input_dtype_linear}


def load_balancing_loss(probs: Tensor, indices: Tensor, num_experts: int) -> Tensor:
    """Switch/GShard auxiliary loss over these tokens: E * sum_e f_e * P_e (see ``balance.py``).

    f_e is the fraction of routing choices sent to expert e (not differentiable), P_e the
    mean router probability of e. It is 1 for perfectly uniform routing.
    """
    if probs.shape[-1] != num_experts:
        raise ValueError(f"probs have {probs.shape[-1]} experts, expected {num_experts}")
    return LocalBalance()(probs, indices)


def router_z_loss(logits: Tensor, real: Tensor | None = None) -> Tensor:
    """ST-MoE z-loss: mean squared log-partition, keeps router logits small (the mean over
    the ``real`` tokens only, where some are padding)."""
    return mean_over_real(torch.logsumexp(logits, dim=-1).square(), real)


class Router(nn.Module):
    """Linear gate ``d_model -> num_experts``; subclasses choose experts from its logits.

    ``bias_update_rate`` set (not ``None``): aux-loss-free balancing. The router keeps a
    per-expert ``expert_bias`` buffer (saved in checkpoints) that subclasses add to the
    scores they *choose* by (:meth:`for_choice`), never to the combine weights; the
    strategy moves it once per optimizer step (:meth:`update_expert_bias`).

    ``declines``: whether ``keep`` can come back with a choice cleared (GShard's second
    expert). A router that never declines one says so (``False``), and a layer without a
    capacity limit or padding then dispatches without reading how many choices it kept
    (a host sync on a GPU); a gate of the user's own keeps the safe ``True``."""

    declines = True

    def __init__(self, d_model: int, num_experts: int, top_k: int, bias_update_rate: float | None = None,
                 router_dtype: str = "float32") -> None:
        super().__init__()
        if router_dtype not in GATE_LINEAR:
            raise ValueError(f"router_dtype={router_dtype!r} is invalid: must be one of {tuple(GATE_LINEAR)}")
        self.router_dtype = router_dtype
        self.init_seed = draw_seed()
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.bias_update_rate = bias_update_rate
        self.expert_bias: Tensor | None
        if bias_update_rate is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        initialise(self)

    def reset_parameters(self) -> None:
        """The gate ~ N(0, 1/d_model), the balancing bias at zero (see :mod:`~lightning_hetermoe.seeded_init`)."""
        fill_normal_(self.weight, 1.0 / math.sqrt(self.weight.shape[1]), generator(self.init_seed))
        fill_(self.expert_bias, 0.0)

    def _apply(self, fn, recurse=True):
        # A cast of the whole model (Lightning's "bf16-true"/"16-true" convert_module is
        # model.to(dtype)) would cast the bias too; steps of 1e-3 vanish in bf16 once the bias
        # is ~0.5, so it follows the module's device but stays fp32.
        bias = self._buffers.get("expert_bias")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("expert_bias")
        if bias is not None and moved is not None and moved.dtype != torch.float32:
            self._buffers["expert_bias"] = bias.to(device=moved.device, dtype=torch.float32)
        return out

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """A gate product in the precision ``router_dtype`` asks for; the result in fp32."""
        return GATE_LINEAR[self.router_dtype](x, weight)

    def logits(self, x: Tensor) -> Tensor:
        return self.linear(x, self.weight)

    def for_choice(self, scores: Tensor) -> Tensor:
        """The scores experts are chosen by: ``scores`` plus the balancing bias, if any."""
        return scores if self.expert_bias is None else scores + self.expert_bias

    @torch.no_grad()
    def update_expert_bias(self, load: Tensor) -> None:
        """One step of aux-loss-free balancing: ``load`` is the global routed count per
        expert (the same on every rank), each bias moves ``bias_update_rate`` toward even."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias on a router without expert_bias (MoEConfig(expert_bias=True); "
                               "model.moe.expert_bias=true in the main job's config)")
        load = load.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)

    def _chosen(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(scores, indices)`` of the k experts chosen by the biased scores: the unbiased
        scores of those experts (what the combine weights are made of)."""
        if self.expert_bias is None:
            return scores.topk(k, dim=-1)
        idx = self.for_choice(scores).topk(k, dim=-1).indices
        return scores.gather(-1, idx), idx

    def forward(self, x: Tensor) -> RouterOutput:
        raise NotImplementedError


class TopKRouter(Router):
    """Softmax over all experts, keep the top k, renormalise the kept weights to sum to 1
    (``normalize=False``: keep the softmax probabilities as they are)."""

    declines = False

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool = True,
                 bias_update_rate: float | None = None, router_dtype: str = "float32") -> None:
        super().__init__(d_model, num_experts, top_k, bias_update_rate, router_dtype)
        self.normalize = normalize

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        probs = logits.softmax(-1)
        top_p, top_i = self._chosen(probs, self.top_k)
        weights = top_p / top_p.sum(-1, keepdim=True) if self.normalize else top_p
        keep = torch.ones_like(top_i, dtype=torch.bool)
        return RouterOutput(top_i, weights, keep, probs, logits)


class SwitchRouter(Router):
    """Switch Transformer: top-1, weight = the chosen probability (not renormalised).

    While training, the router input is multiplied by uniform noise in [1-eps, 1+eps].
    """

    declines = False

    def __init__(self, d_model: int, num_experts: int, jitter_eps: float, bias_update_rate: float | None = None,
                 router_dtype: str = "float32") -> None:
        super().__init__(d_model, num_experts, top_k=1, bias_update_rate=bias_update_rate,
                         router_dtype=router_dtype)
        self.jitter_eps = jitter_eps

    def forward(self, x: Tensor) -> RouterOutput:
        dtype, x = x.dtype, x.float()
        if self.training and self.jitter_eps > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        logits = self.logits(x if self.router_dtype == "float32" else x.to(dtype))
        probs = logits.softmax(-1)
        top_p, top_i = self._chosen(probs, 1)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        return RouterOutput(top_i, top_p, keep, probs, logits)


class GShardRouter(Router):
    """GShard top-2: weights renormalised over the two choices; while training the second
    expert is kept only with probability min(1, 2 * g2) (g2 its renormalised weight).
    Capacity limits are applied by the layer (see :mod:`.capacity`)."""

    def __init__(self, d_model: int, num_experts: int, bias_update_rate: float | None = None,
                 router_dtype: str = "float32") -> None:
        super().__init__(d_model, num_experts, top_k=2, bias_update_rate=bias_update_rate, router_dtype=router_dtype)

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        probs = logits.softmax(-1)
        top_p, top_i = self._chosen(probs, 2)
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

    declines = False

    def __init__(self, d_model: int, num_experts: int, top_k: int, bias_update_rate: float | None = None,
                 router_dtype: str = "float32") -> None:
        super().__init__(d_model, num_experts, top_k, bias_update_rate, router_dtype)
        self.noise_weight = nn.Parameter(torch.zeros(num_experts, d_model))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        fill_(getattr(self, "noise_weight", None), 0.0)  # absent while the base constructor runs

    def forward(self, x: Tensor) -> RouterOutput:
        clean = self.logits(x)
        logits = clean
        if self.training:
            std = F.softplus(self.linear(x, self.noise_weight))
            logits = clean + torch.randn_like(clean) * std
        top_l, top_i = self._chosen(logits, self.top_k)
        weights = top_l.softmax(-1)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        return RouterOutput(top_i, weights, keep, logits.softmax(-1), clean)


class SigmoidGroupRouter(Router):
    """DeepSeek-V3: sigmoid scores; experts in ``n_group`` groups, a group scored by the sum
    of its two best (biased) scores; the top k experts are chosen within the
    ``topk_group`` best groups; combine weights are the unbiased scores of the chosen
    experts, renormalised (``normalize``) and times ``scaling``. The balance loss reads
    the scores normalised per token."""

    declines = False

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, n_group: int, topk_group: int,
                 scaling: float, normalize: bool = True, bias_update_rate: float | None = None,
                 router_dtype: str = "float32") -> None:
        super().__init__(d_model, num_experts, top_k, bias_update_rate, router_dtype)
        self.n_group, self.topk_group, self.scaling, self.normalize = n_group, topk_group, scaling, normalize

    def forward(self, x: Tensor) -> RouterOutput:
        logits = self.logits(x)
        scores = logits.sigmoid()
        choice = self.for_choice(scores)
        T, E, G = choice.shape[0], self.num_experts, self.n_group
        per_group = choice.view(T, G, E // G)
        group_score = per_group.topk(min(2, E // G), dim=-1).values.sum(-1)
        groups = group_score.topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        allowed = allowed.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        top_i = choice.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, top_i)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        probs = scores / scores.sum(-1, keepdim=True)
        return RouterOutput(top_i, weights * self.scaling, keep, probs, logits)


def build_router(cfg: MoEConfig, d_model: int) -> Router:
    common = dict(bias_update_rate=cfg.bias_update_rate if cfg.expert_bias else None, router_dtype=cfg.router_dtype)
    if cfg.router == "topk":
        return TopKRouter(d_model, cfg.num_experts, cfg.top_k, normalize=cfg.normalize_topk, **common)
    if cfg.router == "switch":
        return SwitchRouter(d_model, cfg.num_experts, cfg.jitter_eps, **common)
    if cfg.router == "gshard":
        return GShardRouter(d_model, cfg.num_experts, **common)
    if cfg.router == "noisy_topk":
        return NoisyTopKRouter(d_model, cfg.num_experts, cfg.top_k, **common)
    if cfg.router == "sigmoid_group":
        return SigmoidGroupRouter(d_model, cfg.num_experts, cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                  scaling=cfg.routed_scaling_factor, normalize=cfg.normalize_topk, **common)
    raise ValueError(f"moe.router={cfg.router!r} is invalid: must be one of {ROUTERS}")
