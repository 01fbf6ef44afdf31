"""The autograd function around a gathered expert tensor: forward hands out the full tensor,
backward reduce-scatters its gradient onto this rank's range."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .shards import Shard


class Gathered(torch.autograd.Function):
    """Forward: the full tensor (already gathered, or gathered now; in the autocast dtype
    under mixed precision). Backward: the full gradient reduce-scattered onto this rank's
    range, averaged over the world, in the range's own dtype (fp32 for fp32 weights: the
    sum over ranks keeps its precision, as DDP's does)."""

    @staticmethod
    def forward(ctx, part: Tensor, full: Tensor, shard: Shard, disp: Any) -> Tensor:
        # disp: the layer's DataCentricDispatcher, which reduce-scatters for its backend
        ctx.shard, ctx.disp, ctx.dtype = shard, disp, part.dtype
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        mine = ctx.disp.reduce_scatter(ctx.shard, grad.to(ctx.dtype))
        ctx.disp.after_reduce_scatter()  # the layer below's gather may leave now
        return mine, None, None, None
