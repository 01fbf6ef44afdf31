"""The planner: roles, ZP groups, micro-batch count and expert placement for a cluster.

Search, each candidate scored by the step simulator (zebra schedule):

1. **Roles.** Ranks are ordered by *attention affinity*: (expert time per token) /
   (attention time per token) on that device, highest first; a new GPU with
   FlashAttention is relatively much better at attention than at GEMMs. The first M
   ranks become attention ranks, for every M (any number of device tiers works: H100 +
   A40 + V100 just yields more cut points). Ranks that cannot hold the attention stack
   are never attention ranks.
2. **ZP groups.** G identical groups, G dividing the count of every device kind in both
   roles; groups are data-parallel replicas, each holding all experts.
3. **Micro-batches.** R from the fewest that fit in memory (the working set shrinks with
   the micro-batch) up to the sequences an attention rank has (micro-batches hold whole
   sequences).
4. **Placement.** Experts per member and layer with Asym-EA (see ``asym_ea.py``).
5. **Waves.** Zebra keeps every micro-batch's activations until its backward; where they
   crowd a member's experts, the step is also planned as 2, 4, ... batches of gradient
   accumulation (``make_plan``'s ``max_waves``), each searched as above, and the fastest
   count is kept. On more than ``MAX_SPLITS`` ranks the next count is searched where the
   best layout probed in it is faster; two families of one role split each, which often fit
   only in more waves, are planned in each count on their own: every rank attending
   (``_all_attention``) and each split the search kept (``_best_split_in_more_waves``).

On a cluster that is k alike copies of a smaller one (every kind of device or node k times,
``replica.py``) a few copies are planned first (16 and 64 ranks, and on more than 256 ranks a
copy of at most 256), and the whole is searched at each copy's role split times k: a copy's
plan repeated k times is a plan of the whole, so the whole plans at least as fast per GPU
as its copies, whose searches try their role splits finely. Where one copy is a quarter of
the whole or more, that stands in for the whole's own search.

A cheap first pass (one R per role split: a small one, or the fewest that fit) keeps the
two best splits; the full G × R search runs on those, from the most groups down (on
hundreds of ranks a group count is searched over every R only where its step at the best
plan's R comes within ``FAR_GROUPS`` of the best). Each layout is built and simulated once
per search. Where no split of the role order fits in
memory, every layout the plan format can express is checked by the memory model alone (``fit.py``): the fastest of
the feasible ones is planned, or the refusal names the binding constraint and the largest
batch that plans. Memory prices the dense optimizer state sharded over the attention
ranks where the strategy shards it. Everything is deterministic, so every rank computes
the same plan.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..apportion import apportion
from ..cluster.spec import ClusterConfig, LinkConfig, resolve_cluster
from ..cluster.devices import DeviceSpec, get_device
from ..cluster.topology import Topology, cluster_topology
from ..configs import ModelConfig, OptimConfig, from_cfg
from ..distinct import distinct
from ..profile.cost_model import CostModel, optimizer_step_traffic
from ..profile.memory import MemoryModel, format_bytes, small_training_state
from ..profile.profile import Profile
from ..profile.timer import CachedTimer, make_timer
from ..simulate.bound import throughput_bound
from ..simulate.predict import predict_step, predict_step_time
from ..simulate.schedules import SCHEDULES, ep_speed
from .asym_ea import AsymEAInput, assign_experts, placement_from_counts
from .fit import LayoutSearch, member_capacity, optimizer_shares
from .load_placement import place_at_load
from .plan import Plan, ZPGroup
from .replica import copy_counts, one_copy, stands_in

R_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MAX_WAVES = 4  # make_plan's default: at most this many batches accumulated per optimizer step


@dataclass
class ClusterView:
    name: str
    devices: list[DeviceSpec]
    # what transfers cross: a flat cluster is one node
    topology: Topology


def as_cluster(cluster: Any) -> ClusterView:
    """ClusterConfig / dict / list of device names or specs -> name, specs, link."""
    if isinstance(cluster, ClusterView):
        return cluster
    if isinstance(cluster, (list, tuple)):
        if not cluster:
            raise ValueError("empty cluster: name at least one device")
        devs = [get_device(d) for d in cluster]
        return ClusterView("custom", devs, Topology.flat(LinkConfig(), len(devs)))
    if not isinstance(cluster, ClusterConfig):
        cluster = from_cfg(ClusterConfig, cluster)
    return ClusterView(cluster.name, resolve_cluster(cluster), cluster_topology(cluster))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Search:
    def __init__(
        self,
        view: ClusterView,
        model: ModelConfig,
        seq_len: int,
        total_seqs: int,
        timer,
        asym: bool,
        max_microbatches: int,
        expert_load: list[list[float]] | None = None,
        sharded: bool = False,
        waves: int = 1,
        optimizer: OptimConfig | None = None,
        weight_averages: int = 0,
    ):
        self.view, self.model, self.S, self.total = view, model, seq_len, total_seqs
        self.waves = waves  # batches of total_seqs per optimizer step
        self.timer, self.asym, self.max_R = timer, asym, max_microbatches
        self.expert_load = expert_load
        self.mem = MemoryModel.for_optimizer(model, optimizer, weight_averages)
        self.devs = view.devices
        self.sharded = sharded
        self.profile: Profile | None = getattr(timer, "profile", None)
        self.last_error = ""
        self.errors: list[str] = []
        self.layouts: LayoutSearch | None = None  # set by plan_for_batch: the search when memory binds
        self._total_gb = sum(d.memory_gb for d in self.devs)
        self._memo: dict[tuple, Any] = {}
        self._chosen: tuple[Plan, float] | None = None  # candidate()'s faster way and its step
        # also try attention shares evened out over hosted experts (pass 2 on: see best())
        self.even_shares = False
        # a plan found elsewhere, the mark pass 2 probes group counts against (see best_for)
        self.bar: tuple[float, Plan] | None = None

    def _once(self, key: tuple, compute) -> Any:
        """``compute()`` once per key for the whole search: asked per device kind, not per
        rank (thousands of ranks share a few kinds), and per layout, not per visit."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def kinds(self) -> tuple[list[int], list[DeviceSpec]]:
        """Each rank's device as an index into the distinct devices."""
        return self._once(("kinds",), lambda: distinct(self.devs))

    def holdable(self, r: int) -> bool:
        """Rank ``r`` can hold the attention stack and one sequence, with the dense optimizer
        state sharded over every rank where it is sharded at all (its smallest share)."""
        dev = self.devs[r]
        share = dev.memory_gb / self._total_gb if self.sharded and len(self.devs) > 1 else 1.0
        return self._once(("holdable", dev), lambda: self.mem.attention_fits(
            dev, tokens_in_flight=self.S, mb_tokens=self.S, optimizer_share=share))

    def capacity(self, dev: DeviceSpec, *, group_seqs: int, R: int, seqs: int | None, share: float = 1.0) -> int:
        """:func:`member_capacity`, asked once per device kind and shape."""
        return self._once(("capacity", dev, group_seqs, R, seqs, share), lambda: member_capacity(
            self.mem, dev, seq_len=self.S, group_seqs=group_seqs, R=R, seqs=seqs, share=share))

    def held_at_most(self, dev: DeviceSpec, *, group_seqs: int, R: int, seqs: int | None, share: float = 1.0) -> int:
        """The experts (all layers) a member may hold, as Asym-EA is told: :meth:`capacity`
        within a measured profile's; ``seqs`` ``None``: an expert rank (none fit: 0), else an
        attention rank (-1 where the rest does not fit)."""
        cap = self.capacity(dev, group_seqs=group_seqs, R=R, seqs=seqs, share=share)
        if seqs is None:
            return self.profile_cap(dev, max(cap, 0), "expert")
        return cap if cap < 0 else self.profile_cap(dev, cap, "attention")

    # ---- building blocks -----------------------------------------------------------------
    def role_order(self) -> list[int]:
        t = self.timer
        S = self.S

        def affinity(d: DeviceSpec) -> float:
            return (t.expert(d, 4096) / 4096) / (t.attention(d, S) / S)

        holdable = [r for r in range(len(self.devs)) if self.holdable(r)]
        if not holdable:
            need = self.mem.attention_bytes(tokens_in_flight=S, mb_tokens=S)
            raise ValueError(
                f"no rank can hold the attention stack: it needs {format_bytes(need)} with one sequence of {S} "
                f"tokens, the largest device has {format_bytes(max(d.usable_bytes for d in self.devs))} usable; "
                f"not one sequence plans: add memory or shorten data.seq_len"
            )
        def rank_key(d: DeviceSpec) -> tuple[float, float]:
            return -affinity(d), -ep_speed(d, t, self.model, S)

        key = {r: (*self._once(("order", self.devs[r]), lambda: rank_key(self.devs[r])), r) for r in holdable}
        rest = [r for r in range(len(self.devs)) if r not in key]
        return sorted(key, key=key.get) + rest

    def groups(self, attn: list[int], expert: list[int], G: int, by_node: bool = False) -> list[ZPGroup] | None:
        """Each device kind dealt over the G groups: in turn, or (``by_node``) in runs of
        consecutive nodes, so that a group's ranks share nodes and its exchange stays off the
        network where the kinds allow."""
        node_of = self.view.topology.node_of

        def split(ranks: list[int]) -> list[list[int]] | None:
            by_kind: dict[str, list[int]] = {}
            for r in ranks:
                by_kind.setdefault(self.devs[r].name, []).append(r)
            if any(len(v) % G for v in by_kind.values()):
                return None
            out: list[list[int]] = [[] for _ in range(G)]
            for kind in sorted(by_kind):
                mine = sorted(by_kind[kind], key=lambda r: (node_of[r], r) if by_node else r)
                per = len(mine) // G
                for i, r in enumerate(mine):
                    out[i // per if by_node else i % G].append(r)
            return [sorted(x) for x in out] if by_node else out

        # each R of a split asks again
        a, e = self._once(("groups", tuple(attn), tuple(expert), G, by_node), lambda: (split(attn), split(expert)))
        if a is None or e is None:
            return None
        return [ZPGroup(attention_ranks=list(a[g]), expert_ranks=list(e[g])) for g in range(G)]

    def candidate(self, order: list[int], M: int, G: int, R: int) -> Plan | None:
        """A full plan for (M attention ranks, G groups, R micro-batches), or None if it does
        not fit. On several nodes the groups are dealt both ways (by turns and by nodes), and
        attention shares are tried both ways (:meth:`_candidate`): the fastest, as the
        simulator prices them, is kept."""
        ways = [False, True] if G > 1 and self.view.topology.num_nodes > 1 else [False]
        plans = [p for by_node in ways for p in self._candidate(order, M, G, R, by_node)]
        if len(plans) < 2:
            return plans[0] if plans else None
        self._chosen = min(((p, self._sim(p)) for p in plans), key=lambda pt: pt[1])
        return self._chosen[0]

    def _candidate(self, order: list[int], M: int, G: int, R: int, by_node: bool) -> list[Plan]:
        """The plans of one layout (none where it does not fit): attention shares in
        proportion to attention speed, and, where they differ, the shares that even out each
        attention member's attention and hosted experts once Asym-EA placed them (with very
        unequal devices a whole expert is a large part of a slow member's step)."""
        m, S, devs = self.model, self.S, self.devs
        attn, expert = sorted(order[:M]), sorted(order[M:])
        groups = self.groups(attn, expert, G, by_node)
        if groups is None:
            return []
        group_seqs = self.total // G
        if group_seqs < 1:
            self.last_error = f"{self.total} sequences cannot feed {G} ZP groups"
            return []
        g0 = groups[0]

        kind_of, kinds = self.kinds()

        def per_kind(ranks: list[int], value) -> list:
            """``value(dev)`` for each rank, asked once per device kind (one group of
            thousands of ranks has a few)."""
            values = [value(d) for d in kinds]
            return [values[kind_of[r]] for r in ranks]

        speeds = per_kind(g0.attention_ranks, lambda d: self._once(("ep_speed", d), lambda: ep_speed(d, self.timer, m, S)))
        member_seqs = apportion(group_seqs, speeds)
        if R > max(member_seqs):
            self.last_error = (f"a micro-batch needs a sequence: the busiest attention rank of {G} ZP group(s) "
                               f"gets {max(member_seqs)}, so strategy.num_microbatches must be <= {max(member_seqs)}")
            return []
        k, E, L = m.moe.top_k, m.moe.num_experts, m.n_layers
        mb_group_tokens = group_seqs * S / R
        shares = optimizer_shares(devs, attn, self.sharded)
        exp_cap = per_kind(g0.expert_ranks, lambda d: self.held_at_most(d, group_seqs=group_seqs, R=R, seqs=None))
        exp_t = per_kind(g0.expert_ranks, lambda d: self.timer.expert(d, mb_group_tokens * k / E))
        attn_xt = per_kind(g0.attention_ranks, lambda d: self.timer.expert(d, mb_group_tokens * k / E))

        def place(seqs: list[int]):
            """Asym-EA's placement for these attention shares (None where they do not fit)."""
            attn_cap, attn_t = [], []
            alike: dict[tuple, tuple[int, float]] = {}  # per device, share and sequences
            for r, s in zip(g0.attention_ranks, seqs):
                key = (id(devs[r]), s, shares[r])
                if key not in alike:
                    cap = self.held_at_most(devs[r], group_seqs=group_seqs, R=R, seqs=s, share=shares[r])
                    if cap < 0:
                        self.last_error = (
                            f"attention rank {r} ({devs[r].name}) cannot hold the attention stack and the activations "
                            f"of {s} sequences of {S} tokens"
                        )
                        return None
                    alike[key] = (cap, self.timer.attention(devs[r], s * S / R))
                cap, t = alike[key]
                attn_cap.append(cap)
                attn_t.append(t)
            try:
                return assign_experts(
                    AsymEAInput(L, E, attn_t, attn_xt, exp_t, attn_cap, exp_cap, num_microbatches=min(R, 4)),
                    asym=self.asym,
                )
            except ValueError as err:
                self.last_error = str(err)
                return None

        res = place(member_seqs)
        if res is None:
            return []
        tried = [(member_seqs, res)]
        if self.even_shares and len(g0.attention_ranks) > 1:
            # forward seconds per step: a sequence's attention, and each hosted expert
            per_seq = [L * self.timer.attention(devs[r], S) for r in g0.attention_ranks]

            def hosted(placed) -> list[float]:
                return [R * sum(c) * x for c, x in zip(placed.counts, attn_xt)]

            def busiest(seqs: list[int], placed) -> float:
                return max(a * n + h for a, n, h in zip(per_seq, seqs, hosted(placed)))

            even, placed = member_seqs, res
            for _ in range(EVEN_ROUNDS):  # the placement follows the shares: a round or two settle both
                again = rebalanced_seqs(group_seqs, per_seq, hosted(placed))
                if again == even or R > max(again) or busiest(again, placed) >= SHARES_GAIN * busiest(even, placed):
                    break
                trial = place(again)
                if trial is None:
                    break
                even, placed = again, trial
            # simulated beside the first only where the members' sums say it is clearly better
            # (a search prices thousands of layouts: most are even already)
            if even != member_seqs and busiest(even, placed) < SHARES_GAIN * busiest(member_seqs, res):
                tried.append((even, placed))
        return [self._build(groups, attn, R, seqs, placed) for seqs, placed in tried]

    def _build(self, groups: list[ZPGroup], attn: list[int], R: int, member_seqs: list[int], res) -> Plan:
        """The plan of a layout at these attention shares and Asym-EA's placement for them."""
        m, S, devs = self.model, self.S, self.devs
        E = m.moe.num_experts
        g0 = groups[0]
        M_g = len(g0.attention_ranks)
        attn_set = set(attn)
        roles = ["attention" if r in attn_set else "expert" for r in range(len(devs))]
        seqs = [0] * len(devs)
        for grp in groups:
            for r, s in zip(grp.attention_ranks, member_seqs):
                seqs[r] = s
        plan = Plan(
            model=m.name,
            cluster=self.view.name,
            seq_len=S,
            devices=[d.name for d in devs],
            roles=roles,
            zp_groups=groups,
            num_microbatches=R,
            seqs_per_rank=seqs,
            placement=placement_from_counts(res.counts, E, M_g),
            asym_ea=self.asym,
            n_min=res.n_min,
            n_max=res.n_max,
            base_counts=res.base_counts,
            distep_microbatches=self.distep_R(g0, member_seqs, res.base_counts),
            nodes=list(self.view.topology.node_of) if self.view.topology.num_nodes > 1 else [],
            waves=self.waves,
        )
        return plan

    def profile_cap(self, dev: DeviceSpec, modelled: int, role: str) -> int:
        """A measured capacity (profile) bounds the modelled one: the smaller wins."""
        if self.profile is None or dev.name not in self.profile.devices:
            return modelled
        dp = self.profile.get(dev.name)
        measured = dp.max_experts_attention if role == "attention" else dp.max_experts_expert
        return modelled if measured is None else min(modelled, max(int(measured), 0))

    def distep_R(self, g0: ZPGroup, member_seqs: list[int], base: list[list[int]]) -> int:
        """Fewest micro-batches DistEP needs (one micro-batch of activations in flight); as
        many as an attention member has sequences where none fits."""
        M = len(g0.attention_ranks)
        members = [(self.devs[r], member_seqs[p] if p < M else None, sum(base[p])) for p, r in enumerate(g0.members)]
        return self.mem.fewest_microbatches(members, self.S) or max(member_seqs)

    def _sim(self, plan: Plan) -> float:
        """The simulated zebra step of ``plan``; the way :meth:`candidate` just chose is not
        simulated again when it is scored right after."""
        if self._chosen is not None and self._chosen[0] is plan:
            return self._chosen[1]
        return predict_step_time("zebra", self.devs, self.model, self.view.topology, self.timer, plan=plan,
                                 expert_load=self.expert_load)

    def score(self, plan: Plan) -> tuple[float, Plan]:
        """Simulated zebra step time, and the plan to keep. Asym-EA's greedy scores forward
        times only; if the full step (backward, LM head, transfers) says its moves do not
        pay, the plan with the base placement (nothing offloaded beyond what memory forces)
        is kept instead. ``plan`` itself is left as it is."""
        t = self._sim(plan)
        if plan.asym_ea and plan.base_counts and plan.expert_counts(0) != plan.base_counts:
            m_att = len(plan.zp_groups[0].attention_ranks)
            base = copy.copy(plan)
            base.placement = placement_from_counts(plan.base_counts, self.model.moe.num_experts, m_att)
            t_base = self._sim(base)
            if t_base < t:
                return t_base, base
        return t, plan

    def r_values(self) -> list[int]:
        return [r for r in R_CANDIDATES if r <= self.max_R] or [1]

    # ---- the search --------------------------------------------------------------------------
    def best_for(self, order: list[int], M: int, Gs: list[int], R_list: list[int],
                 bar: tuple[float, Plan] | None = None) -> tuple[float, Plan] | None:
        """The fastest plan with M attention ranks over the group counts ``Gs`` (in the order
        given); R ascending, stopping once two larger R in a row do not help. ``bar``: the
        search's best so far, the mark a group count is probed against on many ranks."""
        best = None
        worse_groups = 0
        many = len(Gs) > MAX_GROUP_COUNTS
        for G in Gs:
            ref = min((x for x in (best, bar) if x is not None), key=lambda x: x[0], default=None)
            if len(self.devs) > MAX_SPLITS and ref is not None and ref[1].num_microbatches in R_list:
                # Hundreds of ranks: a group count is first tried at the best plan's R, and
                # searched over every R only where that comes within FAR_GROUPS of the best
                # (R moves a layout's step by a few percent; group counts by tens)
                probe = self.scored(order, M, G, ref[1].num_microbatches)
                if probe is not None and probe[0] > ref[0] * (1 + FAR_GROUPS):
                    worse_groups += 1
                    if many and worse_groups >= 2:
                        break
                    continue
            local, worse = None, 0
            for R in R_list:
                got = self.scored(order, M, G, R)
                if got is None:
                    continue
                t, plan = got
                if local is None or t < local * (1 - 1e-9):
                    local, worse = t, 0
                else:
                    worse += 1
                    if worse >= 2:
                        break
                if best is None or t < best[0] * (1 - 1e-9):
                    best = (t, plan)
            # many group counts (thousands of ranks): from the most groups down, stopping once
            # two in a row do not beat the best; fewer groups only widen the exchange further
            if many:
                if local is not None:  # a group count too small to fit is no evidence either way
                    worse_groups = 0 if best is not None and local <= best[0] else worse_groups + 1
                if worse_groups >= 2:
                    break
        return best

    def scored(self, order: list[int], M: int, G: int, R: int) -> tuple[float, Plan] | None:
        """:meth:`score` of :meth:`candidate`, once per layout: the two passes (and the
        refinement of the role split) come back to the same ones."""
        def build_and_score() -> tuple[float, Plan] | None:
            plan = self.candidate(order, M, G, R)
            if plan is not None:
                return self.score(plan)
            if self.last_error:
                self.errors.append(self.last_error)
                self.last_error = ""
            return None

        return self._once(("scored", tuple(order[:M]), G, R), build_and_score)

    def group_counts(self, M: int, pinned: int | None) -> list[int]:
        W = len(self.devs)
        return [pinned] if pinned is not None else _divisors(math.gcd(M, W - M) if W - M else M)

    def most_groups(self, order: list[int], M: int) -> int:
        attn, expert = sorted(order[:M]), sorted(order[M:])
        return next((G for G in reversed(self.group_counts(M, None)) if self.groups(attn, expert, G) is not None), 1)

    def best(self, order: list[int], Ms: list[int], Rs: list[int], pinned: int | None) -> Plan:
        """Pass 1 ranks the role splits (each with one ZP group and a small R, and on wide
        clusters its most groups too); pass 2 searches every group count and R on the two
        best, and on the best of the splits that fit only with fewer groups than their most."""
        probe = [r for r in Rs if r <= 2][-1:] or Rs[:1]
        tried: dict[int, float | None] = {}
        # On many ranks or several nodes one ZP group over the whole cluster is the worst case
        # for the exchange (every token to every rank, across the network), which would rank
        # the role splits by that alone: such clusters also probe each split with its most groups.
        wide = self.view.topology.num_nodes > 1 or len(Ms) > MAX_SPLITS

        # splits where neither one group nor the most fit at any R, priced at the most groups
        # that do: kept apart from the ranking above, so that pass 2 looks at the best of
        # them besides (never instead of) the splits it would take anyway
        fitted: dict[int, float] = {}

        # one R per split: the probe, or where it does not fit the fewest micro-batches that do
        R_order = probe + [R for R in Rs if R > probe[0]]

        def split_time(M: int) -> float | None:
            if M not in tried:
                Gs = [pinned] if pinned else sorted({1, self.most_groups(order, M)} if wide else {1})
                got = next((g for g in (self.best_for(order, M, Gs, [R]) for R in R_order) if g is not None), None)
                tried[M] = None if got is None else got[0]
                if got is None and wide and not pinned:
                    fit = next((f for f in (self.most_groups_that_fit(order, M, R) for R in R_order) if f), None)
                    if fit is not None:
                        fitted[M] = fit[0]
            return tried[M]

        for M in role_splits(Ms, [self.devs[r].name for r in order]):
            split_time(M)
        if len(Ms) > MAX_SPLITS:
            refine_splits(Ms, tried, split_time)
        first = [M for _, M in sorted((t, M) for M, t in tried.items() if t is not None)[:2]]
        binds = not first
        first += [M for _, M in sorted((t, M) for M, t in fitted.items())[:1] if M not in first]
        best = self.finals(order, first, Rs, pinned)
        if binds:  # no split fits as pass 1 probes it: the layouts the memory check passes
            try:
                got = self.when_memory_binds(order, Rs)
            except ValueError:
                if best is None:
                    raise
            else:
                if best is None or got[0] < best[0] * (1 - 1e-9):
                    best = got
        assert best is not None
        return best[1]

    def finals(self, order: list[int], Ms: list[int], Rs: list[int], pinned: int | None
               ) -> tuple[float, Plan] | None:
        """Pass 2: every group count and R of each role split in ``Ms``, the fastest kept."""
        best = None
        # Pass 2 also tries each layout's evened-out attention shares (see _candidate): only
        # here, where few layouts are left, since each costs placements and a simulation
        self.even_shares = True
        for M in Ms:
            got = self.best_for(order, M, self.group_counts(M, pinned)[::-1], Rs,
                                bar=min((x for x in (best, self.bar) if x is not None), key=lambda x: x[0], default=None))
            if got is not None and (best is None or got[0] < best[0] * (1 - 1e-9)):
                best = got
        return best

    def most_groups_that_fit(self, order: list[int], M: int, R: int) -> tuple[float, Plan] | None:
        """The scored layout of the most ZP groups (more than one) the split deals its device
        kinds into evenly and that fits in memory at R micro-batches: on thousands of ranks
        the most groups can be too small to hold a large model's experts, while fewer, larger
        ones do."""
        attn, expert = sorted(order[:M]), sorted(order[M:])
        even = (G for G in reversed(self.group_counts(M, None)) if G > 1 and self.groups(attn, expert, G) is not None)
        return next((got for got in (self.scored(order, M, G, R) for G in even) if got is not None), None)

    def when_memory_binds(self, order: list[int], Rs: list[int]) -> tuple[float, Plan]:
        """No split of the role order fits: every layout the plan format can express is
        checked for memory alone (any ranks of each kind attending, every group count, the
        most micro-batches allowed); the fastest of the feasible ones nearest to the role
        order is planned, or the refusal names the binding constraint and the largest batch."""
        layouts = self.layouts
        if layouts is None:
            seen = list(dict.fromkeys(self.errors))[:3]
            raise ValueError(f"no feasible plan for {self.model.name} on {self.view.name}: "
                             + ("; ".join(seen) or "nothing fits"))
        verdicts = layouts.verdicts(self.total)
        feasible = [v.layout for v in verdicts if v.fits]
        if not feasible:
            raise ValueError(self.refusal(layouts, verdicts))
        position = {r: i for i, r in enumerate(order)}
        by_vector: dict[tuple[int, ...], list] = {}
        for lay in feasible:
            by_vector.setdefault(lay.attention, []).append(lay)
        best = None
        for a, lays in sorted(by_vector.items(), key=lambda kv: self.mean_position(kv[0], position))[:FALLBACK_VECTORS]:
            attn = self.attention_of(a, order)
            held = set(attn)
            rest = [r for r in order if r not in held]
            R_max = max(lay.R for lay in lays)
            R_list = sorted({R for R in Rs if R <= R_max} | {R_max}) if len(Rs) > 1 else Rs
            got = self.best_for(attn + rest, len(attn), sorted({lay.G for lay in lays}), R_list)
            if got is not None and (best is None or got[0] < best[0] * (1 - 1e-9)):
                best = got
        assert best is not None, "a layout the memory check passed did not plan"
        return best

    def attention_of(self, a: tuple[int, ...], order: list[int]) -> list[int]:
        """``a`` ranks of each kind (kinds sorted by name): each kind's first in role order."""
        want = dict(zip(sorted({d.name for d in self.devs}), a, strict=True))
        out = []
        for r in order:
            if want[self.devs[r].name] > 0:
                out.append(r)
                want[self.devs[r].name] -= 1
        return out

    def mean_position(self, a: tuple[int, ...], position: dict[int, int]) -> float:
        attn = self.attention_of(a, list(position))
        return sum(position[r] for r in attn) / len(attn)

    def refusal(self, layouts: LayoutSearch, verdicts: list) -> str:
        if not verdicts:
            return (f"no layout of {self.model.name} on {self.view.name} meets the pinned choices "
                    f"(num_attention_ranks, num_zp_groups, require_expert_ranks): pin fewer of them")
        v = layouts.closest(verdicts)
        n = layouts.largest()
        S = self.S
        if not n:
            most = "not one sequence plans: add memory or shorten data.seq_len"
        elif n < self.total:
            most = (f"the largest batch that plans is {n} sequence(s) (global_batch_tokens={n * S:,}): ask for at "
                    f"most that, or add memory")
        else:  # pins leave gaps between the batches that plan
            most = (f"the largest batch that plans is {n} sequence(s) (global_batch_tokens={n * S:,}), but the "
                    f"pinned choices refuse this one: ask for that, or pin fewer choices")

        proof = "no layout" if layouts.exhaustive else "no layout tried"
        return (f"{proof} of {self.model.name} on {self.view.name} fits {self.total} sequences of {S} tokens; "
                f"closest: {layouts.describe(v.layout)}, where {v.why}; {most}")


# Beyond this many group counts for a role split, pass 2 walks them from the most groups down
# and stops once two in a row lose (a cluster of thousands of ranks has dozens of divisors).
MAX_GROUP_COUNTS = 6

# On more than MAX_SPLITS ranks, a group count whose step at the best plan's R is this much
# slower than the best is not searched over every R.
FAR_GROUPS = 0.10

# Feasible attention-count vectors planned (simulated) when memory binds, nearest the role order first.
FALLBACK_VECTORS = 4

# Role splits tried one by one up to this many; beyond, a grid through every boundary between
# device kinds, then a local search around the best (the step time varies smoothly with the
# split between boundaries).
MAX_SPLITS = 48


# the evened-out attention shares are simulated too where their busiest member's sum is this
# much of the first shares' (or less); placed again at most this many times
SHARES_GAIN = 0.97
EVEN_ROUNDS = 2


def rebalanced_seqs(total: int, per_seq: list[float], hosted: list[float], lo: int = 1) -> list[int]:
    """``total`` sequences over attention members so that each one's attention
    (``per_seq`` seconds a sequence) plus the experts it hosts (``hosted`` seconds) comes out
    even, at least ``lo`` each: the level is found by bisection, then apportioned."""
    def seqs_at(level: float) -> list[float]:
        return [max(float(lo), (level - h) / a) for a, h in zip(per_seq, hosted)]

    low, high = 0.0, max(h + a * total for a, h in zip(per_seq, hosted))
    for _ in range(60):
        mid = (low + high) / 2
        if sum(seqs_at(mid)) < total:
            low = mid
        else:
            high = mid
    return apportion(total, seqs_at(high))


def role_splits(Ms: list[int], kinds_in_order: list[str]) -> list[int]:
    """The attention-rank counts pass 1 tries: all of them on small clusters; on large ones
    every boundary between device kinds in role order (and its neighbours) and an even grid."""
    if len(Ms) <= MAX_SPLITS:
        return list(Ms)
    lo, hi = Ms[0], Ms[-1]
    picks = {lo, hi}
    for M in range(1, len(kinds_in_order)):
        if kinds_in_order[M] != kinds_in_order[M - 1]:
            picks.update({M - 1, M, M + 1})
    picks.update(range(lo, hi + 1, grid_step(Ms)))
    return sorted(M for M in picks if lo <= M <= hi)


def grid_step(Ms: list[int]) -> int:
    return max((Ms[-1] - Ms[0]) // 24, 1)


def refine_splits(Ms: list[int], tried: dict[int, float | None], evaluate) -> None:
    """Around the two best splits, steps that halve down to one rank."""
    valid = set(Ms)
    best = sorted((t, M) for M, t in tried.items() if t is not None)[:2]
    for _, start in best:
        here, t_here = start, tried[start]
        step = grid_step(Ms)
        while step >= 1:
            moved = False
            for M in (here - step, here + step):
                if M in valid:
                    t = evaluate(M)
                    if t is not None and t < t_here * (1 - 1e-9):
                        here, t_here, moved = M, t, True
            if not moved:
                step //= 2


def make_plan(cluster: Any, model: ModelConfig | dict, *, seq_len: int, global_batch_tokens: int,
              shrink_to_fit: int = 0, max_waves: int = MAX_WAVES, **kwargs: Any) -> Plan:
    """Plan ``model`` on ``cluster``; see :func:`plan_for_batch` for the arguments.

    Where activations bind (fewer sequences in flight would let a rank hold more experts, or
    the batch fits nowhere at once), the step is also planned as 2, 4, ... waves (batches
    accumulated per optimizer step, up to ``max_waves``): the fastest is kept, and the plan's
    ``waves`` says how many (``trainer.accumulate_grad_batches``). With ``shrink_to_fit=n``,
    a batch that fits in no number of waves is halved up to ``n`` times; the plan then
    records the batch it was asked for (``requested_tokens``) and its table warns that the
    batch was cut."""
    if isinstance(max_waves, bool) or not isinstance(max_waves, int) or max_waves < 1:
        raise ValueError(f"max_waves={max_waves!r} is invalid: must be an integer >= 1 (1: no gradient accumulation)")
    err: ValueError | None = None
    for halvings in range(shrink_to_fit + 1):
        tokens = global_batch_tokens >> halvings
        if halvings and tokens < seq_len:
            break  # halving went below one sequence: the first attempt's error stands
        try:
            plan = _fastest_waves(cluster, model, seq_len=seq_len, global_batch_tokens=tokens, max_waves=max_waves,
                                  **kwargs)
        except ValueError as e:
            err = err or e
            continue
        plan.requested_tokens = global_batch_tokens
        return plan
    assert err is not None
    raise err


def _fastest_waves(cluster: Any, model: ModelConfig | dict, *, seq_len: int, global_batch_tokens: int,
                   max_waves: int, copies: bool = True, **kwargs: Any) -> Plan:
    """The fastest plan of the batch in 1, 2, 4, ... waves. More waves are searched only where
    the last count's activations bound its plan (each wave adds a pipeline fill and drain)
    and only while they pay. On more than ``MAX_SPLITS`` ranks, where one search takes
    seconds, the next count is searched only once the best layout so far, probed in that
    many waves, is faster (a probe is one layout, not a second search); there, two families
    of one role split each are also planned in more waves, where the gate cannot see them:
    every rank attending (:func:`_all_attention`) and each split the search kept
    (:func:`_best_split_in_more_waves`). A cluster of alike copies is planned from its copies
    first (:func:`_from_copies`; ``copies=False``: a copy's own search, which does not split
    it again)."""
    view = as_cluster(cluster)
    total = global_batch_tokens // seq_len if seq_len >= 1 else 0
    pinned = any(kwargs.get(pin) is not None for pin in PINS)
    ks = copy_counts(view, total) if copies and not pinned and seq_len >= 1 else []
    copied = _from_copies(view, model, ks, seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                          max_waves=max_waves, **kwargs) if ks else None
    if copied is not None and stands_in(view, ks):
        return copied  # a copy of a quarter of the cluster or more was searched whole
    best: Plan | None = None
    searched: list[Plan] = []  # the search's best of each wave count, each faster than the last
    err: ValueError | None = None
    waves = 1
    while waves == 1 or (waves <= max_waves and total >= waves and total % waves == 0):
        if best is not None and len(view.devices) > MAX_SPLITS and not _probe_pays(
                best, waves, view, model, seq_len=seq_len, global_batch_tokens=global_batch_tokens, **kwargs):
            break
        try:
            plan = plan_for_batch(view, model, seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                                  waves=waves, **kwargs)
        except ValueError as e:
            if best is not None:
                break
            err = err or e  # nothing fits at once: fewer sequences in flight may
            waves *= 2
            continue
        if best is not None and _zebra_rate(plan) <= _zebra_rate(best) * (1 + 1e-9):
            break
        best = plan
        searched.append(plan)
        if waves * 2 > max_waves or not _activations_bind_as_asked(plan, view, model, kwargs):
            break
        waves *= 2
    if copied is not None and (best is None or _zebra_rate(copied) > _zebra_rate(best) * (1 + 1e-9)):
        best = copied
    if len(view.devices) > MAX_SPLITS and not pinned:
        families = [_all_attention(view, model, seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                                   max_waves=max_waves, bar=best, **kwargs)]
        if best is not None:
            mark = families[0] if families[0] is not None and _zebra_rate(families[0]) > _zebra_rate(best) else best
            # each split the search (or the copies) found best, from the fewest waves it was found in
            first: dict[int, Plan] = {}
            for p in sorted(filter(None, [*searched, copied]), key=lambda p: p.waves):
                first.setdefault(len(p.attention_ranks), p)
            for found in first.values():
                families.append(_best_split_in_more_waves(found, view, model, seq_len=seq_len,
                                                          global_batch_tokens=global_batch_tokens, max_waves=max_waves,
                                                          bar=mark, **kwargs))
        faster = [p for p in families
                  if p is not None and (best is None or _zebra_rate(p) > _zebra_rate(best) * (1 + 1e-9))]
        if faster:
            spread = max(faster, key=_zebra_rate)  # the first of equals
            _predict_as_asked(spread, view, model, seq_len, kwargs)
            return spread
    if best is None:
        assert err is not None
        if max_waves > 1 and "the largest batch that plans is" in str(err):
            raise ValueError(f"{err} (in one wave: a step of up to {max_waves} waves plans up to {max_waves} times "
                             f"that, where the waves divide its sequences evenly)") from None
        raise err
    return best


PINS = ("num_attention_ranks", "num_zp_groups", "num_microbatches")  # a pinned layout plans as pinned


def _model_config(model: ModelConfig | dict) -> ModelConfig:
    return model if isinstance(model, ModelConfig) else from_cfg(ModelConfig, model)


def _search_timer(model: ModelConfig, seq_len: int, timer: Any, profile: Profile | None,
                  cost_model: CostModel | None, optimizer: OptimConfig | None = None) -> CachedTimer:
    """The timer a search asks, each answer remembered: the given one as it is, else the
    profile's or the cost model's, its optimizer step priced as ``optimizer``'s where one
    is given (:func:`optimizer_step_traffic`; else the cost model's own, the pack's default)."""
    if timer is None:
        if optimizer is not None:
            cost_model = replace(cost_model or CostModel(), optimizer_bytes_per_param=optimizer_step_traffic(optimizer))
        timer = make_timer(model, seq_len, profile, cost_model)
    return CachedTimer(timer)


def _from_copies(view: ClusterView, model: ModelConfig | dict, ks: list[int], *, seq_len: int,
                 global_batch_tokens: int, max_waves: int, **kwargs: Any) -> Plan | None:
    """The cluster as ``k`` alike copies of a smaller one, for each ``k`` in ``ks``
    (``replica.py``): each copy planned by the whole search (waves and all), then the whole
    cluster searched at each copy's role split times k, over every group count and R, at
    that copy's waves: the fastest, or ``None`` where no copy plans."""
    # only zebra's step is compared on the way; the plan kept is predicted in full after
    zebra = {**kwargs, "schedules": ("zebra",), "_brief": True}
    splits: dict[int, list[int]] = {}  # waves -> attention-rank counts
    for k in ks:
        try:
            one = _fastest_waves(one_copy(view, k), model, seq_len=seq_len,
                                 global_batch_tokens=global_batch_tokens // k, max_waves=max_waves, copies=False,
                                 **zebra)
        except ValueError:
            continue  # the copy is too small to hold the model: larger ones may
        splits.setdefault(one.waves, []).append(k * len(one.attention_ranks))
    best = None
    for waves, Ms in splits.items():
        try:
            plan = plan_for_batch(view, model, seq_len=seq_len, global_batch_tokens=global_batch_tokens, waves=waves,
                                  _splits=Ms, **zebra)
        except ValueError:
            continue
        if best is None or _zebra_rate(plan) > _zebra_rate(best) * (1 + 1e-9):
            best = plan
    if best is not None:
        _predict_as_asked(best, view, model, seq_len, kwargs)
    return best


def _predict_as_asked(plan: Plan, view: ClusterView, model: ModelConfig | dict, seq_len: int,
                      kwargs: dict) -> None:
    """A plan found by a brief comparison predicted as its caller's search asks: every
    schedule in full, or zebra's step alone where that search is itself brief."""
    model = _model_config(model)
    timer = _search_timer(model, seq_len, kwargs.get("timer"), kwargs.get("profile"), kwargs.get("cost_model"),
                          kwargs.get("optimizer"))
    plan.predicted = predict(plan, view, model, timer, kwargs.get("schedules", SCHEDULES), kwargs.get("expert_load"),
                             brief=kwargs.get("_brief", False), optimizer=kwargs.get("optimizer"),
                             weight_averages=kwargs.get("weight_averages", 0))


def _probe_pays(best: Plan, waves: int, cluster: Any, model: Any, **kwargs: Any) -> bool:
    """``best``'s layout (attention ranks, groups, micro-batches; what the caller pinned stays
    pinned) planned in ``waves`` waves is faster than ``best``."""
    pins = {"num_attention_ranks": len(best.attention_ranks),
            "num_zp_groups": len(best.zp_groups), "num_microbatches": best.num_microbatches}
    for key, value in pins.items():
        if kwargs.get(key) is None:
            kwargs[key] = value
    kwargs["schedules"] = ("zebra",)  # the baselines' predictions are not compared here
    kwargs["_brief"] = True
    try:
        probe = plan_for_batch(cluster, model, waves=waves, **kwargs)
    except ValueError:
        return False
    return _zebra_rate(probe) > _zebra_rate(best) * (1 + 1e-9)


def _all_attention(view: ClusterView, model: Any, *, seq_len: int, global_batch_tokens: int, max_waves: int,
                   bar: Plan | None = None, **kwargs: Any) -> Plan | None:
    """The fastest plan with every rank attending (each holding experts too), over every
    group count and R, in 1, 2, 4, ... waves while its activations bind: on thousands of
    ranks such groups are often the fastest once their activations fit (Qwen3-30B-A3B on
    10,000 GPUs on nodes: 250 groups of 40 in two waves, +25% over the plan of the whole's
    search), yet the search, which only probes its best layout of one wave in more waves
    where one search costs seconds, never sees them. ``None`` where none fits."""
    return _split_in_waves(view, model, len(view.devices), 1, seq_len=seq_len, global_batch_tokens=global_batch_tokens,
                           max_waves=max_waves, bar=bar, **kwargs)


def _best_split_in_more_waves(best: Plan, view: ClusterView, model: Any, *, seq_len: int, global_batch_tokens: int,
                              max_waves: int, bar: Plan | None = None, **kwargs: Any) -> Plan | None:
    """The search's best role split over every group count and R in 2, 4, ... times its
    waves, where its activations bind. The wave gate probes only the best layout itself in
    more waves; other group counts of its split may fit only there and win (DeepSeek-V2-Lite
    on 10,000 GPUs on nodes: the search keeps 250 groups of 20+20 in one wave and every rank
    attending in two, while at the one-wave split 125 groups of 40+40 in four waves plan 17%
    faster than both). One split costs a fraction of the search. ``None`` where it does not
    bind or nothing plans."""
    split = len(best.attention_ranks)
    if split == len(view.devices) or not _activations_bind_as_asked(best, view, model, kwargs):
        return None  # every rank attending is its own family; unbound activations gain nothing from waves
    return _split_in_waves(view, model, split, best.waves * 2, seq_len=seq_len,
                           global_batch_tokens=global_batch_tokens, max_waves=max_waves, bar=bar, **kwargs)


def _split_in_waves(view: ClusterView, model: Any, split: int, first: int, *, seq_len: int, global_batch_tokens: int,
                    max_waves: int, bar: Plan | None = None, **kwargs: Any) -> Plan | None:
    """The fastest plan at ``split`` attention ranks, over every group count and R, in
    ``first``, twice as many, ... waves while each count plans faster than the last and its
    activations bind. Zebra's step alone is compared (the caller predicts the plan it keeps;
    group counts far slower than ``bar``, the plan to beat, are not searched over every R)."""
    total = global_batch_tokens // seq_len if seq_len >= 1 else 0
    brief = {**kwargs, "schedules": ("zebra",), "_brief": True}
    best = None
    waves = first
    while waves <= max_waves and total >= waves and total % waves == 0:
        try:
            plan = plan_for_batch(view, model, seq_len=seq_len, global_batch_tokens=global_batch_tokens, waves=waves,
                                  _splits=[split], _bar=best or bar, **brief)
        except ValueError:
            plan = None
        if plan is not None:
            if best is not None and _zebra_rate(plan) <= _zebra_rate(best) * (1 + 1e-9):
                break
            best = plan
            if not _activations_bind_as_asked(plan, view, model, kwargs):
                break
        waves *= 2
    return best


def _zebra_rate(plan: Plan) -> float:
    """Predicted tokens/s of the plan's own schedule (0 where none was predicted)."""
    return (plan.predicted.get(plan.schedule) or {}).get("tokens_per_s") or 0.0


def _activations_bind_as_asked(plan: Plan, view: ClusterView, model: Any, kwargs: dict) -> bool:
    """:func:`activations_bind` priced as the caller's search (``kwargs``) prices memory."""
    return activations_bind(plan, view, model, kwargs.get("shard_optimizer_state"), kwargs.get("optimizer"),
                            kwargs.get("weight_averages", 0))


def activations_bind(plan: Plan, cluster: Any, model: ModelConfig | dict, shard_optimizer_state: bool | None = None,
                     optimizer: OptimConfig | None = None, weight_averages: int = 0) -> bool:
    """Whether half the sequences in flight would let some member of the plan's ZP group that
    cannot hold every expert hold more of them: only then can splitting the step into more
    waves pay (a member with room for all of them places nothing differently)."""
    model = _model_config(model)
    devs = as_cluster(cluster).devices
    mem = MemoryModel.for_optimizer(model, optimizer, weight_averages)
    group_seqs = plan.total_seqs // len(plan.zp_groups)
    if group_seqs < 2:
        return False
    shares = optimizer_shares(devs, plan.attention_ranks, _sharded(model, shard_optimizer_state))
    everything = model.n_layers * model.moe.num_experts

    def capacity(r: int, group: int, attended: int | None) -> int:
        return member_capacity(mem, devs[r], seq_len=plan.seq_len, group_seqs=group, R=plan.num_microbatches,
                               seqs=attended, share=shares.get(r, 1.0))

    seen = set()
    for r in plan.zp_groups[0].members:
        seqs = plan.seqs_per_rank[r] if plan.roles[r] == "attention" else None
        key = (devs[r].name, seqs, shares.get(r, 1.0))
        if key in seen:
            continue
        seen.add(key)
        now = capacity(r, group_seqs, seqs)
        if now < everything and capacity(r, group_seqs // 2, None if seqs is None else (seqs + 1) // 2) > now:
            return True
    return False


def plan_for_batch(
    cluster: Any,
    model: ModelConfig | dict,
    *,
    seq_len: int,
    global_batch_tokens: int,
    profile: Profile | None = None,
    cost_model: CostModel | None = None,
    asym_ea: bool = True,
    num_microbatches: int | None = None,
    max_microbatches: int = 16,
    num_attention_ranks: int | None = None,
    num_zp_groups: int | None = None,
    require_expert_ranks: bool = False,
    schedules: Sequence[str] = SCHEDULES,
    timer: Any = None,
    expert_load: list[list[float]] | None = None,
    place_at_load: bool = False,
    shard_optimizer_state: bool | None = None,
    optimizer: OptimConfig | None = None,
    weight_averages: int = 0,
    waves: int = 1,
    _splits: Sequence[int] | None = None,
    _brief: bool = False,
    _bar: Plan | None = None,
) -> Plan:
    """Plan ``model`` on ``cluster`` for steps of ``global_batch_tokens`` in sequences of ``seq_len``,
    run as ``waves`` batches of an equal number of sequences (gradient accumulation).

    ``profile`` (measured times) replaces the cost model when given; ``timer`` (any task
    timer, e.g. an emulated workload's clock) replaces both. ``num_microbatches``,
    ``num_attention_ranks`` and ``num_zp_groups`` pin a choice instead of searching it.
    The search may give every rank the attention role (experts sharded over them: the EP
    layout, still with zebra's micro-batch overlap) when that is fastest; with
    ``require_expert_ranks`` at least one rank per ZP group serves experts only.
    The returned plan carries the predicted step time and tokens/s of every schedule in
    ``schedules`` (``None`` plus an ``error`` where a baseline does not fit in memory).
    ``expert_load`` (per layer, each expert's share of the routing; e.g. what a freshly
    initialised router does on warm-up batches) replaces even routing in the search and
    the predictions; with ``place_at_load`` which expert goes where is also chosen at it (a
    hot expert where it costs least, every member within its memory: ``load_placement.py``),
    kept where the simulator predicts the step faster so. A routing that lasts (an earlier
    run's record, a trained model's) is worth placing at; a freshly initialised router's is
    not. ``shard_optimizer_state`` prices the dense optimizer state sharded over the
    attention ranks (ZeRO-1, the strategy's ``shard_optimizer_state``); ``None``: as the
    strategy's defaults do, sharded unless the model's training state is small.
    ``optimizer`` (the pack's ``optim`` config) prices the optimizer's state and its step's
    temporaries per parameter (``profile/memory.py``'s ``optimizer_pricing``: SGD keeps 4
    bytes or none where AdamW keeps 8); ``None``: AdamW's, unfused. ``weight_averages``:
    copies of the weights kept on the device beside them for the whole run, 4 bytes per
    parameter each (Lightning's ``WeightAveraging``/``EMAWeightAveraging`` on the GPU: one;
    with ``device="cpu"``: none).

    Where memory binds, every layout the plan format can express is checked (see
    ``fit.py``): a batch that fits in one gets a plan, and a refusal names the binding
    constraint and the largest batch that plans.

    The planner's own calls narrow the search to some role splits (``_splits``,
    attention-rank counts, each over every group count and R: what plans of the cluster's
    alike copies suggest, ``replica.py``) and, where they only compare the plans' own
    steps, ask for those alone (``_brief``: no data-centric prediction, no network bytes);
    ``_bar``, a plan found elsewhere, is the mark group counts are probed against.
    """
    model = _model_config(model)
    view = as_cluster(cluster)
    if not view.devices:
        raise ValueError("empty cluster: name at least one device")
    if seq_len < 1 or seq_len > model.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is invalid: must be in [1, model.max_seq_len={model.max_seq_len}]")
    total = global_batch_tokens // seq_len
    if total < 1:
        raise ValueError(f"global_batch_tokens={global_batch_tokens} is smaller than one sequence of {seq_len} tokens")
    if isinstance(waves, bool) or not isinstance(waves, int) or waves < 1 or total % waves:
        raise ValueError(f"waves={waves!r} is invalid: must be an integer >= 1 that divides the batch's {total} "
                         f"sequences")
    with _cycle_collector_paused():
        return _plan(view, model, seq_len=seq_len, total=total // waves, waves=waves, profile=profile,
                     cost_model=cost_model,
                     asym_ea=asym_ea, num_microbatches=num_microbatches, max_microbatches=max_microbatches,
                     num_attention_ranks=num_attention_ranks, num_zp_groups=num_zp_groups,
                     require_expert_ranks=require_expert_ranks, schedules=schedules, timer=timer,
                     expert_load=expert_load, place_at_load=place_at_load,
                     shard_optimizer_state=shard_optimizer_state, optimizer=optimizer,
                     weight_averages=weight_averages, splits=_splits, brief=_brief, bar=_bar)


@contextlib.contextmanager
def _cycle_collector_paused():
    """A search allocates millions of short-lived task objects and leaves no reference
    cycles behind worth collecting on the way, while the cyclic collector's passes over the
    live heap grew with it to ~40% of a search on 1,024 GPUs. It runs again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(view, model: ModelConfig, *, seq_len: int, total: int, waves: int, profile, cost_model, asym_ea: bool,
          num_microbatches: int | None, max_microbatches: int, num_attention_ranks: int | None,
          num_zp_groups: int | None, require_expert_ranks: bool, schedules: Sequence[str], timer,
          expert_load, place_at_load: bool, shard_optimizer_state: bool | None,
          optimizer: OptimConfig | None = None, weight_averages: int = 0, splits: Sequence[int] | None = None,
          brief: bool = False,
          bar: Plan | None = None) -> Plan:
    """:func:`plan_for_batch` once its arguments are checked."""
    timer = _search_timer(model, seq_len, timer, profile, cost_model, optimizer)
    search = _Search(view, model, seq_len, total, timer, asym_ea, max_microbatches, expert_load,
                     sharded=_sharded(model, shard_optimizer_state), waves=waves, optimizer=optimizer,
                     weight_averages=weight_averages)
    if bar is not None and bar.predicted.get("zebra"):
        search.bar = (bar.predicted["zebra"]["step_time_s"], bar)
    W = len(view.devices)
    mem = search.mem
    _check_total_memory(mem, model, view)
    order = search.role_order()
    n_holdable = sum(1 for r in order if search.holdable(r))
    if num_attention_ranks is not None:
        if not 1 <= num_attention_ranks <= n_holdable:
            raise ValueError(f"num_attention_ranks={num_attention_ranks} must be in [1, {n_holdable}]")
        Ms = [num_attention_ranks]
    else:
        top = min(n_holdable, W - 1) if require_expert_ranks else n_holdable
        if require_expert_ranks and top < 1:
            raise ValueError(f"require_expert_ranks needs at least 2 ranks with one able to attend, cluster has {W}")
        Ms = list(range(1, top + 1)) if W > 1 else [1]
    Rs = [num_microbatches] if num_microbatches else search.r_values()
    search.layouts = _layout_search(search, num_microbatches=num_microbatches,
                                    num_attention_ranks=num_attention_ranks, num_zp_groups=num_zp_groups,
                                    require_expert_ranks=require_expert_ranks)

    if splits is not None:
        got = search.finals(order, [M for M in dict.fromkeys(splits) if M in Ms], Rs, num_zp_groups)
        if got is None:
            raise ValueError(f"no layout of {sorted(splits)} attention ranks fits {view.name}")
        plan = got[1]
    else:
        plan = search.best(order, Ms, Rs, num_zp_groups)
    if place_at_load and expert_load is not None:
        _place_at_load(plan, search, expert_load)
    plan.predicted = predict(plan, view, model, timer, schedules, expert_load, brief=brief, optimizer=optimizer,
                             weight_averages=weight_averages)
    plan.bound_tokens_per_s = throughput_bound(view.devices, timer, model, seq_len, batch_tokens=total * seq_len)
    cost = getattr(timer, "cost", None)
    if cost is not None:
        plan.precision = cost.describe()
    return plan


def _place_at_load(plan: Plan, search: _Search, expert_load: list[list[float]]) -> None:
    """``plan``'s expert ids chosen at ``expert_load``, for zebra's placement and DistEP's
    each; either is changed only where the simulator predicts that schedule's step faster
    at that routing than as Asym-EA placed it. Zebra's experts may also move to a member
    with memory to spare (Asym-EA's counts assumed even routing: one hot expert may be
    worth an attention rank's time); DistEP's counts stay (its base placement moves nothing
    memory does not force)."""
    view, model, timer = search.view, search.model, search.timer
    g0 = plan.zp_groups[0]
    devs = [view.devices[r] for r in g0.members]
    M, S, R = len(g0.attention_ranks), plan.seq_len, plan.num_microbatches
    group_seqs = plan.total_seqs // len(plan.zp_groups)
    choices = group_seqs * S * model.moe.top_k  # routed tokens per group and batch

    def cost(m: int, tokens: float) -> float:
        return timer.expert(devs[m], tokens) + timer.expert(devs[m], tokens, backward=True)

    def attention(m: int) -> float:
        tokens = plan.seqs_per_rank[g0.members[m]] * S
        return timer.attention(devs[m], tokens) + timer.attention(devs[m], tokens, backward=True) if m < M else 0.0

    shares = optimizer_shares(view.devices, g0.attention_ranks, search.sharded)

    def most(m: int, r: int) -> int:
        """The experts member ``m`` (rank ``r``) may hold, all layers, as Asym-EA was told."""
        if m < M:
            return search.held_at_most(devs[m], group_seqs=group_seqs, R=R, seqs=plan.seqs_per_rank[r], share=shares[r])
        return search.held_at_most(devs[m], group_seqs=group_seqs, R=R, seqs=None)

    held = plan.expert_counts(0)
    room = [max(most(m, r) - sum(held[m]), 0) for m, r in enumerate(g0.members)]
    # under zebra a member's attention overlaps the experts and adds to its own; DistEP's
    # attention and experts take turns, so only the experts weigh there
    for schedule, base, free in (("zebra", [attention(m) for m in range(len(devs))], room),
                                 ("distep", [0.0] * len(devs), None)):
        now = plan.placement_for(schedule)
        placed = place_at_load(now, expert_load, base, cost, choices, room=free)
        if placed == now:
            continue
        trial = copy.copy(plan)
        if schedule == "zebra":
            trial.placement = placed
        else:
            trial.base_placement = placed

        def step(p: Plan) -> float:
            return predict_step_time(schedule, view.devices, model, view.topology, timer, plan=p,
                                     expert_load=expert_load)

        if step(trial) < step(plan) * (1 - 1e-9):
            plan.placement, plan.base_placement = trial.placement, trial.base_placement
    plan.placed_at_load = True


def _sharded(model: ModelConfig, shard_optimizer_state: bool | None) -> bool:
    if shard_optimizer_state is not None:
        return bool(shard_optimizer_state)
    return not small_training_state(MemoryModel(model).model_params())


def _layout_search(search: _Search, **pins: Any) -> LayoutSearch:
    return LayoutSearch(search.mem, search.devs, lambda d: ep_speed(d, search.timer, search.model, search.S), search.S,
                        max_microbatches=search.max_R, sharded=search.sharded, cap=search.profile_cap, **pins)


def largest_batch(cluster: Any, model: ModelConfig | dict, *, seq_len: int, profile: Profile | None = None,
                  cost_model: CostModel | None = None, max_microbatches: int = 16,
                  num_microbatches: int | None = None, num_attention_ranks: int | None = None,
                  num_zp_groups: int | None = None, require_expert_ranks: bool = False, timer: Any = None,
                  shard_optimizer_state: bool | None = None, optimizer: OptimConfig | None = None,
                  weight_averages: int = 0) -> int:
    """The most sequences of ``seq_len`` tokens per step that :func:`plan_for_batch` plans on
    ``cluster`` in one wave (0: not one; :func:`make_plan` plans up to ``max_waves`` times as
    many, in waves that divide them), by the memory model alone: doubling, then bisection over the
    batch, each batch checked over every layout (see ``fit.py``)."""
    model = _model_config(model)
    view = as_cluster(cluster)
    if not view.devices:
        raise ValueError("empty cluster: name at least one device")
    timer = _search_timer(model, seq_len, timer, profile, cost_model, optimizer)
    search = _Search(view, model, seq_len, 1, timer, True, max_microbatches,
                     sharded=_sharded(model, shard_optimizer_state), optimizer=optimizer,
                     weight_averages=weight_averages)
    try:
        _check_total_memory(search.mem, model, view)
    except ValueError:
        return 0
    return _layout_search(search, num_microbatches=num_microbatches, num_attention_ranks=num_attention_ranks,
                          num_zp_groups=num_zp_groups, require_expert_ranks=require_expert_ranks).largest()


def _check_total_memory(mem: MemoryModel, model: ModelConfig, view: ClusterView) -> None:
    need_experts = model.n_layers * model.moe.num_experts * mem.expert_params() * mem.bytes_per_param
    need = mem.model_params() * mem.bytes_per_param
    have = sum(d.usable_bytes for d in view.devices)
    if need > have:
        raise ValueError(
            f"experts exceed total memory: model state needs {need / 1e9:.1f} GB "
            f"({model.n_layers}x{model.moe.num_experts} experts = {need_experts / 1e9:.1f} GB), "
            f"the cluster has {have / 1e9:.1f} GB usable"
        )


def predict(plan: Plan, cluster: Any, model: ModelConfig, timer, schedules: Sequence[str] = SCHEDULES,
            expert_load: list[list[float]] | None = None, brief: bool = False,
            optimizer: OptimConfig | None = None, weight_averages: int = 0) -> dict:
    """Step time and tokens/s of ``plan`` under each schedule and data-centric (``None``
    and the error where one does not fit). ``brief``: each schedule's step time and
    tokens/s alone (zebra and DistEP by the search's own simulation), no data-centric.
    ``optimizer`` and ``weight_averages``: what EP's micro-batches and data-centric's
    memory are priced with, as the plan itself was."""
    view = as_cluster(cluster)
    out: dict[str, dict[str, float]] = {}
    for s in list(schedules) + ([] if brief else ["datacentric"]):
        if brief and s in ("zebra", "distep"):
            step = predict_step_time(s, view.devices, model, view.topology, timer, plan=plan, expert_load=expert_load)
            out[s] = {"step_time_s": step, "tokens_per_s": plan.step_seqs * plan.seq_len / step if step > 0 else 0.0}
            continue
        try:
            res = predict_step(s, view.devices, model, view.topology, timer, plan=plan, expert_load=expert_load,
                               optimizer=optimizer, weight_averages=weight_averages)
        except ValueError as err:
            # None, not NaN: the plan stays valid JSON and compares equal to its round trip
            out[s] = {"step_time_s": None, "tokens_per_s": None, "error": str(err)}
            continue
        out[s] = {"step_time_s": res.step_time, "tokens_per_s": res.tokens_per_s}
        if view.topology.num_nodes > 1 and res.network_bytes is not None:
            out[s]["network_gb"] = res.network_bytes / 1e9
    return out
