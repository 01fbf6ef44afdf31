"""A skewed router for benchmarks: two experts of every MoE layer take most tokens.

Each router's logits get a fixed offset ``bias`` on the hot experts (an instance-level
wrapper on ``Router.logits``, installed when fit starts). It does not learn, so the skew
persists however the router weights train: the persistent skewed routing the rebalancing
benchmark needs. With ``bias=1.5`` on experts 0 and 1 of 24 (top-2), each hot expert takes
roughly half the tokens of every layer."""

from __future__ import annotations

import types

import lightning as L
import torch

from lightning_hetermoe import MoELayer


class SkewedRouter(L.Callback):
    def __init__(self, hot: tuple[int, ...] = (0, 1), bias: float = 1.5) -> None:
        self.hot, self.bias = tuple(hot), bias

    def setup(self, trainer, pl_module, stage: str) -> None:
        skew(pl_module, self.hot, self.bias)


def skew(module, hot=(0, 1), bias: float = 1.5) -> None:
    for layer in (m for m in module.modules() if isinstance(m, MoELayer)):
        router = layer.router
        if "logits" in vars(router):
            continue  # already skewed
        router.skew_offset = torch.zeros(layer.num_experts)
        router.skew_offset[list(hot)] = bias
        # a method bound to the router: a deep copy of the model binds it to the copy's router
        router.logits = types.MethodType(_skewed_logits, router)


def _skewed_logits(router, x):
    out = type(router).logits(router, x)
    return out + router.skew_offset.to(out.device, out.dtype)


class UniformRouter(L.Callback):
    """Perfectly even routing (the no-harm check): token ``t`` of a micro-batch picks experts
    ``t mod E``, ``t+1 mod E``, ... by a large fixed logit offset, whatever its content."""

    def __init__(self, bias: float = 20.0) -> None:
        self.bias = bias

    def setup(self, trainer, pl_module, stage: str) -> None:
        for layer in (m for m in pl_module.modules() if isinstance(m, MoELayer)):
            router = layer.router
            if "logits" in vars(router):
                continue
            E, k, original = layer.num_experts, layer.top_k, router.logits

            def logits(x, original=original, E=E, k=k, bias=self.bias):
                out = original(x)
                rows = torch.arange(out.shape[0], device=out.device)
                offset = torch.zeros_like(out)
                for c in range(k):
                    offset[rows, (rows + c) % E] = bias
                return out + offset

            router.logits = logits


def overrides(hot: tuple[int, ...] | list[int], bias: float = 3.0) -> list[str]:
    """The main job's overrides that install :class:`SkewedRouter` on ``hot`` at ``bias``."""
    return ["+callbacks.skew._target_=skew.SkewedRouter", f"+callbacks.skew.bias={bias}",
            f"+callbacks.skew.hot=[{','.join(map(str, hot))}]"]
