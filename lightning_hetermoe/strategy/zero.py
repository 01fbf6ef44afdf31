"""Optimizer state sharded over the ranks that hold the same weights (ZeRO stage 1).

Dense weights are replicated on every rank that holds the dense part (every rank under
expert parallelism and data-centric, the attention ranks under zebra), and so, unsharded,
is their optimizer state: for AdamW 8 bytes per parameter, twice the weights. Sharded, each
replica keeps the state of one contiguous range of the dense parameters laid end to end
(the ranges in proportion to the ranks' device memory), as Megatron's distributed optimizer
and ZeRO-1 do:

* the optimizer is handed, instead of each dense parameter, views of the range this rank
  owns (a parameter split by a range boundary gives one view to each owner); it keeps
  state for those views only;
* gradients are summed over the replicas as before (DDP, or zebra's dense all-reduce), so
  every replica has them whole; the views' gradients are views of them (no copy);
* the step updates the owned ranges in place (the views share the parameters' storage),
  then each range is broadcast from its owner to the other replicas.

Exact for optimizers that update each element from that element's own state (SGD, Adam,
AdamW, ...): a sharded step equals the unsharded one. The clipping norm sums the owned
ranges over the replicas. Checkpoints store each range's state as a piece of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ..comm import Group
from ..apportion import apportion
from .grad_norm import squared_norm

# optimizers whose update of an element reads only that element's state and gradient
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD")


@dataclass
class RangeView:
    """Elements ``[lo, hi)`` of ``param`` (flattened), owned by group member ``owner``;
    ``shard`` is the view the owner's optimizer steps."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    owner: int
    shard: nn.Parameter | None = None


def shardable(optimizer: Any) -> bool:
    return type(getattr(optimizer, "_optimizer", optimizer)).__name__ in ELEMENTWISE


class OptimizerSharding:
    """Applied to the optimizers once they exist; ``params``: the replicated parameters by
    name (in the order every replica lists them); ``weights``: each member's share."""

    def __init__(self, optimizers: list, params: list[tuple[str, nn.Parameter]], group: Group,
                 weights: list[float] | None = None) -> None:
        self.group = group
        self.me = group.rank
        sizes = [p.numel() for _, p in params]
        total = sum(sizes)
        share = apportion(total, weights or [1.0] * group.size)
        bounds, at = [], 0
        for n in share:
            bounds.append((at, at + n))
            at += n
        self.views: list[RangeView] = []
        start = 0
        for (name, p), n in zip(params, sizes, strict=True):
            for owner, (a, b) in enumerate(bounds):
                lo, hi = max(a, start) - start, min(b, start + n) - start
                if hi > lo:
                    self.views.append(RangeView(name, p, lo, hi, owner))
            start += n
        self.mine = [v for v in self.views if v.owner == self.me]
        for v in self.mine:
            v.shard = nn.Parameter(v.param.data.view(-1)[v.lo:v.hi], requires_grad=v.param.requires_grad)
        # the clip asks of every parameter at every step: a set, not a scan of the views
        self._shard_ids = {id(v.shard) for v in self.mine}
        self.replaced = {id(p) for _, p in params}
        by_param: dict[int, list[nn.Parameter]] = {}
        for v in self.mine:
            by_param.setdefault(id(v.param), []).append(v.shard)
        self._original: dict[int, list[list[nn.Parameter]]] = {}
        for opt in optimizers:
            inner = getattr(opt, "_optimizer", opt)
            self._original[id(inner)] = [list(g["params"]) for g in inner.param_groups]
            for group_ in inner.param_groups:
                group_["params"] = [s for p in group_["params"]
                                    for s in (by_param.get(id(p), []) if id(p) in self.replaced else [p])]
            _zero_replaced_grads_too(inner, [p for _, p in params])

    # -- the step ------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """The owned ranges' gradients: views of the whole gradients (after their sum)."""
        for v in self.mine:
            g = v.param.grad
            v.shard.grad = None if g is None else g.view(-1)[v.lo:v.hi]

    def share_updates(self) -> None:
        """After the step: every range from its owner to every replica, in the same order
        on every member."""
        for v in self.views:
            piece = v.param.data.view(-1)[v.lo:v.hi]
            comm.broadcast(self.group, piece, self.group.ranks[v.owner], what="zero.params")

    def grad_sq_norm(self, device: torch.device) -> Tensor:
        """Squared norm of the replicated gradients, each element once: the owned ranges
        summed over the replicas."""
        sq = squared_norm((v.shard.grad for v in self.mine), device)
        comm.all_reduce(self.group, sq, what="zero.clip")
        return sq

    def is_shard(self, p: Tensor) -> bool:
        return id(p) in self._shard_ids

    # -- checkpoints ---------------------------------------------------------------------
    def shard_full_state(self, state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """A full checkpoint's ``optimizer.state_dict()`` (slots numbered by the whole
        parameters) re-keyed onto this rank's optimizer: each replicated parameter's
        per-element state cut to the ranges this rank owns."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        original = [p for g in self._original[id(inner)] for p in g]
        current = [p for g in inner.param_groups for p in g["params"]]
        position = {id(p): i for i, p in enumerate(current)}
        by_param: dict[int, list[RangeView]] = {}
        for v in self.mine:
            by_param.setdefault(id(v.param), []).append(v)
        out: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(original):
            slot = state["state"].get(i)
            if slot is None:
                continue
            if id(p) not in self.replaced:
                out[position[id(p)]] = slot
                continue
            for v in by_param.get(id(p), []):
                out[position[id(v.shard)]] = {
                    k: (x.reshape(-1)[v.lo:v.hi].clone() if torch.is_tensor(x) and x.shape == p.shape and x.dim()
                        else x) for k, x in slot.items()}
        groups = [{**saved, "params": [position[id(p)] for p in g["params"]]}
                  for saved, g in zip(state["param_groups"], inner.param_groups, strict=True)]
        return {"state": out, "param_groups": groups}

    def original_groups(self, optimizer: Any) -> list[list[nn.Parameter]] | None:
        """The optimizer's parameter groups as it was built (whole parameters)."""
        return self._original.get(id(getattr(optimizer, "_optimizer", optimizer)))

    def shard_names(self) -> dict[int, tuple[str, int, tuple[int, ...]]]:
        """``id(shard) -> (parameter name, offset in its flattened whole, whole shape)``."""
        return {id(v.shard): (v.name, v.lo, tuple(v.param.shape)) for v in self.mine}


def _zero_replaced_grads_too(optimizer: Any, params: list[nn.Parameter]) -> None:
    """Lightning zeroes gradients through the optimizer, which no longer lists the whole
    replicated parameters: their gradients are zeroed with it."""
    own = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        own(set_to_none=set_to_none)
        for p in params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    optimizer.zero_grad = zero_grad
