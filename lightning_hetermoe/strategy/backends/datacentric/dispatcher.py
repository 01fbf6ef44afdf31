"""The data-centric dispatcher: a layer's experts run here, on full weights gathered for the
call, on this rank's own tokens; no token moves."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ....backward import inside_backward
from ....moe.dispatch import scatter_to_slots, sort_for_experts_here
from .shards import Shard


class DataCentricDispatcher:
    """The layer's experts, run here on full weights gathered for the call; no tokens move.

    ``weights`` and ``reduce_scatter`` are the layer's two collectives, as methods so
    that the emulated clock can wrap them (as it wraps an all-to-all dispatcher's
    ``exchange``); ``issued_at`` says when the layer's forward gather was issued."""

    def __init__(self, layer: int, backend: Any) -> None:
        # backend: the DataCentricBackend whose gathers and ranges serve this layer (no import: it imports us)
        self.layer, self.backend = layer, backend
        # a checkpointed block's recompute is running this layer (inside a backward, through
        # the layer's forward): the experts' own recompute follows on the same weights
        self.in_block_recompute = False
        self.gathered = True  # whether the last weights() came over the wire (else: kept from the last)
        self.ahead = False  # whether that gather had been issued ahead (at ``issued_at``)

    @property
    def issued_at(self) -> float | None:
        return self.backend.issued_at.get(self.layer)

    @property
    def move_fraction(self) -> float:
        """What each rank moves per gather, as a fraction of the layer: ``W - 1`` chunks
        padded to the largest range."""
        shards = self.backend.shards[self.layer].values()
        total = sum(math.prod(s.shape) for s in shards)
        return sum((len(s.sizes) - 1) * s.chunk for s in shards) / total if total else 0.0

    def weights(self, names: list[str], parts: tuple[Tensor, ...]) -> list[Tensor]:
        return self.backend.full_weights(self.layer, names, parts, self)

    def reduce_scatter(self, shard: Shard, grad: Tensor) -> Tensor:
        return self.backend.reduce_scatter(shard, grad)

    def after_reduce_scatter(self) -> None:
        """Once a reduce-scatter is done (on an emulated clock: its modelled time too)."""
        self.backend.scattered(self.layer)

    def __call__(self, x: Tensor, indices: Tensor, keep: Tensor | None, experts) -> Tensor:
        # every expert runs here (its weights gathered); the kernels' counts stay on the device
        # (the checkpoint's recompute reuses them), the torch loop's are read to the host once
        sc = sort_for_experts_here(indices, keep, self.backend.num_experts[self.layer], experts, x.device,
                                    x.dtype)
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        parts = [p for _, p in experts.named_parameters(recurse=False)]

        def run(x: Tensor, *parts: Tensor) -> Tensor:
            fulls = self.weights(names, parts)
            return functional_call(experts, dict(zip(names, fulls, strict=True)), (x, sc.token, sc.counts))

        self.backend.guard_outside_step(self.backend.group, self.layer)
        if not inside_backward():
            # no-op when the previous layer already issued it; a checkpointed block runs this
            # again inside its backward, where a gather issued ahead would only be waited out
            # and issued afresh (full_weights gathers then, in step with the other ranks)
            self.backend.prefetch(self.layer)
        if torch.is_grad_enabled():
            # checkpointed: autograd keeps x and the ranges, and the backward gathers again;
            # recomputed to the end (no early stop), so the experts' recompute is one whole task
            self.in_block_recompute = inside_backward()
            try:
                with set_checkpoint_early_stop(False):
                    out = checkpoint(run, x, *parts, use_reentrant=False)
            finally:
                self.in_block_recompute = False
        else:
            out = run(x, *parts)
        return scatter_to_slots(out, sc.slot, indices.numel())
