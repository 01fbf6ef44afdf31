"""Whose tokens the load-balancing loss is computed over.

The Switch/GShard balance loss of one layer is ``E * sum_e f_e * P_e``: ``f_e`` the fraction
of routing choices that asked for expert ``e`` (not differentiable), ``P_e`` the mean router
probability of ``e``. It is a product of two batch means, so the mean of per-rank (or
per-micro-batch) losses is *not* the loss of the whole batch. What fixes it: take ``f`` over
the whole global batch and keep ``P`` local. The loss is then linear in the local
probabilities, and a token-weighted sum (or DDP's average of equal shares) of the local
losses is exactly the global-batch loss, value and gradient.

A layer asks its ``balance`` object for the loss; the default counts only the tokens in
hand (single process), and a parallel strategy swaps in one that knows the global counts.
The model code never sees a process group.

Relation to Hugging Face's ``load_balancing_loss_func`` (Mixtral, Qwen-MoE, OLMoE): theirs
counts, per choice rank ``k``, the fraction of tokens whose ``k``-th choice is ``e`` and sums
over ranks, which is ``top_k`` times our ``f``; and it pools all layers' tokens into one
loss, where we sum one loss per layer. For one layer, HF = ``top_k`` x ours. We keep the
per-layer sum on purpose: a pooled loss lets an imbalanced layer hide behind a balanced one,
and per-layer counts are what a cheap all-reduce makes exact across ranks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def routed_counts(indices: Tensor, num_experts: int, real: Tensor | None = None) -> Tensor:
    """Routing choices per expert as the router asked (before capacity drops), long ``[E]``.

    ``real`` (bool ``[T]``): which tokens count; padding a strategy added does not."""
    counted = torch.ones_like(indices) if real is None else real.unsqueeze(-1).expand_as(indices)
    return count_per_expert(indices, counted, num_experts)


def count_per_expert(indices: Tensor, counted: Tensor, num_experts: int) -> Tensor:
    """How many of the choices ``indices`` that ``counted`` marks went to each expert, long
    ``[E]``: a scatter_add over the known number of experts, no host sync (CUDA's bincount
    reads the largest index on the host; boolean-mask indexing reads the mask's count)."""
    return torch.zeros(num_experts, dtype=torch.long, device=indices.device).scatter_add_(
        0, indices.reshape(-1), counted.reshape(-1).long())


def mean_over_real(values: Tensor, real: Tensor | None) -> Tensor:
    """The mean of ``values`` (``[T, ...]``) over the tokens ``real`` marks (all: ``None``)."""
    if real is None:
        return values.mean(0)
    w = real.to(values.dtype).view((-1,) + (1,) * (values.dim() - 1))
    return (values * w).sum(0) / w.sum().clamp(min=1)


def balance_loss_from_counts(probs: Tensor, counts: Tensor, real: Tensor | None = None) -> Tensor:
    """``E * sum_e f_e * P_e`` with ``f`` from ``counts`` (any batch) and ``P`` from ``probs``
    (over the ``real`` tokens only, where some are padding)."""
    num_experts = probs.shape[-1]
    frac = counts.to(probs.dtype) / counts.sum().clamp(min=1).to(probs.dtype)
    mean_probs = mean_over_real(probs, real) if probs.shape[0] else probs.new_zeros(num_experts)
    return num_experts * (frac * mean_probs).sum()


class LocalBalance:
    """The loss over the tokens of this call (one process, the whole batch)."""

    def __call__(self, probs: Tensor, indices: Tensor, real: Tensor | None = None) -> Tensor:
        return balance_loss_from_counts(probs, routed_counts(indices, probs.shape[-1], real), real)


class GlobalBalance:
    """``f`` from counts summed over every data-parallel share of the batch.

    ``global_counts(local_counts) -> counts`` is given by the strategy (an all-reduce over
    the data-parallel ranks, or counts the zebra executor has already gathered)."""

    def __init__(self, global_counts: Callable[[Tensor], Tensor]) -> None:
        self.global_counts = global_counts

    def __call__(self, probs: Tensor, indices: Tensor, real: Tensor | None = None) -> Tensor:
        local = routed_counts(indices, probs.shape[-1], real)
        return balance_loss_from_counts(probs, self.global_counts(local), real)
