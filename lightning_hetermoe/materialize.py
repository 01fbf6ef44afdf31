"""A model built on the meta device, materialised with only what this rank holds.

A model of real size is built without storage (``Trainer.init_module(empty_init=True)``, or
in the LightningModule's ``configure_model()``, which this strategy runs on the meta device).
Once the backend knows this rank's share (the dense part or not; which experts of each MoE
layer), :class:`Materializer` allocates exactly that on the device and fills it:

1. from a weight source attached to a module of the model (pretrained safetensors read per
   rank, :mod:`lightning_hetermoe.convert.pretrained`), for the tensors it has;
2. from the pack's seeded initialisation (:mod:`lightning_hetermoe.seeded_init`): stacked
   experts draw only the rows held here, every other module of the pack its own tensors;
3. what neither fills, from the owning module's ``reset_parameters()`` (or a Hugging Face
   model's ``_init_weights``) under a seed derived from the run's seed and the tensor's
   name, the same on every rank.

Every floating tensor starts as NaN and is checked afterwards, so a tensor nothing filled is
an error naming it, never silent garbage. Tied tensors stay tied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
from torch import Tensor, nn

from .model_contract import moe_layers
from .seeded_init import derive, seeded_default_generator

SOURCE_ATTRIBUTE = "hetermoe_weights"  # a module carrying a WeightSource for its tree


class MaterializeError(RuntimeError):
    """A tensor built on the meta device could not be given values."""


@dataclass(frozen=True)
class Holding:
    """What one rank keeps: the dense (non-expert) tensors or not, and per MoE layer (model
    order) the global ids of the experts it holds, in its local order."""

    dense: bool  # False: parameters outside the experts are left empty (buffers are kept)
    rows: list[list[int]]


@dataclass
class Target:
    """One tensor to fill: ``local`` as allocated here; ``rows`` the global expert ids of its
    first dimension (stacked experts), ``None`` for a whole tensor."""

    local: Tensor
    rows: list[int] | None = None
    full_shape: tuple[int, ...] = ()


class WeightSource(Protocol):
    """Values for a module's tensors by name (relative to the module carrying the source)."""

    def fill(self, targets: dict[str, Target]) -> set[str]:
        """Fill what it has; return the names it filled."""


@dataclass
class Materialized:
    """What was materialised: this rank's bytes, and the tensors left empty (not held)."""

    held_bytes: int = 0
    full_bytes: int = 0
    stripped: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)


def meta_tensor_names(module: nn.Module) -> list[str]:
    return [n for n, t in _named_tensors(module) if t.is_meta]


def built_on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for _, t in _named_tensors(module))


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


