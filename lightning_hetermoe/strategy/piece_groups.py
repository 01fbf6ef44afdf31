"""Optimizer parameter groups chosen at the parameters' whole shapes, where a rank holds pieces.

A user's ``configure_optimizers`` often groups parameters by their shape: nanoGPT's weight
decay on every tensor of two or more dimensions and none on the others. Lightning calls it
once the strategy has laid the model out, so it sees what this rank holds; under data-centric
mode that is a flat range of each expert tensor (one dimension), and such a grouping put the
experts with the biases and norms (no weight decay, and whatever learning rate that group
has), where one process puts them with the weights: training differed from one process in
every parameter.

So where the backend holds pieces (:meth:`ParallelBackend.piece_shapes`) and an optimizer
has more than one group, ``configure_optimizers`` is called once more with each piece
replaced, in the module, by a parameter of its whole shape on the meta device (no memory),
and each piece moves to the group its whole-shaped stand-in landed in. Groups chosen by name,
or an optimizer of one group, are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn


def regroup_pieces(module: nn.Module, optimizers: list[Any], shapes: dict[str, tuple[int, ...]]) -> int:
    """Move each piece of ``module`` (by name, its whole shape in ``shapes``) into the group of
    each of ``optimizers`` that the user's ``configure_optimizers`` puts its whole-shaped
    stand-in in. How many pieces moved."""
    named = dict(module.named_parameters())
    pieces = {name: named[name] for name in shapes if name in named}
    if not pieces or all(len(opt.param_groups) < 2 for opt in optimizers):
        return 0
    stand_ins = {name: nn.Parameter(torch.empty(shapes[name], dtype=p.dtype, device="meta"),
                                    requires_grad=p.requires_grad) for name, p in pieces.items()}
    try:
        with _swapped(module, stand_ins):
            shadow, _, _ = _configure_optimizers(module.configure_optimizers())
    except Exception as err:  # a configure_optimizers that cannot run on meta tensors
        rank_zero_warn(f"HeterMoEStrategy: could not check which optimizer group each data-centric expert piece "
                       f"belongs in ({type(err).__name__}: {err}); they stay where configure_optimizers put the "
                       f"pieces (a flat range of each expert tensor: one dimension)")
        return 0
    if len(shadow) != len(optimizers) or any(len(a.param_groups) != len(b.param_groups)
                                             for a, b in zip(optimizers, shadow, strict=True)):
        rank_zero_warn("HeterMoEStrategy: configure_optimizers gave other optimizers or groups at the experts' whole "
                       "shapes than at this rank's pieces of them; the pieces stay where it put them")
        return 0
    moved = 0
    for opt, twin in zip(optimizers, shadow, strict=True):
        wanted = {id(q): g for g, group in enumerate(twin.param_groups) for q in group["params"]}
        for name, piece in pieces.items():
            want = wanted.get(id(stand_ins[name]))
            have = next((g for g, group in enumerate(opt.param_groups) if any(q is piece for q in group["params"])),
                        None)
            if want is None or have is None or want == have:
                continue
            opt.param_groups[have]["params"] = [q for q in opt.param_groups[have]["params"] if q is not piece]
            opt.param_groups[want]["params"].append(piece)
            moved += 1
    return moved


class _swapped:
    """The module's parameters ``by_name`` in place of its own, until the block ends."""

    def __init__(self, module: nn.Module, by_name: dict[str, nn.Parameter]) -> None:
        self.module, self.by_name = module, by_name
        self.kept: list[tuple[nn.Module, str, nn.Parameter]] = []

    def __enter__(self) -> None:
        for name, p in self.by_name.items():
            owner_name, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            self.kept.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, p)

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, p in reversed(self.kept):
            setattr(owner, attr, p)
