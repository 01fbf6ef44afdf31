"""Aux-loss-free balancing: each step, move every router's per-expert bias toward even load.

A router built with ``expert_bias=True`` adds a per-expert bias to the scores it *chooses*
experts by (never to the combine weights), as DeepSeek-V3 does. :class:`ExpertBiasUpdater`
counts the tokens each expert was given over one optimizer step's training forwards and,
at the step, hands the global count to every router's ``update_expert_bias``. Which ranks
saw which tokens is the caller's business: it passes a ``reduce`` that sums a tensor over
every rank that routed part of the global batch (identity on one process), so the bias
moves identically everywhere.

Only first forwards count: a forward run again by activation checkpointing inside the
backward (autograd is executing a graph then) routes the same tokens a second time.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..backward import inside_backward
from .layer import MoELayer


def is_first_training_forward(module: nn.Module) -> bool:
    """A training forward that autograd will differentiate, not one recomputed inside a backward."""
    return module.training and torch.is_grad_enabled() and not inside_backward()


class ExpertBiasUpdater:
    def __init__(self, layers: list[MoELayer]) -> None:
        self.layers = [layer for layer in layers if getattr(layer.router, "expert_bias", None) is not None]
        self._counts: list[Tensor | None] = [None] * len(self.layers)
        self._hooks = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def _hook(self, i: int):
        def count(module, args, output):
            aux = module.aux_of(output)
            if aux is None or not is_first_training_forward(module):
                return
            got = aux.tokens_per_expert.detach()
            self._counts[i] = got if self._counts[i] is None else self._counts[i] + got

        return count

    def update(self, reduce: Callable[[Tensor], Tensor]) -> Tensor | None:
        """At an optimizer step, on every rank (``reduce`` may be a collective): the global
        load ``[layers, experts]`` the biases moved by, or ``None`` without biased routers."""
        if not self.layers:
            return None
        bias = self.layers[0].router.expert_bias
        # ranks that routed nothing this step (zebra's expert ranks) take part with zeros
        local = torch.stack([c.to(bias.device, torch.float32) if c is not None
                             else torch.zeros(layer.num_experts, device=bias.device)
                             for c, layer in zip(self._counts, self.layers, strict=True)])
        load = reduce(local)
        for layer, row in zip(self.layers, load, strict=True):
            layer.router.update_expert_bias(row)
        self._counts = [None] * len(self.layers)
        return load

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
