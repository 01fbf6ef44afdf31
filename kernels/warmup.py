"""What set-up warms: the expert MLP shapes and row counts a rank's steps will launch.

A pure decision (no device, no triton), so it is tested on CPU; ``kernels.warm_up`` runs
each key and the strategy calls it at set-up. The rule:

- ``single``, ``ep`` and the other modes whose row counts only routing decides warm
  nothing: with no autotuning (the default) a first launch only compiles, lazily, with no
  device-wide sync. With autotuning on they warm every row bucket, so that no benchmark
  (which synchronises the device) runs inside a step.
- ``zebra`` and ``distep`` know from the plan what a round brings to this rank's experts:
  every attention rank of its ZP group sends the rows of one micro-batch, each token to
  ``top_k`` experts, so at most ``tokens x min(top_k, local experts)`` rows reach them,
  ``tokens x top_k x local / E`` under even routing. Warm-up runs the expected and the
  largest count (their buckets) on every layer shape this rank holds, with its real local
  expert count; with autotuning on, every bucket up to the largest.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import torch

from .tuning import M_BUCKET_MIN, m_bucket, tuning_buckets

PLANNED = ("zebra", "distep")


class LayerShape(NamedTuple):
    """What warm-up needs of one MoE layer (on the Triton backend)."""

    d_model: int
    d_ff: int
    activation: str
    bias: bool
    top_k: int
    local_experts: int  # as the rank's module holds them (modes without a plan)


class WarmUpKey(NamedTuple):
    """One ``kernels.warm_up`` call: ``warm_up(d_model, d_ff, activation, bias, dtype,
    device, rows=rows, experts=experts)``."""

    d_model: int
    d_ff: int
    activation: str
    bias: bool
    dtype: torch.dtype
    experts: int
    rows: tuple[int, ...]


def round_tokens(plan: Any, schedule: str, rank: int) -> int:
    """Tokens of the largest round that reaches ``rank``'s experts: one micro-batch of every
    attention rank of its ZP group (the first micro-batches take the remainder)."""
    R = (plan.distep_microbatches or 1) if schedule == "distep" else plan.num_microbatches
    group = plan.zp_groups[plan.group_of(rank)]
    return sum(math.ceil(plan.seqs_per_rank[a] / R) for a in group.attention_ranks) * plan.seq_len


def planned_rows(tokens: int, top_k: int, local: int, num_experts: int) -> tuple[int, ...]:
    """The expected and the largest row count of a round, one per row bucket."""
    largest = tokens * min(top_k, local)
    expected = math.ceil(tokens * top_k * local / max(num_experts, 1))
    by_bucket: dict[int, int] = {}
    for r in (expected, largest):
        by_bucket.setdefault(m_bucket(r), r)
    return tuple(by_bucket[b] for b in sorted(by_bucket))


def _every_bucket_up_to(rows: int) -> tuple[int, ...]:
    return tuple(b for b in tuning_buckets() if b <= max(m_bucket(rows), M_BUCKET_MIN))


def warm_up_keys(schedule: str, plan: Any, rank: int, layers: Sequence[LayerShape | None], dtype: torch.dtype,
                 autotune: bool = False) -> list[WarmUpKey]:
    """The warm-up calls set-up makes on ``rank`` (see the module). ``layers``: one entry per
    MoE layer, in model order, ``None`` where the layer does not run the Triton kernels;
    ``plan`` (a :class:`~lightning_hetermoe.plan.Plan`) is read for ``zebra``/``distep``."""
    out: list[WarmUpKey] = []
    if schedule not in PLANNED or plan is None:
        if not autotune:
            return out
        for shape in layers:
            if shape is not None and shape.local_experts > 0:
                key = WarmUpKey(shape.d_model, shape.d_ff, shape.activation, shape.bias, dtype, shape.local_experts,
                                tuple(tuning_buckets()))
                if key not in out:
                    out.append(key)
        return out
    placement = plan.placement_for(schedule)
    group = plan.zp_groups[plan.group_of(rank)]
    me = group.members.index(rank)
    tokens = round_tokens(plan, schedule, rank)
    for l, shape in enumerate(layers):
        if shape is None:
            continue
        local = sum(1 for p in placement[l] if p == me)
        if local == 0 or tokens == 0:
            continue
        rows = planned_rows(tokens, shape.top_k, local, len(placement[l]))
        if autotune:
            rows = _every_bucket_up_to(max(rows))
        key = WarmUpKey(shape.d_model, shape.d_ff, shape.activation, shape.bias, dtype, local, rows)
        if key not in out:
            out.append(key)
    return out