class Materializer:
    """Materialises the meta tensors of a model on ``device`` for a :class:`Holding`.

    ``seed``: the run's seed for modules the pack does not seed (the same on every rank: the
    strategy broadcasts rank 0's)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device, self.seed = torch.device(device), seed

    def __call__(self, module: nn.Module, holding: Holding) -> Materialized:
        layers = [layer for _, layer in moe_layers(module)]
        if len(holding.rows) != len(layers):
            raise MaterializeError(f"the holding names experts of {len(holding.rows)} MoE layers, the model has "
                                   f"{len(layers)}")
        experts = {id(layer.experts): rows for layer, rows in zip(layers, holding.rows, strict=True)}
        out = Materialized()
        targets = self._allocate(module, experts, holding.dense, out)
        filled = self._from_sources(module, targets)
        self._seeded(module, experts, targets, filled)
        self._fallback(module, targets, filled)
        self._check(targets, filled)
        return out

    # -- allocation -------------------------------------------------------------------------
    def _allocate(self, module: nn.Module, experts: dict[int, list[int]], dense: bool,
                  out: Materialized) -> dict[str, Target]:
        targets: dict[str, Target] = {}
        made: dict[int, Tensor] = {}  # tied tensors: one allocation for every name
        for mname, m in module.named_modules(remove_duplicate=False):
            rows = experts.get(id(m))
            for kind in ("_parameters", "_buffers"):
                table = getattr(m, kind)
                for tname, t in list(table.items()):
                    if t is None or not t.is_meta:
                        continue
                    name = f"{mname}.{tname}" if mname else tname
                    if id(t) in made:
                        table[tname] = made[id(t)]
                        continue
                    if rows is not None and tname == "expert_ids":
                        new = torch.tensor(rows, dtype=t.dtype, device=self.device)
                        target = Target(new, None, tuple(t.shape))
                        filled_now = True
                    else:
                        # a rank without the dense part keeps its buffers (small; some are read
                        # everywhere, like a router's balancing bias) but none of its parameters
                        keep = dense or kind == "_buffers"
                        if rows is not None:
                            shape = (len(rows),) + tuple(t.shape[1:])
                        else:
                            shape = tuple(t.shape) if keep else (0,)
                        new = torch.empty(shape, dtype=t.dtype, device=self.device)
                        if new.is_floating_point() or new.is_complex():
                            new.fill_(float("nan"))
                        target = Target(new, rows, tuple(t.shape))
                        filled_now = False
                        if rows is None and not keep:
                            out.stripped[name] = (t.shape, t.dtype)
                    out.held_bytes += new.numel() * new.element_size()
                    out.full_bytes += t.numel() * t.element_size()
                    if kind == "_parameters":
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                        target.local = new
                    table[tname] = new
                    made[id(t)] = new
                    if not filled_now:
                        targets[name] = target
        return targets

    # -- filling ------------------------------------------------------------------------------
    def _from_sources(self, module: nn.Module, targets: dict[str, Target]) -> set[str]:
        filled: set[str] = set()
        for prefix, m in module.named_modules():
            source = getattr(m, SOURCE_ATTRIBUTE, None)
            if source is None:
                continue
            at = f"{prefix}." if prefix else ""
            mine = {n[len(at):]: t for n, t in targets.items() if n.startswith(at) and n not in filled}
            with torch.no_grad():
                filled |= {at + n for n in source.fill(mine)}
        return filled

    def _seeded(self, module: nn.Module, experts: dict[int, list[int]], targets: dict[str, Target],
                filled: set[str]) -> None:
        """The pack's own modules, children before parents (a parent may set its children's
        tensors); a module whose every tensor a source filled keeps those values."""
        for mname, m in reversed(list(module.named_modules())):
            if not isinstance(getattr(m, "init_seed", None), int):
                continue
            open_ = [n for n in _tree_names(m, mname) if n in targets and n not in filled]
            if not open_ or all(targets[n].local.numel() == 0 for n in open_):
                continue
            with torch.no_grad():
                if id(m) in experts:
                    m.reset_experts(experts[id(m)])
                else:
                    m.reset_parameters()

    def _fallback(self, module: nn.Module, targets: dict[str, Target], filled: set[str]) -> None:
        """Modules the pack does not seed: their own ``reset_parameters`` (or a Hugging Face
        ancestor's ``_init_weights``) under a seed from the run's seed and their name."""
        hf_roots = [(n, m) for n, m in module.named_modules() if callable(getattr(m, "_init_weights", None))
                    and hasattr(m, "config")]
        for mname, m in reversed(list(module.named_modules())):
            own = [f"{mname}.{t}" if mname else t for t, _ in _direct(m)]
            if not [n for n in own if n in targets and n not in filled and _unfilled(targets[n].local)]:
                continue
            owner = next((r for n, r in reversed(hf_roots) if not n or mname == n or mname.startswith(f"{n}.")), None)
            with seeded_default_generator(derive(self.seed, mname)), torch.no_grad():
                if owner is not None:
                    owner._init_weights(m)
                still = [n for n in own if n in targets and n not in filled and _unfilled(targets[n].local)]
                if still and callable(getattr(m, "reset_parameters", None)) \
                        and not isinstance(getattr(m, "init_seed", None), int):
                    m.reset_parameters()

    def _check(self, targets: dict[str, Target], filled: set[str]) -> None:
        left = [n for n, t in targets.items() if n not in filled and _unfilled(t.local)]
        if left:
            shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            raise MaterializeError(
                f"tensors built on the meta device that nothing initialised: {shown}. Give their module a "
                f"reset_parameters(), build the model eagerly, or load its weights (lightning_hetermoe.convert)")


def _direct(m: nn.Module) -> list[tuple[str, Tensor]]:
    return [(n, t) for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]


def _tree_names(m: nn.Module, prefix: str) -> list[str]:
    at = f"{prefix}." if prefix else ""
    return [at + n for n, _ in _named_tensors(m)]


def _unfilled(t: Tensor) -> bool:
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return False
    return bool(torch.isnan(t).any())


def fill_rows(target: Target, read: Any) -> None:
    """``target`` from ``read(rows)`` (the expert rows it holds) or ``read(None)`` (all of it)."""
    value = read(target.rows)
    target.local.data.copy_(value.to(device=target.local.device, dtype=target.local.dtype))
