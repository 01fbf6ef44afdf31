"""A plan as this process sees it: its role, its ZP group, which experts it holds in each
layer, and the process groups the zebra executor talks over.

Group ranks follow sorted global ranks (``torch.distributed.new_group`` sorts them), so
every exchange is indexed by group rank, never by the plan's member order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning_hetermoe.comm as comm
from ....comm import Group
from ....plan import Plan


@dataclass
class Layout:
    plan: Plan
    rank: int
    placement: list[list[int]]  # [layer][expert] -> member index (zebra: Asym-EA; distep: base)
    group_index: int = 0
    members: list[int] = field(default_factory=list)  # this ZP group, plan order (attention first)
    group_ranks: list[int] = field(default_factory=list)  # the same ranks sorted: group-rank order

    @classmethod
    def from_plan(cls, plan: Plan, rank: int, placement: list[list[int]] | None = None) -> "Layout":
        g = plan.group_of(rank)
        members = plan.zp_groups[g].members
        return cls(plan, rank, placement or plan.placement, g, members, sorted(members))

    # -- roles --------------------------------------------------------------------------
    @property
    def role(self) -> str:
        return self.plan.roles[self.rank]

    @property
    def is_attention(self) -> bool:
        return self.role == "attention"

    @property
    def attention_members(self) -> list[int]:
        return list(self.plan.zp_groups[self.group_index].attention_ranks)

    @property
    def num_layers(self) -> int:
        return len(self.placement)

    @property
    def num_experts(self) -> int:
        return len(self.placement[0])

    def every_group_ranks(self) -> list[list[int]]:
        """Each ZP group's global ranks in this group's group-rank order (a member of every
        group at the plan position of this group's member)."""
        at = [self.members.index(r) for r in self.group_ranks]
        return [[g.members[p] for p in at] for g in self.plan.zp_groups]

    def group_rank(self, global_rank: int) -> int:
        return self.group_ranks.index(global_rank)

    @property
    def my_group_rank(self) -> int:
        return self.group_rank(self.rank)

    @property
    def saver(self) -> int:
        """The rank that writes checkpoints: the first attention rank holds the dense weights."""
        return min(self.plan.attention_ranks)

    # -- experts ------------------------------------------------------------------------
    def experts_of(self, global_rank: int, layer: int) -> list[int]:
        p = self.members.index(global_rank)
        return [e for e, q in enumerate(self.placement[layer]) if q == p]

    def mine(self, layer: int) -> list[int]:
        return self.experts_of(self.rank, layer)

    def holds(self) -> list[bool]:
        return [bool(self.mine(l)) for l in range(self.num_layers)]

    def by_group_rank(self, layer: int) -> list[list[int]]:
        """Expert ids per group rank in ``layer`` (the order exchanged rows are laid out in)."""
        return [self.experts_of(r, layer) for r in self.group_ranks]

    def expert_position(self, layer: int) -> list[int]:
        """``position[e]``: where expert ``e``'s rows go when a token batch is laid out by
        holder (group-rank order), then by the holder's own expert order."""
        position = [0] * self.num_experts
        k = 0
        for experts in self.by_group_rank(layer):
            for e in experts:
                position[e] = k
                k += 1
        return position


@dataclass
class ZebraGroups:
    """This rank's groups (see :mod:`lightning_hetermoe.comm`), created by every rank in the
    same order (a collective). ``None`` where this rank is not a member."""

    dispatch: Group  # this ZP group, attention -> experts: rows (device), round headers (host)
    combine: Group  # this ZP group, experts -> attention: answers (device), their send times (host, emulation)
    zp: Group  # this ZP group: checkpoint gathers and the clip norm (device)
    dense: Group | None  # every attention rank of every ZP group: dense gradients (device), balance counts (host)
    replicas: Group  # this member's counterparts in the other ZP groups: expert gradients (device)

    @classmethod
    def build(cls, layout: Layout) -> "ZebraGroups":
        plan = layout.plan
        mine: dict[str, Group | None] = {}
        for g, grp in enumerate(plan.zp_groups):
            # host sides: the round headers (dispatch), the answers' send times under emulation (combine)
            for name, host in (("dispatch", True), ("combine", True), ("zp", False)):
                # zp's gathers and clip norm run outside the rounds: dispatch's communicator
                # serves them; dispatch and combine run at once and keep their own
                made = comm.new_group(f"zp{g}.{name}" if name != "zp" else f"zp{g}", grp.members, host=host,
                                      reuse=name == "zp")
                if made.member:
                    mine[name] = made
        dense = comm.new_group("dense", plan.attention_ranks, host=True)
        mine["dense"] = dense if dense.member else None
        for p in range(len(plan.zp_groups[0].members)):
            made = comm.new_group(f"replicas{p}", [grp.members[p] for grp in plan.zp_groups])
            if made.member:
                mine["replicas"] = made
        return cls(**mine)
