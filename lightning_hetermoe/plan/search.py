"""The search for one batch and one wave count: which ranks attend, how many ZP groups, how
many micro-batches, and where the experts go (Asym-EA). :mod:`.planner` runs it per wave
count and keeps the fastest.

A role split is a set of attention ranks: on up to 48 ranks every count of each device
kind, or where those are many a grid of them (:meth:`Search.attention_sets`), beside the
prefixes of one role order; on more ranks those prefixes alone. A cheap first
pass (per split a small R, or the fewest that fit, and on small clusters ``DEEP_PROBE_R``
too) ranks them; the full G × R search runs on the best few, from the most groups down (on
hundreds of ranks a group count is searched over every R only where its step at the best
plan's R comes within ``FAR_GROUPS`` of the best). Each layout is built and simulated once
per search. Where no split of the role order fits in memory, every layout the plan format
can express is checked by the memory model alone (``fit.py``): the fastest of the feasible
ones is planned, or the refusal names the binding constraint and the largest batch that
plans.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

from ..apportion import apportion
from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig, OptimConfig
from ..distinct import distinct
from ..profile.memory import MemoryModel, format_bytes
from ..profile.profile import Profile
from ..simulate.predict import predict_step_time
from ..simulate.schedules import ep_speed
from .asym_ea import AsymEAInput, assign_experts, placement_from_counts
from .cluster_view import ClusterView
from .fit import LayoutSearch, member_capacity, optimizer_shares
from .plan import Plan, ZPGroup
from . import progress


R_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Search:
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
        # also try equal attention shares (pass 3, the best few role splits: see finals())
        self.equal_shares = False
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
        plans = [p for by_node in self._ways(G) for p in self._candidate(order, M, G, R, by_node)]
        if len(plans) < 2:
            return plans[0] if plans else None
        self._chosen = min(((p, self._sim(p)) for p in plans), key=lambda pt: pt[1])
        return self._chosen[0]

    def _ways(self, G: int) -> list[bool]:
        """How ``G`` groups are dealt (``by_node``): by turns, and on several nodes by nodes too."""
        return [False, True] if G > 1 and self.view.topology.num_nodes > 1 else [False]

    def _candidate(self, order: list[int], M: int, G: int, R: int, by_node: bool, equal: bool = False
                   ) -> list[Plan]:
        """The plans of one layout (none where it does not fit): attention shares in
        proportion to attention speed, and, where they differ, the shares that even out each
        attention member's attention and hosted experts once Asym-EA placed them (with very
        unequal devices a whole expert is a large part of a slow member's step). ``equal``:
        only the plan of equal shares, where they differ from those in proportion to speed."""
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

        if equal:
            same = apportion(group_seqs, [1.0] * len(g0.attention_ranks))
            placed = place(same) if same != member_seqs and R <= max(same) else None
            return [] if placed is None else [self._build(groups, attn, R, same, placed)]
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
        progress.simulated()
        return predict_step_time("zebra", self.devs, self.model, self.view.topology, self.timer, plan=plan,
                                 expert_load=self.expert_load)

    def score(self, plan: Plan) -> tuple[float, Plan]:
        """Simulated zebra step time per the search's batch (:meth:`per_batch`: what the search
        ranks layouts by), and the plan to keep. Asym-EA's greedy scores forward
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
                return self.per_batch(t_base, base), base
        return self.per_batch(t, plan), plan

    def per_batch(self, seconds: float, plan: Plan) -> float:
        """``plan``'s step time per the search's batch: a layout whose ZP groups do not divide
        the batch plans fewer sequences (each group ``total // G``), and its shorter step is
        no faster per sequence. Layouts are ranked by this, as the plans' tokens/s rank them."""
        planned = plan.total_seqs * plan.waves
        return seconds * (self.total * self.waves) / planned if planned else seconds

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
            if many_splits(len(self.devs)) and ref is not None and ref[1].num_microbatches in R_list:
                # Hundreds of ranks: a group count is first tried at the best plan's R, and
                # searched over every R only where that comes within FAR_GROUPS of the best
                # (R moves a layout's step by a few percent; group counts by tens)
                probe = self.scored(order, M, G, ref[1].num_microbatches)
                if probe is not None and probe[0] > ref[0] * (1 + FAR_GROUPS):
                    worse_groups += 1
                    if many and worse_groups >= 2:
                        break
                    continue
            got = self.best_R(order, M, G, R_list)
            local = None if got is None else got[0]
            if got is not None and (best is None or got[0] < best[0] * (1 - 1e-9)):
                best = got
            # many group counts (thousands of ranks): from the most groups down, stopping once
            # two in a row do not beat the best; fewer groups only widen the exchange further
            if many:
                if local is not None:  # a group count too small to fit is no evidence either way
                    worse_groups = 0 if best is not None and local <= best[0] else worse_groups + 1
                if worse_groups >= 2:
                    break
        return best

    def best_R(self, order: list[int], M: int, G: int, R_list: list[int]) -> tuple[float, Plan] | None:
        """The fastest :meth:`scored` plan of one layout over ``R_list`` ascending, stopping
        once two larger R in a row do not beat it (the step's pipeline fill shrinks with R,
        its per-round costs grow: past the best, R only gets slower, and a large R's
        placement and simulation cost the most)."""
        local, worse = None, 0
        for R in R_list:
            got = self.scored(order, M, G, R)
            if got is None:
                continue
            if local is None or got[0] < local[0] * (1 - 1e-9):
                local, worse = got, 0
            else:
                worse += 1
                if worse >= 2:
                    break
        return local

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

        got = self._once(("scored", tuple(order[:M]), G, R), build_and_score)
        if not self.equal_shares:
            return got

        def score_equal() -> tuple[float, Plan] | None:
            plans = [p for by_node in self._ways(G) for p in self._candidate(order, M, G, R, by_node, equal=True)]
            self.last_error = ""  # equal shares that do not fit say nothing the search has not said
            return min((self.score(p) for p in plans), key=lambda tp: tp[0], default=None)

        same = self._once(("scored equal", tuple(order[:M]), G, R), score_equal)
        return min((x for x in (got, same) if x is not None), key=lambda tp: tp[0], default=None)

    def equal_share_splits(self) -> int:
        """How many role splits pass 3 tries with equal attention shares: the fastest only
        past ``MAX_SPLITS`` ranks, where each is a placement and a simulation more per
        layout on groups of a hundred members (at 1,024 GPUs the fastest alone found the
        plans the two found, Qwen3-30B-A3B 1.44x faster and OLMoE-1B-7B flat 1.30x, in
        under ten seconds; the two took 12.7 s)."""
        return 1 if many_splits(len(self.devs)) else EQUAL_SHARE_SPLITS

    def group_counts(self, M: int, pinned: int | None) -> list[int]:
        W = len(self.devs)
        return [pinned] if pinned is not None else _divisors(math.gcd(M, W - M) if W - M else M)

    def most_groups(self, order: list[int], M: int) -> int:
        attn, expert = sorted(order[:M]), sorted(order[M:])
        return next((G for G in reversed(self.group_counts(M, None)) if self.groups(attn, expert, G) is not None), 1)

    def attention_sets(self, order: list[int], Ms: list[int], grid: bool = True) -> list[list[int]] | None:
        """The sets of attention ranks pass 1 tries one by one, the prefixes of the role order
        first: each count of each device kind that can hold the attention stack (a kind's
        first ranks in role order) up to ``MAX_ATTENTION_SETS``; beyond, as many on a grid of
        each kind's counts (none, powers of two, all: :func:`count_grid`); ``None`` where no
        grid is that small or ``grid`` is False (pass 1 then tries prefixes of the role order
        alone). A prefix can miss the fastest set: on 2 L40S and 8 T4 one L40S and three T4s
        attending beat every prefix by 1.15x (W1 at 16K), the other L40S holding experts the
        T4s would be slow at; on 4 L40S and 16 T4 (84 sets) every T4 attending and the L40S
        serving experts beat them by 1.067x (W1 at 4K). Between the grid's counts, over 60
        plans of 16 and 20 mixed GPUs, every set tried one by one found nothing faster."""
        names = sorted({d.name for d in self.devs})
        able = [sum(1 for r in order if self.devs[r].name == n and self.holdable(r)) for n in names]
        if math.prod(a + 1 for a in able) - 1 <= MAX_ATTENTION_SETS:  # none attending is no set
            levels = [list(range(a + 1)) for a in able]
        elif not grid or (levels := count_grid(able, MAX_ATTENTION_SETS)) is None:
            return None
        allowed = set(Ms)
        prefixes = [order[:M] for M in Ms]
        seen = {tuple(sorted(a)) for a in prefixes}
        out = list(prefixes)
        for vec in itertools.product(*levels):
            if sum(vec) in allowed:
                att = self.attention_of(vec, order)
                key = tuple(sorted(att))
                if key not in seen:
                    seen.add(key)
                    out.append(att)
        return out

    def led_by(self, attention: list[int], order: list[int]) -> list[int]:
        """The role order with ``attention`` first: the split it makes is its prefix."""
        held = set(attention)
        return list(attention) + [r for r in order if r not in held]

    def best(self, order: list[int], Ms: list[int], Rs: list[int], pinned: int | None,
             every_set: bool = True, grid: bool = True) -> Plan:
        """Pass 1 ranks the role splits (each with one ZP group and a small R, and on wide
        clusters its most groups too); pass 2 searches every group count and R on the two
        best and on the others within ``PASS2_MARGIN`` of the best (at most ``PASS2_SPLITS``),
        and on the best of the splits that fit only with fewer groups than their most. A
        split is a set of attention ranks (:meth:`attention_sets`, which takes ``grid``;
        ``every_set`` False: the prefixes of ``order`` alone), searched as the prefix of a
        role order that puts it first."""
        probe = [r for r in Rs if r <= 2][-1:] or Rs[:1]
        # attention ranks (in role order) -> the role order they lead, and its pass-1 step
        leads: dict[tuple[int, ...], list[int]] = {}
        tried: dict[tuple[int, ...], float | None] = {}
        # On many ranks or several nodes one ZP group over the whole cluster is the worst case
        # for the exchange (every token to every rank, across the network), which would rank
        # the role splits by that alone: such clusters also probe each split with its most groups.
        wide = self.view.topology.num_nodes > 1 or len(Ms) > MAX_SPLITS

        # splits where neither one group nor the most fit at any R, priced at the most groups
        # that do: kept apart from the ranking above, so that pass 2 looks at the best of
        # them besides (never instead of) the splits it would take anyway
        fitted: dict[tuple[int, ...], float] = {}

        # one R per split: the probe, or where it does not fit the fewest micro-batches that do;
        # where pass 1 tries every split, also DEEP_PROBE_R (or the most allowed below it)
        R_order = probe + [R for R in Rs if R > probe[0]]
        deep = max((R for R in Rs if R <= DEEP_PROBE_R), default=None) if len(Ms) <= MAX_SPLITS else None

        def lead(att: list[int]) -> tuple[int, ...]:
            key = tuple(att)
            if key not in leads:
                leads[key] = self.led_by(att, order)
            return key

        def split_time(key: tuple[int, ...]) -> float | None:
            if key not in tried:
                o, M = leads[key], len(key)
                Gs = [pinned] if pinned else sorted({1, self.most_groups(o, M)} if wide else {1})
                got = next((g for g in (self.best_for(o, M, Gs, [R]) for R in R_order) if g is not None), None)
                if deep is not None and got is not None and got[1].num_microbatches < deep:
                    again = self.best_for(o, M, Gs, [deep])
                    if again is not None and again[0] < got[0]:
                        got = again
                tried[key] = None if got is None else got[0]
                if got is None and wide and not pinned:
                    fit = next((f for f in (self.most_groups_that_fit(o, M, R) for R in R_order) if f), None)
                    if fit is not None:
                        fitted[key] = fit[0]
            return tried[key]

        sets = self.attention_sets(order, Ms, grid) if every_set and len(Ms) <= MAX_SPLITS else None
        kinds = [self.devs[r].name for r in order]
        for att in sets if sets is not None else [order[:M] for M in role_splits(Ms, kinds)]:
            split_time(lead(att))
        if len(Ms) > MAX_SPLITS:
            refine_splits(Ms, {len(k): t for k, t in tried.items()}, lambda M: split_time(lead(order[:M])))
        # ties go to the split tried first (the role order's prefixes come first)
        ranked = sorted(((t, k) for k, t in tried.items() if t is not None), key=lambda tk: tk[0])
        # where pass 1 tried every split (a grid on more ranks, whose pass 2 searches
        # hundreds of group counts per split): the splits near the best as well
        most = PASS2_SPLITS if len(Ms) <= MAX_SPLITS else 2

        def near(ranked: list[tuple[float, tuple[int, ...]]]) -> list[tuple[int, ...]]:
            got = [k for t, k in ranked if t <= ranked[0][0] * (1 + PASS2_MARGIN)][:most]
            return got if len(got) >= 2 else [k for _, k in ranked[:2]]

        first = near(ranked)
        if sets is not None:  # and those the prefixes alone would take: the others may crowd them out
            own = {tuple(order[:M]) for M in Ms}
            first += [k for k in near([(t, k) for t, k in ranked if k in own]) if k not in first]
        binds = not first
        fits = sorted(((t, k) for k, t in fitted.items()), key=lambda tk: tk[0])
        first += [k for _, k in fits[:1] if k not in first]
        best = self.finals([(leads[k], len(k)) for k in first], Rs, pinned)
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

    def finals(self, splits: list[tuple[list[int], int]], Rs: list[int], pinned: int | None
               ) -> tuple[float, Plan] | None:
        """Pass 2: every group count and R of each role split (a role order and how many of
        its first ranks attend), the fastest kept."""
        best = None
        # Pass 2 also tries each layout's evened-out attention shares (see _candidate): only
        # here, where few layouts are left, since each costs placements and a simulation
        self.even_shares = True
        ranked: dict[tuple[int, ...], tuple[float, list[int], int, int]] = {}
        for order, M in splits:
            got = self.best_for(order, M, self.group_counts(M, pinned)[::-1], Rs,
                                bar=min((x for x in (best, self.bar) if x is not None), key=lambda x: x[0], default=None))
            if got is not None:
                ranked.setdefault(tuple(sorted(order[:M])), (got[0], order, M, len(got[1].zp_groups)))
                if best is None or got[0] < best[0] * (1 - 1e-9):
                    best = got
        # Pass 3: the fastest few splits again, at their group count, with equal
        # attention shares as well. Shares in proportion to attention speed leave a slow
        # member one sequence where R wants two, or give a fast one a third that splits its
        # micro-batches unevenly, and the experts are placed around that (OLMoE-1B-7B on o3:
        # 49,499 tokens/s at equal shares, 47,091 before).
        self.equal_shares = True
        try:
            for _, order, M, G in sorted(ranked.values(), key=lambda x: x[0])[:self.equal_share_splits()]:
                # every R on few ranks; on many, R ascending while it pays (best_R): a group of
                # a hundred members costs tens of milliseconds a layout to place and simulate
                tried = [self.best_R(order, M, G, Rs)] if many_splits(len(self.devs)) else \
                    [self.scored(order, M, G, R) for R in Rs]
                for got in tried:
                    if got is not None and (best is None or got[0] < best[0] * (1 - 1e-9)):
                        best = got
        finally:
            self.equal_shares = False
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

