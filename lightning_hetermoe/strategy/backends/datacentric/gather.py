"""The autograd function around a gathered expert tensor: forward hands out the full tensor,
backward reduce-scatters its gradient onto this rank's range."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .shards import Shard


class Gathered(torch.autograd.Function):
    """Forward: the full tensor (already gathered, or gathered now). Backward: the full
    gradient reduce-scattered onto this rank's range, averaged over the world."""

    @staticmethod
    def forward(ctx, part: Tensor, full: Tensor, shard: Shard, disp: Any) -> Tensor:
        # disp: the layer's DataCentricDispatcher, which reduce-scatters for its backend
        ctx.shard, ctx.disp = shard, disp
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.disp.reduce_scatter(ctx.shard, grad), None, None, None
