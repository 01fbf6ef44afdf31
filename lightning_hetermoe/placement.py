"""Where experts live: one type, :class:`Placement`, for every part that places experts.

A placement says, for every MoE layer, which expert ids each *holder* keeps. Holders are
the ranks that can hold experts, in a fixed order: the ranks of an expert-parallel group
(expert parallelism) or the members of a ZP group, attention ranks first (zebra, distep).
An expert may have copies on several holders (expert parallelism with replicas).

Two shapes of the same fact meet in the code, and convert here only:

* ``held``: ``[layer][holder] -> expert ids`` (what each holder keeps, in its local order);
* ``owners``: ``[layer][expert] -> holder`` (the plan's form; only without copies).

A placement with copies may also carry ``routes``: per layer and copied expert, the share
of each source holder's choices each copy serves (:mod:`lightning_hetermoe.copy_routing`),
fixed with the placement so that every rank dispatches by the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .copy_routing import holders_of


def contiguous_placement(num_experts: int, ep_size: int) -> list[list[int]]:
    """Split experts into ``ep_size`` contiguous runs, the first ``E % P`` ranks one longer.

    Uneven splits are allowed on purpose: 6 experts on 4 ranks is 2+2+1+1 (ranks with more
    experts do more expert work; the heterogeneity-aware planner exists to fix that).
    """
    base, extra = divmod(num_experts, ep_size)
    out, start = [], 0
    for r in range(ep_size):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def moved_copies(new: Sequence[Sequence[int]], old: Sequence[Sequence[int]]) -> int:
    """Expert copies of one layer that land on a holder that did not hold that expert."""
    return sum(1 for h, held in enumerate(new) for e in held if e not in old[h])


Routes = Sequence[Sequence[Sequence[Sequence[float]] | None]]  # [layer][expert] -> [source][copy] or None


@dataclass(frozen=True)
class Placement:
    """``held[layer][holder]``: the expert ids a holder keeps in that layer, in local order;
    ``routes[layer][expert]``: ``None`` (the run's replica dispatch rule) or, for an expert
    with copies, ``[source holder][copy]`` the share of the source's choices for it that
    each copy (in holder order) serves (a whole layer may be given as ``None``)."""

    held: tuple[tuple[tuple[int, ...], ...], ...]
    routes: tuple[tuple[tuple[tuple[float, ...], ...] | None, ...], ...] | None

    def __init__(self, held: Sequence[Sequence[Sequence[int]]], routes: Routes | None = None) -> None:
        rows = tuple(tuple(tuple(int(e) for e in h) for h in layer) for layer in held)
        if not rows or len({len(layer) for layer in rows}) != 1:
            raise ValueError(f"a placement needs at least one layer and the same number of holders in every "
                             f"layer, got {[len(layer) for layer in rows]}")
        for l, layer in enumerate(rows):
            ids = sorted({e for h in layer for e in h})
            if ids != list(range(len(ids))) or any(len(set(h)) != len(h) for h in layer):
                raise ValueError(f"layer {l} of a placement must hold every expert 0..{len(ids) - 1}, each at most "
                                 f"once per holder, got {[list(h) for h in layer]}")
        object.__setattr__(self, "held", rows)
        object.__setattr__(self, "routes", None if routes is None else self._checked_routes(routes))

    def _checked_routes(self, routes: Routes) -> tuple:
        if len(routes) != len(self.held):
            raise ValueError(f"placement routes have {len(routes)} layers, the placement {len(self.held)}")
        out = []
        for l, (layer, per_expert) in enumerate(zip(self.held, routes)):
            copies = [len(hs) for hs in holders_of(layer, len({e for h in layer for e in h}))]
            if per_expert is None:  # the layer has no route
                per_expert = [None] * len(copies)
            if len(per_expert) != len(copies):
                raise ValueError(f"layer {l} of the placement routes has {len(per_expert)} experts, the placement "
                                 f"{len(copies)}")
            row = []
            for e, route in enumerate(per_expert):
                if route is None:
                    row.append(None)
                    continue
                table = tuple(tuple(float(f) for f in src) for src in route)
                if copies[e] < 2 or len(table) != len(layer) or any(
                        len(src) != copies[e] or min(src) < 0 or abs(sum(src) - 1) > 1e-6 for src in table):
                    raise ValueError(f"layer {l}, expert {e}: a route needs the expert to have copies and, for each of "
                                     f"the {len(layer)} holders, {copies[e]} non-negative shares summing to 1; got "
                                     f"{[list(src) for src in table]}")
                row.append(table)
            out.append(tuple(row))
        return tuple(out) if any(r is not None for layer in out for r in layer) else None

    @classmethod
    def from_owners(cls, owners: Sequence[Sequence[int]], num_holders: int) -> "Placement":
        """From ``owners[layer][expert] -> holder`` (the plan's form)."""
        held = []
        for row in owners:
            per_holder: list[list[int]] = [[] for _ in range(num_holders)]
            for e, h in enumerate(row):
                if not 0 <= h < num_holders:
                    raise ValueError(f"expert {e} is placed on holder {h}; there are {num_holders} holders")
                per_holder[h].append(e)
            held.append(per_holder)
        return cls(held)

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_holders: int) -> "Placement":
        """Every layer split into contiguous runs (plain expert parallelism)."""
        return cls([contiguous_placement(num_experts, num_holders)] * num_layers)

    # -- shape ----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.held)

    @property
    def num_holders(self) -> int:
        return len(self.held[0])

    @property
    def num_experts(self) -> int:
        return 1 + max(e for h in self.held[0] for e in h)

    @property
    def replicated(self) -> bool:
        """Some expert has copies on several holders."""
        return any(sum(len(h) for h in layer) > len({e for h in layer for e in h}) for layer in self.held)

    # -- queries --------------------------------------------------------------------------
    def experts_of(self, holder: int, layer: int) -> list[int]:
        return list(self.held[layer][holder])

    def layer(self, layer: int) -> list[list[int]]:
        return [list(h) for h in self.held[layer]]

    def owners(self) -> list[list[int]]:
        """``[layer][expert] -> holder``; a placement with copies has no single owner."""
        if self.replicated:
            raise ValueError("a placement with expert copies has no single owner per expert")
        out = []
        for layer in self.held:
            row = [0] * sum(len(h) for h in layer)
            for h, held in enumerate(layer):
                for e in held:
                    row[e] = h
            out.append(row)
        return out

    def moved_copies(self, old: "Placement") -> int:
        """Expert copies that land on a holder that did not hold that expert (all layers)."""
        return sum(moved_copies(new, prev) for new, prev in zip(self.held, old.held))

    def layer_routes(self, layer: int) -> list[list[list[float]] | None] | None:
        """The layer's routes per expert, or ``None`` where the placement has none."""
        if self.routes is None:
            return None
        return [None if r is None else [list(src) for src in r] for r in self.routes[layer]]

    def to_lists(self) -> list[list[list[int]]]:
        """Plain lists (JSON, checkpoints)."""
        return [self.layer(l) for l in range(self.num_layers)]

    def routes_lists(self) -> list | None:
        """The routes as plain lists (JSON, checkpoints), or ``None``."""
        return None if self.routes is None else [self.layer_routes(l) for l in range(self.num_layers)]