# Where pass 1 tried every role split (up to MAX_SPLITS of them), pass 2 also searches those
# whose pass-1 step is within this much of the best one's, up to PASS2_SPLITS. Pass 1 prices
# a split at one ZP group and R <= 2, which ranks splits that need more micro-batches or
# groups to overlap too low: over the paper's 100 configurations the two best alone left
# zebra at 85.7% of the bound, every split 86.8%, this 86.6% in 1.3x the search time.
PASS2_MARGIN = 0.30
PASS2_SPLITS = 6

# Where pass 1 tries every split, each is also priced at this many micro-batches (or the most
# allowed below it), the faster of the two kept: a split whose expert ranks need many
# micro-batches to overlap ranks low at R <= 2 and missed pass 2. Over the paper's 100
# configurations, every set of attention ranks tried: mean of the bound 86.6% with the small
# probe alone (as the prefixes alone), 86.8% with 4 (C1 D2 4K 5% slower), 86.9% with 8 (one
# configuration 0.1% slower) and with 12 (none slower; 2.2x the search time of the prefixes).
DEEP_PROBE_R = 12

# Feasible attention-count vectors planned (simulated) when memory binds, nearest the role order first.
FALLBACK_VECTORS = 4

# Role splits tried one by one up to this many; beyond, a grid through every boundary between
# device kinds, then a local search around the best (the step time varies smoothly with the
# split between boundaries).
MAX_SPLITS = 48

