"""The MoE feed-forward layer: router -> capacity -> dispatch/experts/combine.

It knows nothing of process groups: ``self.dispatcher`` defaults to a local one and
``self.balance`` to the loss over the tokens in hand; a parallel strategy swaps both (and
slices ``self.experts``) from outside. The auxiliary losses are computed after the
dispatcher returns, so a strategy may gather the whole batch's routing counts meanwhile.
``self.real_tokens`` says which tokens of a call are padding a strategy added (ragged
batches padded to one shape): padding routes nowhere, takes no expert capacity, and counts
in none of the layer's losses and counts.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import ConfigError, MoEConfig
from ..kernels.activation import forward as activate
from ..seeded_init import draw_seed, fill_, fill_normal_, generator, initialise
from .capacity import apply_capacity
from .dispatch import LocalDispatcher, weighted_sum
from .experts import Experts
from .balance import LocalBalance, count_per_expert
from .module_experts import ModuleExperts
from .routers import Router, RouterOutput, build_router, router_z_loss


@dataclass
class MoEAux:
    """What the layer reports besides its output; the caller decides how to weigh it."""

    balance_loss: Tensor
    z_loss: Tensor
    tokens_per_expert: Tensor  # [E] kept choices per expert in this call (global ids)
    dropped: Tensor  # scalar: number of routing choices dropped by capacity or the router
    gate_loss: Tensor | None = None  # a custom gate's own loss (RouterOutput.gate_loss), weighted by the gate


def every_token_real(num_tokens: int) -> Tensor | None:
    """The default ``MoELayer.real_tokens``: no strategy padded this call (``None``), else
    a bool ``[num_tokens]`` on the tokens' device, ``True`` where a token is real."""
    return None


def gate_losses(auxes: list[MoEAux]) -> Tensor | float:
    """The sum of custom gates' own losses (0 where every layer uses a pack router)."""
    return sum((a.gate_loss for a in auxes if a.gate_loss is not None), 0.0)


class SharedExpert(nn.Module):
    """A dense MLP every token passes through, scaled per token by ``sigmoid(gate . x)``
    (Qwen2-MoE's shared expert; ``gated=False``: unscaled, DeepSeek-V3's). Its weights are
    dense parameters like attention's: a strategy leaves them in place and averages their
    gradients with the rest."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, gated: bool = True) -> None:
        super().__init__()
        self.init_seed = draw_seed()
        self.activation = activation
        h = 2 * d_ff if activation == "swiglu" else d_ff
        self.w_up = nn.Parameter(torch.empty(d_model, h))
        self.w_down = nn.Parameter(torch.empty(d_ff, d_model))
        self.b_up = nn.Parameter(torch.zeros(h)) if bias else None
        self.b_down = nn.Parameter(torch.zeros(d_model)) if bias else None
        self.gate = nn.Parameter(torch.empty(1, d_model)) if gated else None
        initialise(self)

    def reset_parameters(self) -> None:
        d_model, d_ff = self.w_up.shape[0], self.w_down.shape[0]
        gen = generator(self.init_seed)
        fill_normal_(self.w_up, 1.0 / math.sqrt(d_model), gen)
        fill_normal_(self.w_down, 1.0 / math.sqrt(d_ff), gen)
        if self.gate is not None:
            fill_normal_(self.gate, 1.0 / math.sqrt(d_model), gen)
        fill_(self.b_up, 0.0)
        fill_(self.b_down, 0.0)

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.w_up
        if self.b_up is not None:
            h = h + self.b_up
        y = activate(h, self.activation) @ self.w_down
        if self.b_down is not None:
            y = y + self.b_down
        return y if self.gate is None else torch.sigmoid(F.linear(x, self.gate)) * y


class MoELayer(nn.Module):
    """``experts``: the user's expert module class (or factory, called once per expert) or
    the list of ``num_experts`` expert modules (:class:`~.module_experts.ModuleExperts`);
    default: the pack's MLP experts from ``cfg`` on the grouped kernels. ``router``: the
    user's gate, a :class:`~.routers.Router` (it returns top-k indices and weights, and
    the probabilities and logits the balance and z losses read; a gate that has a loss of
    its own returns it as ``RouterOutput.gate_loss``); default: ``cfg.router``."""

    def __init__(self, d_model: int, cfg: MoEConfig, *, experts: Any = None, router: Router | None = None) -> None:
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, numbers.Integral) or d_model < 1:
            raise ConfigError(f"MoELayer d_model={d_model!r} is invalid: must be an integer >= 1 (the hidden size)")
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        if router is not None and not isinstance(router, Router):
            raise TypeError(f"router must be a lightning_hetermoe Router (subclass it for a custom gate); got "
                            f"{type(router).__name__}")
        if router is not None and (router.num_experts, router.top_k) != (cfg.num_experts, cfg.top_k):
            raise ValueError(f"the router has {router.num_experts} experts, top-{router.top_k}; moe has "
                             f"{cfg.num_experts}, top-{cfg.top_k}")
        self.router = router if router is not None else build_router(cfg, d_model)
        self.experts = (ModuleExperts(experts, cfg.num_experts, d_model) if experts is not None else
                        Experts(cfg.num_experts, d_model, cfg.d_ff, cfg.activation, cfg.bias,
                                backend=cfg.expert_backend, recompute=cfg.recompute_activation))
        self.shared_expert = (SharedExpert(d_model, cfg.shared_expert_d_ff, cfg.activation, cfg.bias,
                                           gated=cfg.shared_expert_gate)
                              if cfg.shared_expert_d_ff > 0 else None)
        self.dispatcher = LocalDispatcher()
        self.balance = LocalBalance()
        self.real_tokens = every_token_real

    def route(self, x: Tensor, real: Tensor | None = None) -> RouterOutput:
        r = self.router(x)
        if real is not None:  # padding: no expert computes it, no capacity holds a place for it
            r.keep = r.keep & real.unsqueeze(-1)
        live = None if real is None else real.sum()
        r.keep = apply_capacity(r.indices, r.keep, self.num_experts, self.cfg.capacity_factor, live)
        return r

    def aux_of(self, output: Any) -> MoEAux | None:
        """The :class:`MoEAux` of a forward that returned ``output`` (what hooks read)."""
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], MoEAux):
            return output[1]
        return None

    def forward(self, x: Tensor) -> tuple[Tensor, MoEAux]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        real = self.real_tokens(x.shape[0])
        r = self.route(x, real)
        # before the dispatch: under zebra the shared expert runs while the routed rows are away
        shared = self.shared_expert(x) if self.shared_expert is not None else None
        # every choice kept, known here: the dispatcher need not read the count back
        every_kept = real is None and self.cfg.capacity_factor <= 0 and not self.router.declines
        slots = self.dispatcher(x, r.indices, None if every_kept else r.keep, self.experts)
        weights = (r.weights * r.keep).to(slots.dtype)
        combine = getattr(self.dispatcher, "combine", None)
        y = combine(slots, weights) if combine is not None else weighted_sum(slots, weights)
        if shared is not None:
            y = y + shared
        # a balance object of the user's own may not know of padding: asked with it only where there is some
        balance = self.balance(r.probs, r.indices) if real is None else self.balance(r.probs, r.indices, real)
        aux = MoEAux(
            balance_loss=balance,
            z_loss=router_z_loss(r.logits, real),
            tokens_per_expert=count_per_expert(r.indices, r.keep, self.num_experts),
            dropped=(~r.keep).sum() if real is None else (~r.keep & real.unsqueeze(-1)).sum(),
            gate_loss=r.gate_loss,
        )
        return y.view(shape), aux
