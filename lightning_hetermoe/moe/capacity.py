"""Expert capacity: which routing choices survive when an expert is over-subscribed.

Policy (deterministic, GShard-style): capacity per expert is
``ceil(capacity_factor * tokens * top_k / num_experts)``. Choices are served in priority
order - every token's first choice before any token's second choice, and within one
choice rank in token order - and a choice is dropped once its expert is full. A dropped
choice contributes nothing to the token's output (the residual path still carries it);
the other choices keep their router weights unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .dispatch import one_hot


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def apply_capacity(indices: Tensor, keep: Tensor, num_experts: int, capacity_factor: float,
                   num_tokens: Tensor | None = None) -> Tensor:
    """Return ``keep`` with over-capacity choices cleared. ``capacity_factor == 0``: dropless.

    ``num_tokens``: the tokens the capacity is for, where some rows are padding (their
    choices already cleared from ``keep``); a device scalar, so the capacity is computed
    where the tokens are, without a host sync."""
    if capacity_factor <= 0:
        return keep
    top_k = indices.shape[1]
    if num_tokens is None:
        cap: int | Tensor = expert_capacity(indices.shape[0], top_k, num_experts, capacity_factor)
    else:
        # in float64 and in expert_capacity's order of operations: the same capacity as the
        # unpadded tokens would get
        cap = (num_tokens.to(torch.float64) * capacity_factor * top_k / num_experts).ceil()
    num_tokens = indices.shape[0]
    # Priority order is choice-major: transpose so that all first choices come first.
    idx = indices.t().reshape(-1)
    kept = keep.t().reshape(-1)
    onehot = one_hot(idx, num_experts) * kept.unsqueeze(-1)
    # Position of each choice in its expert's queue (0-based), counting only live choices.
    position = (onehot.cumsum(0) - 1).gather(1, idx.unsqueeze(-1)).squeeze(-1)
    kept = kept & (position < cap)
    return kept.view(top_k, num_tokens).t().contiguous()