# Sets of attention ranks (counts of each device kind) pass 1 tries one by one up to this
# many; beyond, as many on a grid of each kind's counts, and where none is that small the
# prefixes of the role order (as many as MAX_SPLITS allows, then a grid of those). Over 60
# plans of 16 and 20 mixed GPUs (two and three kinds, 81 to 245 sets) the grid planned as
# fast as every set tried one by one, in half to a third of the time.
MAX_ATTENTION_SETS = 64


def many_splits(ranks: int) -> bool:
    """Whether ``ranks`` ranks have more role splits than are tried one by one: the search
    prunes them, and is long enough that :mod:`.planner` runs one only where it pays."""
    return ranks > MAX_SPLITS


# the evened-out attention shares are simulated too where their busiest member's sum is this
# much of the first shares' (or less); placed again at most this many times
SHARES_GAIN = 0.97
EVEN_ROUNDS = 2
EQUAL_SHARE_SPLITS = 2  # role splits pass 3 tries again with equal attention shares


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


def kind_counts(names: list[str], ranks: list[int]) -> tuple[int, ...]:
    """How many of ``ranks`` are of each device kind (``names``: every rank's), kinds sorted
    by name: a set of attention ranks as :meth:`Search.attention_of` reads it."""
    return tuple(sum(1 for r in ranks if names[r] == kind) for kind in sorted(set(names)))


def count_grid(able: list[int], most: int) -> list[list[int]] | None:
    """Each device kind's attending counts on :meth:`Search.attention_sets`' grid, at most
    ``most`` sets in all: none, the powers of two below its ``able`` ranks, and all of them;
    the kind with the most counts thinned (every other one between its ends) until the grid
    fits. ``None`` where it cannot (each kind down to none and all, still too many)."""
    levels = [sorted({0, a, *(1 << i for i in range(max(a, 1).bit_length()) if 1 << i < a)}) for a in able]
    while math.prod(len(v) for v in levels) - 1 > most:  # none attending is no set
        k = max(range(len(levels)), key=lambda i: len(levels[i]))
        if len(levels[k]) <= 2:
            return None
        levels[k] = [levels[k][0], *levels[k][1:-1:2], levels[k][-1]]
    return levels


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
