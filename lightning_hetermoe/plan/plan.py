"""The plan: who does what. A plain dataclass, JSON round trip, identical on every rank.

Ranks are global ranks. Each ZP group lists its attention ranks then its expert ranks;
``placement[layer][expert]`` is the *member index* in that list, the same for every ZP
group (groups are data-parallel replicas), so ``zp_groups[g].members[placement[l][e]]``
is the global rank that holds expert ``e`` of layer ``l`` in group ``g``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..serialization import JsonDataclass

ROLES = ("attention", "expert")
# The schedules a run can be set to, and the settings that run each (ep_ideal, separate EP
# jobs with nothing between them, is a yardstick, not a schedule)
RUN_AS = {"zebra": "strategy.mode=zebra", "distep": "strategy.mode=distep", "ep": "strategy.mode=ep",
          "ep_balanced": "strategy.mode=ep strategy.batch_split=speed", "datacentric": "strategy.mode=datacentric"}
# Two predictions closer than this ratio are a tie (zebra and DistEP on a layout where every
# rank attends run the same steps): neither is called faster
TIE_RATIO = 1.005
# Past this many ranks the printed plan gives a row per kind of rank, not per rank; past this
# many ZP groups, how many nodes they span, not each one's
TABLE_RANKS = 64
TABLE_GROUPS = 8
RANGES_SHOWN = 4  # a kind's rank ranges printed before "and N more"


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges (``0-7, 16-23``), the first :data:`RANGES_SHOWN` of them and
    how many more."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in spans]
    more = len(text) - RANGES_SHOWN
    return ", ".join(text[:RANGES_SHOWN]) + (f" and {more} more range{'s' if more > 1 else ''}" if more > 0 else "")


@dataclass
class ZPGroup:
    attention_ranks: list[int]
    expert_ranks: list[int]

    @property
    def members(self) -> list[int]:
        return list(self.attention_ranks) + list(self.expert_ranks)


@dataclass
class Plan(JsonDataclass):
    model: str
    cluster: str
    seq_len: int
    devices: list[str]
    roles: list[str]
    zp_groups: list[ZPGroup]
    num_microbatches: int
    # sequences per batch on each global rank (0 on expert ranks); a step is ``waves`` batches
    seqs_per_rank: list[int]
    # placement[layer][expert] -> member index within a ZP group
    placement: list[list[int]]
    schedule: str = "zebra"
    asym_ea: bool = True
    # experts per ZP group that expert ranks could not hold (had to move), and at most how
    # many the attention ranks of a group can hold
    n_min: int = 0
    n_max: int = 0
    # placement without Asym-EA, [member][layer] counts (DistEP baseline)
    base_counts: list[list[int]] = field(default_factory=list)
    # DistEP's placement[layer][expert] -> member where its ids were chosen at a measured
    # routing (``place_at_load``); empty: base_counts in id order
    base_placement: list[list[int]] = field(default_factory=list)
    # whether the ids of both placements were chosen at a measured routing (the counts are
    # Asym-EA's either way); False: id order
    placed_at_load: bool = False
    distep_microbatches: int = 1
    # schedule -> {"step_time_s": ..., "tokens_per_s": ...}
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    # the global batch the plan was asked for (tokens); more than it holds if it was cut to fit
    requested_tokens: int = 0
    # what the predictions price: Lightning's precision and what it runs on
    precision: str = "16-mixed (fp16 tensor cores)"
    # the node of each rank (empty: one node)
    nodes: list[int] = field(default_factory=list)
    # tokens/s no schedule can beat here: every device busy on the work it is fastest at, no
    # communication (simulate/bound.py); 0: not computed
    bound_tokens_per_s: float = 0.0
    # batches per optimizer step (Lightning's accumulate_grad_batches): each runs the plan's
    # micro-batches, the gradients sync once; more waves hold fewer activations at a time
    waves: int = 1
    version: int = 1

    def __post_init__(self) -> None:
        self.zp_groups = [g if isinstance(g, ZPGroup) else ZPGroup(**g) for g in self.zp_groups]
        self.validate()

    # ---- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        W = len(self.devices)
        if W == 0:
            raise ValueError("Plan: empty cluster")
        if len(self.roles) != W or len(self.seqs_per_rank) != W:
            raise ValueError("Plan: devices, roles and seqs_per_rank need one entry per rank")
        bad = [r for r in self.roles if r not in ROLES]
        if bad:
            raise ValueError(f"Plan: unknown role(s) {bad}; roles are {ROLES}")
        seen: list[int] = []
        for g in self.zp_groups:
            seen += g.members
            for r in g.attention_ranks:
                if self.roles[r] != "attention":
                    raise ValueError(f"Plan: rank {r} is listed as attention rank but has role {self.roles[r]}")
            for r in g.expert_ranks:
                if self.roles[r] != "expert":
                    raise ValueError(f"Plan: rank {r} is listed as expert rank but has role {self.roles[r]}")
            if not g.attention_ranks:
                raise ValueError("Plan: a ZP group has no attention rank")
        if sorted(seen) != list(range(W)):
            raise ValueError(f"Plan: ZP groups must cover every rank exactly once, got {sorted(seen)}")
        size = len(self.zp_groups[0].members)
        for name, placement in (("placement", self.placement), ("base_placement", self.base_placement)):
            for l, row in enumerate(placement):
                for e, p in enumerate(row):
                    if not 0 <= p < size:
                        raise ValueError(f"Plan: {name}: expert {e} of layer {l} is placed on member {p}, group "
                                         f"has {size}")
        if self.base_placement and [len(r) for r in self.base_placement] != [len(r) for r in self.placement]:
            raise ValueError(f"Plan: base_placement places {[len(r) for r in self.base_placement]} experts per layer, "
                             f"placement {[len(r) for r in self.placement]}: both are [layer][expert] -> member")
        if self.base_placement and self.base_counts:
            held = [[row.count(p) for row in self.base_placement] for p in range(size)]
            if held != [list(c) for c in self.base_counts]:
                raise ValueError(f"Plan: base_placement holds {held} experts per member and layer, base_counts says "
                                 f"{self.base_counts}: DistEP's ids may be chosen, its counts not")
        if self.num_microbatches < 1:
            raise ValueError(f"Plan: num_microbatches={self.num_microbatches} must be >= 1")
        if isinstance(self.waves, bool) or not isinstance(self.waves, int) or self.waves < 1:
            raise ValueError(f"Plan: waves={self.waves!r} must be an integer >= 1 (batches per optimizer step)")

    # ---- queries -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def attention_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles) if role == "attention"]

    @property
    def expert_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles) if role == "expert"]

    @property
    def total_seqs(self) -> int:
        """Sequences per batch (one wave)."""
        return sum(self.seqs_per_rank)

    @property
    def step_seqs(self) -> int:
        """Sequences per optimizer step: every wave's batch."""
        return self.waves * self.total_seqs

    @property
    def global_batch_tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.step_seqs * self.seq_len

    @property
    def num_layers(self) -> int:
        return len(self.placement)

    @property
    def num_experts(self) -> int:
        return len(self.placement[0]) if self.placement else 0

    def group_of(self, rank: int) -> int:
        for g, grp in enumerate(self.zp_groups):
            if rank in grp.members:
                return g
        raise ValueError(f"rank {rank} is in no ZP group")

    def owner(self, group: int, layer: int, expert: int) -> int:
        """Global rank holding ``expert`` of ``layer`` in ZP group ``group``."""
        return self.zp_groups[group].members[self.placement[layer][expert]]

    def experts_on(self, rank: int, layer: int) -> list[int]:
        grp = self.zp_groups[self.group_of(rank)]
        p = grp.members.index(rank)
        return [e for e, q in enumerate(self.placement[layer]) if q == p]

    def expert_counts(self, group: int = 0) -> list[list[int]]:
        """``[member][layer]`` number of experts each member of a group holds."""
        size = len(self.zp_groups[group].members)
        out = [[0] * self.num_layers for _ in range(size)]
        for l, row in enumerate(self.placement):
            for p in row:
                out[p][l] += 1
        return out

    def placement_for(self, schedule: str) -> list[list[int]]:
        """DistEP runs without Asym-EA (the base placement: only memory-forced moves)."""
        if schedule == "distep" and self.base_placement:
            return self.base_placement
        if schedule == "distep" and self.base_counts:
            from .asym_ea import placement_from_counts

            return placement_from_counts(self.base_counts, self.num_experts, len(self.zp_groups[0].attention_ranks))
        return self.placement

    def offloaded(self) -> list[int]:
        """Per layer, experts held by attention ranks (Asym-EA) in one ZP group."""
        m = len(self.zp_groups[0].attention_ranks)
        return [sum(1 for p in row if p < m) for row in self.placement]

    # ---- serialisation -------------------------------------------------------------------
    json_indent = 1

    # ---- printing ------------------------------------------------------------------------
    def fastest_predicted(self) -> str | None:
        """The schedule a run can choose (:data:`RUN_AS`) with the most tokens/s in
        :attr:`predicted`; ``None`` where none fits."""
        rates = {name: p.get("tokens_per_s") for name, p in self.predicted.items() if name in RUN_AS}
        rates = {name: tps for name, tps in rates.items() if tps}
        return max(rates, key=rates.get) if rates else None

    def _smaller_ep_group(self, row: dict) -> int | None:
        """A row's EP group size (``ep_size``, the fastest the planner found) where it is
        smaller than the world; ``None`` for one group or another schedule."""
        size = row.get("ep_size")
        return size if size and size != self.world_size else None

    def run_as(self, name: str) -> str:
        """The settings that run schedule ``name`` as its row is priced: EP at the group size
        its row names."""
        size = self._smaller_ep_group(self.predicted.get(name, {}))
        return RUN_AS[name] + (f" strategy.expert_parallel_size={size}" if size else "")

    def _rank_table(self, multi: bool) -> list[str]:
        """A row per rank, up to :data:`TABLE_RANKS` ranks; past that a row per kind of rank
        (device, role, sequences and experts per layer alike), with how many and which: a
        1,024-rank plan printed a 1,043-line table at every run's start."""
        # each rank's group and member index found once (group_of and experts_on search the
        # groups: asked per rank and layer, 22 s for 10,000 ranks of 16 layers)
        where = {r: (g, i) for g, grp in enumerate(self.zp_groups) for i, r in enumerate(grp.members)}
        held = [Counter(row) for row in self.placement]  # per layer, experts per member index
        rows = [(self.devices[r], self.roles[r], self.seqs_per_rank[r],
                 " ".join(f"{layer[where[r][1]]:>2}" for layer in held)) for r in range(self.world_size)]
        if self.world_size <= TABLE_RANKS:
            node_head = f"{'node':>4}  " if multi else ""
            out = ["", f"  {'rank':>4}  {node_head}{'device':<8} {'role':<9} {'zp':>2}  {'seqs':>4}  experts per layer"]
            for r, (device, role, seqs, per_layer) in enumerate(rows):
                node = f"{self.nodes[r]:>4}  " if multi else ""
                out.append(f"  {r:>4}  {node}{device:<8} {role:<9} {where[r][0]:>2}  {seqs:>4}  {per_layer}")
            return out
        kinds: dict[tuple, list[int]] = {}
        for r, row in enumerate(rows):
            kinds.setdefault(row, []).append(r)
        width = max(len(row[3]) for row in rows)
        out = ["", f"  {self.world_size} ranks in {len(kinds)} kinds (device, role, sequences and experts per layer "
                   f"alike); plan.json has each rank's",
               f"  {'ranks':>5}  {'device':<8} {'role':<9} {'seqs':>4}  {'experts per layer':<{width}}  which"]
        for (device, role, seqs, per_layer), ranks in kinds.items():
            out.append(f"  {len(ranks):>5}  {device:<8} {role:<9} {seqs:>4}  {per_layer:<{width}}  "
                       f"{rank_ranges(ranks)}")
        return out

    def __str__(self) -> str:
        g0 = self.zp_groups[0]
        M, N = len(g0.attention_ranks), len(g0.expert_ranks)
        lines = [
            f"HeterMoE plan: model {self.model} on cluster {self.cluster} ({self.world_size} ranks), "
            f"schedule {self.schedule}",
            f"  seq_len {self.seq_len}, {self.step_seqs} sequences/step ({self.global_batch_tokens:,} "
            f"tokens), R = {self.num_microbatches} micro-batch{'es' if self.num_microbatches != 1 else ''}, "
            f"precision {self.precision}",
        ]
        if self.waves > 1:
            lines.append(f"  {self.waves} waves of {self.total_seqs} sequences per step (trainer.accumulate_grad_batches="
                         f"{self.waves}): activations of one wave in memory at a time")
        if self.requested_tokens and self.global_batch_tokens * 2 <= self.requested_tokens:
            lines.append(f"  WARNING: the global batch was cut from {self.requested_tokens:,} to "
                         f"{self.global_batch_tokens:,} tokens so that activations fit in memory")
        elif self.requested_tokens > self.global_batch_tokens:
            left = (self.requested_tokens - self.global_batch_tokens) // self.seq_len
            lines.append(f"  note: {left} of the {self.requested_tokens // self.seq_len} sequences asked for are left "
                         f"out so that the batch splits evenly over {len(self.zp_groups)} ZP group(s)"
                         + (f" and {self.waves} waves" if self.waves > 1 else ""))
        if N == 0:
            lines.append(f"  {len(self.zp_groups)} ZP group(s) of {M} ranks, all attention: experts sharded over them "
                         f"(the EP layout, with zebra's micro-batch overlap)")
        else:
            lines.append(f"  {len(self.zp_groups)} ZP group(s) of {M} attention + {N} expert ranks; experts per layer "
                         f"moved onto attention ranks by Asym-EA: {self.offloaded()}")
            lines.append(f"  memory: n_min = {self.n_min} experts per group had to leave the expert ranks (they do "
                         f"not fit there); the attention ranks can hold n_max = {self.n_max}")
        if self.placed_at_load:
            lines.append("  which expert goes where: chosen at the routing planned at (place_at_load), not id order")
        multi = len(set(self.nodes)) > 1
        lines += self._rank_table(multi)
        if multi:
            spans = [sorted({self.nodes[r] for r in grp.members}) for grp in self.zp_groups]
            if len(spans) <= TABLE_GROUPS:
                lines.append("  ZP groups' nodes: " + "; ".join(f"group {g}: {', '.join(map(str, s))}"
                                                          for g, s in enumerate(spans)))
            else:
                wide = sorted({len(s) for s in spans})
                lines.append(f"  ZP groups' nodes: each of the {len(spans)} groups spans "
                             f"{wide[0] if len(wide) == 1 else f'{wide[0]}-{wide[-1]}'} node(s) (plan.json has each "
                             f"group's ranks and nodes)")
        if self.predicted:
            base = self.predicted.get(self.schedule, {}).get("tokens_per_s")
            net = f"  {'over the network':>16}" if multi else ""
            bound = self.bound_tokens_per_s
            of_bound = f"  {'of bound':>8}" if bound else ""
            rel_head = f"{'throughput vs ' + self.schedule:<20}"
            lines += ["", f"  {'schedule':<12} {'step time':>10} {'tokens/s':>12}  {rel_head}{of_bound}{net}".rstrip()]
            for name, p in self.predicted.items():
                tps, step = p.get("tokens_per_s"), p.get("step_time_s")
                if not tps or not step:
                    lines.append(f"  {name:<12} {'does not fit in memory':>24}")
                    continue
                rel = f"{tps / base:.2f}x" if base else "n/a"
                frac = f"  {tps / bound:>8.1%}" if bound else ""
                gb = p.get("network_gb")
                cross = f"  {f'{gb:.2f} GB/step' if gb is not None else 'n/a':>16}" if multi else ""
                size = self._smaller_ep_group(p)
                groups = f"  EP groups of {size}" if size else ""
                lines.append(f"  {name:<12} {format_seconds(step):>10} {tps:>12,.0f}  {rel:<20}{frac}{cross}{groups}"
                             .rstrip())
            if bound:
                lines.append(f"  {'bound':<12} {'':>10} {bound:>12,.0f}  (every device busy on the work it is "
                             f"fastest at, no communication: no schedule beats it)")
            lines.append(f"  (throughput vs {self.schedule}: below 1x is slower than {self.schedule})")
            if any(self._smaller_ep_group(p) for p in self.predicted.values()):
                lines.append("  (EP groups of k: world/k groups of k consecutive ranks, each holding every expert "
                             "and exchanging inside itself, priced at the fastest k: strategy.expert_parallel_size=k)")
            fastest = self.fastest_predicted()
            if fastest is not None and fastest != self.schedule and base:
                ratio = self.predicted[fastest]["tokens_per_s"] / base
                if ratio >= TIE_RATIO:
                    lines.append(f"  fastest predicted: {fastest}, {ratio:.2f}x {self.schedule}: "
                                 f"{self.run_as(fastest)} runs it (strategy.mode=auto weighs it at the run's own "
                                 f"routing)")
            if multi:
                lines.append("  (over the network: the experts' exchange between nodes, every group, per step; "
                             "gradient rings that cross nodes are priced at the network's speed too)")
        return "\n".join(lines)


def format_seconds(t: float) -> str:
    """A duration in the unit that suits it: 1.23 s, 45.6 ms, 789 us."""
    if t >= 1.0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} us"
