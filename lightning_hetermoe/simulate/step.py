"""One training step of one ZP group (or one EP group) as a task graph, simulated.

Ranks that would behave identically (same device, same tokens, same experts) are one
:class:`Lane` simulated once and counted ``len(lane.ranks)`` times; the result is the same
as simulating every rank, only faster.

Per layer ``l`` and micro-batch ``j`` the graph is (forward, then backward)::

    A_f(r,l,j) on ranks with tokens  -> D_f(l,j) dispatch  -> X_f(r,l,j) on ranks with experts
    -> C_f(l,j) combine -> A_f(r,l+1,j) ... -> H(r,j) LM head+loss at the top
    -> D_b(l,j) grad of expert outputs -> X_b(r,l,j) -> C_b(l,j) grad of expert inputs
    -> A_b(r,l,j) -> D_b(l-1,j) ...

Dispatch-direction transfers (D_f, D_b) share one channel and combine-direction ones
(C_f, C_b) another: the paper gives each direction its own process group so both flow at
once. A collective takes ``latency + max over ranks of max(bytes sent, bytes received) /
bandwidth``; tokens routed to an expert on the same rank never touch the network. On a
cluster of nodes (:class:`~lightning_hetermoe.cluster.topology.Topology`) a leg takes the
slowest of its links: inside each node the busiest rank's rows to and from the node's
other ranks over the node's link, and across nodes each node's rows in or out (every ZP
group's ranks on that node together) over the network port they share. Gradient
all-reduces run over the slowest hop of their ring.

Disaggregated schedules (zebra, DistEP, forward-only) take every rank's task order and
the channels' round order from a :class:`~lightning_hetermoe.task_order.Schedule`, the same
object the executor follows, and run them as fixed orders. The balance loss's routing
counts are summed over the attention ranks on a third channel (``dense``), and a layer's
combine waits for them (see the schedule module).

EP lanes (``setup.schedule is None``) pick ready tasks by priority, micro-batches one after
another: the all-to-alls are synchronous, the slowest rank sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cluster.spec import LinkConfig, slowest
from ..cluster.devices import DeviceSpec
from ..cluster.topology import Topology, as_topology
from ..configs import ModelConfig
from ..distinct import distinct
from ..task_order import Round, Schedule, Task as ScheduleTask, awaited_round, emitted_round
from . import copies
from .engine import Task, Timeline, run_dag

COMPUTE_KINDS = ("attn_fwd", "attn_bwd", "expert_fwd", "expert_bwd", "head", "attn_re", "expert_re")


@dataclass
class Lane:
    """A set of ranks that behave identically."""

    device: DeviceSpec
    ranks: list[int]
    # sequences of attention work per micro-batch (len R); empty list: no attention role
    seqs: list[int] = field(default_factory=list)
    # experts hosted per layer (len n_layers)
    experts: list[int] = field(default_factory=list)
    role: str = "attention"
    # which experts, per layer (empty: unknown, routing assumed even)
    expert_ids: list[list[int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        r = self.ranks
        span = (
            f"{r[0]}"
            if len(r) == 1
            else f"{r[0]}..{r[-1]}"
            if r == list(range(r[0], r[-1] + 1))
            else ",".join(map(str, r))
        )
        return f"{self.role[0]}:{self.device.name}[{span}]"

    @property
    def has_attention(self) -> bool:
        return any(s > 0 for s in self.seqs)


@dataclass
class StepSetup:
    lanes: list[Lane]
    model: ModelConfig
    seq_len: int
    num_microbatches: int
    # a flat cluster's one link, or the cluster's topology (which link each transfer crosses)
    link: LinkConfig | Topology
    # identical groups (DP replicas) this one stands for
    replicas: int = 1
    # ranks holding a replica of the attention stack, cluster-wide (gradient all-reduce)
    attention_dp: int = 1
    # zebra / DistEP / forward-only: the fixed orders (None: EP)
    schedule: Schedule | None = None
    # measured routing: per layer, each expert's share of the routed choices (None: even)
    expert_load: list[list[float]] | None = None
    # every lane rank's counterpart in each group, itself first (None: one group); where the
    # other groups' ranks sit decides what shares a node's network port
    replica_ranks: dict[int, list[int]] | None = None
    # the attention-stack replicas' ranks, cluster-wide (None: the lanes' ranks)
    dense_ranks: list[int] | None = None
    # EP with copies of experts: which copy serves a token (lightning_hetermoe.copy_routing)
    replica_dispatch: str = "local_first"
    # EP with copies: per layer, the placement's route of each expert (None: the rule alone)
    copy_routes: list | None = None
    # zebra / DistEP: batches per optimizer step (gradient accumulation), one after another;
    # the gradient sync and optimizer (the tail) run once
    waves: int = 1
    topology: Topology = field(init=False, repr=False, compare=False)
    _lane_nodes: list | None = field(default=None, init=False, repr=False, compare=False)
    _legs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _leg_time: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _held: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _node_rows: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _share_rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _lane_shares: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _held_ids: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _by_id: bool | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = [r for lane in self.lanes for r in lane.ranks]
        ranks += [r for reps in (self.replica_ranks or {}).values() for r in reps] + list(self.dense_ranks or [])
        self.topology = as_topology(self.link, max(ranks, default=0) + 1)

    def lane_node_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """:meth:`lane_nodes` as rows (group, lane, node) in that order: each row's lane, node,
        ranks, and its (group, node) place's index (and how many places)."""
        if self._node_rows is None:
            rows = [(g * self.topology.num_nodes + n, i, n, c) for g, placed in enumerate(self.lane_nodes())
                    for i, at in enumerate(placed) for n, c in at.items()]
            place, lane, node, count = (np.array(x) for x in zip(*rows))
            _, where = np.unique(place, return_inverse=True)
            self._node_rows = (lane, node, count.astype(float), where, int(where.max()) + 1)
        return self._node_rows

    def lane_nodes(self) -> list[list[dict[int, int]]]:
        """Per group, per lane: how many of the lane's ranks (their counterparts in that
        group) sit on each node."""
        if self._lane_nodes is None:
            node_of = self.topology.node_of
            n_groups = len(self.replicas_of(self.lanes[0].ranks[0]))
            out = []
            for g in range(n_groups):
                per_lane = []
                for lane in self.lanes:
                    where: dict[int, int] = {}
                    for r in lane.ranks:
                        n = node_of[self.replicas_of(r)[g]]
                        where[n] = where.get(n, 0) + 1
                    per_lane.append(where)
                out.append(per_lane)
            self._lane_nodes = out
        return self._lane_nodes

    def exchange(self, layer: int, tokens: list[float]) -> tuple[list[tuple[float, LinkConfig]], float]:
        """:func:`exchange_legs`, once per distinct leg: under even routing, layers whose
        lanes hold as many experts move the same rows for the same tokens."""
        key = self.leg_key(layer, tokens)
        if key not in self._legs:
            self._legs[key] = exchange_legs(self, layer, list(tokens))
        return self._legs[key]

    def leg_key(self, layer: int, tokens: list[float]) -> tuple:
        if layer not in self._held:
            self._held[layer] = ((layer,) if self.expert_load is not None
                                 else tuple(lane.experts[layer] for lane in self.lanes))
        return self._held[layer], tuple(tokens)

    def replicas_of(self, rank: int) -> list[int]:
        return self.replica_ranks.get(rank, [rank]) if self.replica_ranks else [rank]

    def dense_link(self) -> LinkConfig:
        """The slowest hop of the attention replicas' gradient ring."""
        return self.topology.ring_link(self.dense_ranks or [r for lane in self.lanes for r in lane.ranks])

    def replica_link(self, lane: "Lane") -> LinkConfig:
        """The slowest hop of the rings that sum the lane's experts' gradients over groups."""
        return slowest(self.topology.ring_link(self.replicas_of(r)) for r in lane.ranks)

    def copies(self, layer: int) -> list[int]:
        """How many ranks hold each expert of ``layer`` (copies split their expert's tokens),
        counted once per layer: at a measured routing every expert task of every lane asks
        (on a group of hundreds of lanes, most of a search's time was this count)."""
        n = self._copies.get(layer)
        if n is None:
            n = self._copies[layer] = [0] * self.model.moe.num_experts
            for lane in self.lanes:
                for e in (lane.expert_ids[layer] if lane.expert_ids else []):
                    n[e] += len(lane.ranks)
        return n

    def expert_tokens(self, lane: Lane, layer: int, group_tokens: float) -> list[float]:
        """Tokens each expert the lane holds processes when the group routes ``group_tokens``."""
        k, E = self.model.moe.top_k, self.model.moe.num_experts
        if self.expert_load is not None and lane.expert_ids:
            load, n = self.expert_load[layer], self.copies(layer)
            return [group_tokens * k * load[e] / n[e] for e in lane.expert_ids[layer]]
        return [group_tokens * k / E] * lane.experts[layer]

    def lane_shares(self, layer: int) -> np.ndarray:
        """:meth:`own_share` of every lane at ``layer``, found once per layer (a search asks
        each layer's once per micro-batch and phase); at a measured routing every lane's at
        once, the same sums in the same order."""
        shares = self._lane_shares.get(layer)
        if shares is None:
            if self.measured_by_id():
                per = np.append(np.asarray(self.expert_load[layer], dtype=float)
                                / np.maximum(np.asarray(self.copies(layer), dtype=float), 1.0), 0.0)
                shares = add_columns(per[self.held_ids()[layer]])
            else:
                shares = np.array([self.own_share(lane, layer) for lane in self.lanes], dtype=float)
            self._lane_shares[layer] = shares
        return shares

    def measured_by_id(self) -> bool:
        """A measured routing and every lane's expert ids known: each expert is priced at its
        own load, every lane's at once (:meth:`lane_shares`, :meth:`TaskTimes.held_experts`)."""
        if self._by_id is None:
            self._by_id = self.expert_load is not None and all(lane.expert_ids for lane in self.lanes)
        return self._by_id

    def held_ids(self) -> np.ndarray:
        """Per layer and lane, the ids of the experts the lane holds in its order, padded
        with ``E`` (a column past the last expert, where tables put what adds nothing)."""
        if self._held_ids is None:
            E, L = self.model.moe.num_experts, self.model.n_layers
            ids = [lane.expert_ids if lane.expert_ids else [[]] * L for lane in self.lanes]
            width = max([1] + [len(x) for held in ids for x in held])
            out = self._held_ids = np.full((L, len(ids), width), E, dtype=np.intp)
            for i, held in enumerate(ids):
                for layer, x in enumerate(held):
                    out[layer, i, :len(x)] = x
        return self._held_ids

    def own_share(self, lane: Lane, layer: int) -> float:
        """The share of every token's routed choices that lands on this lane's experts."""
        if self.expert_load is not None and lane.expert_ids:
            n = self.copies(layer)
            return sum(self.expert_load[layer][e] / n[e] for e in lane.expert_ids[layer])
        return lane.experts[layer] / self.model.moe.num_experts


@dataclass
class StepResult:
    schedule: str
    step_time: float
    tokens: int
    busy: dict[int, float]
    devices: dict[int, str]
    bubbles: dict[str, list[tuple[float, float]]]
    lanes: list[str]
    num_microbatches: int
    timeline: Timeline | None = field(default=None, repr=False, compare=False)
    # the experts' exchange that crosses the network between nodes, per step (None: not
    # modelled, as in the data-centric closed form)
    network_bytes: float | None = 0.0
    # the step's waves: its timeline and bubbles are one wave's, its busy time and tokens all
    waves: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time > 0 else 0.0

    @property
    def idle(self) -> dict[int, float]:
        return {r: self.step_time - b for r, b in self.busy.items()}

    @property
    def utilization(self) -> dict[int, float]:
        return {r: (b / self.step_time if self.step_time > 0 else 0.0) for r, b in self.busy.items()}

    def summary(self) -> dict[str, Any]:
        util = self.utilization
        by_dev: dict[str, list[float]] = {}
        for r, u in util.items():
            by_dev.setdefault(self.devices[r], []).append(u)
        return {
            "schedule": self.schedule,
            "step_time_s": self.step_time,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "num_microbatches": self.num_microbatches,
            "waves": self.waves,
            "utilization_by_device": {d: sum(v) / len(v) for d, v in sorted(by_dev.items())},
            "busy_s": {str(r): b for r, b in sorted(self.busy.items())},
            "idle_s": {str(r): b for r, b in sorted(self.idle.items())},
            # the step's: every wave's bubbles (the timeline is one wave's); a rank's idle is
            # these and the time after the waves (waiting for the slowest tail)
            "bubble_s": {lane: self.waves * sum(e - s for s, e in gaps) for lane, gaps in self.bubbles.items()},
            "network_bytes": self.network_bytes,
        }


def check_setup(setup: StepSetup) -> None:
    """A setup every simulation can take: micro-batch sizes per lane, every expert placed,
    some rank with tokens (a ValueError names what is not)."""
    m = setup.model
    R = setup.num_microbatches
    if R < 1:
        raise ValueError(f"num_microbatches={R} must be >= 1")
    if setup.waves < 1:
        raise ValueError(f"waves={setup.waves} must be >= 1")
    if not setup.lanes:
        raise ValueError("simulate: no ranks")
    for lane in setup.lanes:
        if lane.seqs and len(lane.seqs) != R:
            raise ValueError(f"lane {lane.name}: {len(lane.seqs)} micro-batch sizes for R={R}")
        if len(lane.experts) != m.n_layers:
            raise ValueError(f"lane {lane.name}: expert counts for {len(lane.experts)} layers, model has {m.n_layers}")
    for l in range(m.n_layers):
        if all(lane.expert_ids for lane in setup.lanes):  # copies allowed: every expert held somewhere
            missing = [e for e, n in enumerate(setup.copies(l)) if n == 0]
            if missing:
                raise ValueError(f"layer {l}: experts {missing} are held by no rank")
            continue
        placed = sum(len(lane.ranks) * lane.experts[l] for lane in setup.lanes)
        if placed != m.moe.num_experts:
            raise ValueError(f"layer {l}: {placed} experts placed, model has {m.moe.num_experts}")
    if not any(lane.has_attention for lane in setup.lanes):
        raise ValueError("simulate: no rank has any tokens")


def build_tasks(setup: StepSetup, timer, every_gate: bool = False
                ) -> tuple[list[Task], dict[str, str], dict[str, float], list["LateHeader"]]:
    """The task graph, the resource policies, the per-lane tail (grad sync + optimizer) and
    the early rounds whose next receive depends on timing (:func:`run_step_dag` settles them).
    ``every_gate``: keep the edges a channel's order already implies (the reference the
    pruned graph is tested against)."""
    check_setup(setup)
    if setup.schedule is not None:
        tasks, policies, late = _schedule_tasks(setup, timer, every_gate)
    else:
        tasks, policies, late = _ep_tasks(setup, timer)
    tails = {}
    if setup.schedule is None or setup.schedule.kind != "forward":
        tails = {lane_resource(i, lane): lane_tail(timer, setup, lane) for i, lane in enumerate(setup.lanes)}
    if carries_tails(setup):
        # the step before's tail, each rank's own, ahead of its first task (appended: the
        # other tasks' indices stay; first in its resource's order by priority)
        tasks += [Task(f"T.{res}", res, tail, [], (-1,), "tail") for res, tail in tails.items()]
    return tasks, policies, tails, late


def carries_tails(setup: StepSetup) -> bool:
    """Whether a step's graph starts each rank at the end of its own tail of the step before
    (zebra and DistEP in one wave): the ranks agree on the loss and the gradients' norm when
    the last task of any ends, then each runs its own gradient sync and optimizer step and
    goes on into the next step, whose first collectives wait only for what they carry. So an
    attention rank's first layer of the next step runs while the expert ranks still step their
    experts, and the step's time is the graph's makespan, measured from the previous compute
    end. Several waves keep the tail after the last (the next wave waits for the loss)."""
    return setup.schedule is not None and tail_carried(setup.schedule.kind, setup.waves)


def tail_carried(schedule: str, waves: int) -> bool:
    """The rule of :func:`carries_tails` for a schedule kind and a step's waves (the zebra
    backend's emulated clock asks it too, so that the two agree)."""
    return schedule in ("zebra", "distep") and waves == 1


@dataclass
class LateHeader:
    """An expert rank's early round: it issues the next round's receive before the round's
    experts (``expert``) if the next round was emitted (``emitters``) by the time they start;
    else after them (``dispatch`` waits for ``expert``), its host held until the header comes
    (``follow``, its next task, waits for the emitters)."""

    expert: int
    dispatch: int
    emitters: list[int]
    follow: int | None


def run_step_dag(tasks: list[Task], policies: dict[str, str], late: list[LateHeader], passes: int = 4) -> Timeline:
    """Run the graph, then give every early round whose next header came after its experts
    started the late order, and run again (a handful of passes: each only adds waits)."""
    tl = run_dag(tasks, policies)
    pending = list(late)
    for _ in range(passes):
        moved = [h for h in pending if h.emitters and max(tl.end[e] for e in h.emitters) > tl.start[h.expert] + 1e-12]
        if not moved:
            break
        for h in moved:
            tasks[h.dispatch].deps.append(h.expert)
            if h.follow is not None:
                tasks[h.follow].deps.extend(h.emitters)
        gone = {id(h) for h in moved}
        pending = [h for h in pending if id(h) not in gone]
        tl = run_dag(tasks, policies)
    return tl


def lane_resource(i: int, lane: Lane) -> str:
    return f"{i}:{lane.name}"


def step_tail(timer, model: ModelConfig, device: DeviceSpec, link: LinkConfig, *, experts_held: int,
              has_attention: bool, replicas: int, attention_dp: int, dense_link: LinkConfig | None = None) -> float:
    """After the last backward: gradient all-reduce among replicas (not overlapped, to be
    conservative) and the optimizer step over the parameters a rank holds. ``link`` carries
    the experts' ring, ``dense_link`` (default: ``link``) the attention stack's."""
    from ..profile.memory import MemoryModel

    mem = MemoryModel(model)
    params = experts_held * mem.expert_params()
    t = timer.grad_sync(experts_held * mem.expert_params(), replicas, link)
    if has_attention:
        params += mem.attention_stack_params()
        t += timer.grad_sync(mem.attention_stack_params(), attention_dp, dense_link or link)
    return t + timer.optimizer(device, params)


def lane_tail(timer, setup: StepSetup, lane: Lane) -> float:
    return step_tail(timer, setup.model, lane.device, setup.replica_link(lane), experts_held=sum(lane.experts),
                     has_attention=lane.has_attention or lane.role == "attention", replicas=setup.replicas,
                     attention_dp=setup.attention_dp, dense_link=setup.dense_link())


def exchange_legs(setup: StepSetup, layer: int, tokens: list[float]) -> tuple[list[tuple[float, LinkConfig]], float]:
    """The rows of one leg of an exchange on each link it uses, and the rows that cross the
    network (every group's). ``tokens[i]`` is lane ``i``'s tokens in the round.

    A rank sends each other rank of its group ``tokens * top_k * that rank's share`` of the
    choices and receives in the same way, so a node's sums of tokens and shares split each
    rank's traffic into the part that stays on its node and the part that leaves it. Ranks
    of a lane on one node behave alike: the sums run over (lane, node) pairs."""
    if copies.replicated(setup, layer):
        return copies.legs(setup, layer, tokens)
    topo = setup.topology
    if topo.num_nodes == 1:
        return [(float(_flat_rows(setup, [layer], tokens)[0]), topo.links[0])], 0.0
    intra, worst, out = (x[0] for x in _node_rows(setup, [layer], tokens))
    legs = [(float(intra[n]), topo.links[n]) for n in np.flatnonzero(intra > 0)]
    legs += [(float(worst[n]), topo.network) for n in np.flatnonzero(worst > 0)]
    return legs, sum(out.tolist())


def _flat_rows(setup: StepSetup, layers: list[int], tokens: list[float]) -> np.ndarray:
    """One node: per layer of ``layers``, the busiest rank's rows sent or received."""
    k = setup.model.moe.top_k
    s = np.stack([setup.lane_shares(layer) for layer in layers])
    group = sum(len(lane.ranks) * t for lane, t in zip(setup.lanes, tokens))
    t = np.asarray(tokens, dtype=float)
    return np.maximum(t * k * (1 - s), (group - t) * k * s).max(axis=1, initial=0.0)


def _node_rows(setup: StepSetup, layers: list[int], tokens: list[float]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer of ``layers`` and node: the busiest rank's rows to and from the node's
    other ranks, the node's rows over the network (the larger way), and its rows out.

    One row per (group, lane, node): the lane's ranks of that group on that node; each
    group's node sums of tokens and shares, then each row's traffic, in arrays (thousands
    of groups on thousands of nodes, every layer at once). bincount adds in row order, as a
    loop over groups, lanes and nodes would: the same sums to the last bit."""
    k = setup.model.moe.top_k
    nodes = setup.topology.num_nodes
    group = sum(len(lane.ranks) * t for lane, t in zip(setup.lanes, tokens))
    lane, node, count, where, n_places = setup.lane_node_rows()
    for layer in layers:
        if layer not in setup._share_rows:
            setup._share_rows[layer] = setup.lane_shares(layer)[lane]
    n = len(layers)
    t = np.asarray(tokens, dtype=float)[lane]
    s = setup._share_rows[layers[0]][None] if n == 1 else np.stack([setup._share_rows[layer] for layer in layers])
    at = np.arange(n)[:, None]

    def by_layer(index: np.ndarray, width: int, weights: np.ndarray) -> np.ndarray:
        # each layer's bins apart: a layer's rows are added in row order, as alone
        flat = index if n == 1 else (at * width + index).ravel()
        return np.bincount(flat, weights=weights.ravel(), minlength=n * width).reshape(n, width)

    node_t = np.bincount(where, weights=count * t, minlength=n_places)[where]
    node_s = by_layer(where, n_places, count * s)[:, where]
    intra = np.zeros(n * nodes)
    np.maximum.at(intra, node if n == 1 else (at * nodes + node).ravel(),
                  np.maximum(t * k * (node_s - s), s * k * (node_t - t)).ravel())
    out = by_layer(node, nodes, count * t * k * (1 - node_s))
    inn = by_layer(node, nodes, count * s * k * (group - node_t))
    return intra.reshape(n, nodes), np.maximum(out, inn), out


def round_transfer_time(setup: StepSetup, timer, layer: int, tokens: list[float]) -> float:
    """One leg of a round: the slowest of its links (see :func:`exchange_legs`), each
    latency + its busiest rows over its bandwidth."""
    key = setup.leg_key(layer, tokens)
    if key not in setup._leg_time:
        topo = setup.topology
        if copies.replicated(setup, layer):
            legs, _ = setup.exchange(layer, tokens)
            # a leg's time grows with its rows: only each link's busiest leg can be the slowest
            busiest: dict[int, tuple[float, LinkConfig]] = {}
            for rows, link in legs:
                if rows > busiest.get(id(link), (-1.0, link))[0]:
                    busiest[id(link)] = (rows, link)
            setup._leg_time[key] = max((timer.transfer(rows, link) for rows, link in busiest.values()), default=0.0)
            return setup._leg_time[key]
        # every layer's legs for these tokens at once (each distinct one: at even routing
        # layers whose ranks hold alike counts share theirs), in one pass over the arrays: a
        # search asks each (layer, micro-batch) of a step, and the passes' fixed cost was most of it
        layers, keys = [layer], {key}
        for l in range(setup.model.n_layers):
            k = setup.leg_key(l, tokens)
            if k not in keys and k not in setup._leg_time and not copies.replicated(setup, l):
                layers.append(l)
                keys.add(k)
        if topo.num_nodes == 1:
            for l, rows in zip(layers, _flat_rows(setup, layers, tokens)):
                setup._leg_time[setup.leg_key(l, tokens)] = timer.transfer(float(rows), topo.links[0])
        else:
            # thousands of nodes share a few kinds of link: each kind's busiest node, in arrays
            intra, worst, _ = _node_rows(setup, layers, tokens)
            kind, links = topo.link_kinds()
            for l, row, top in zip(layers, intra, worst.max(axis=1, initial=0.0)):
                busiest = np.zeros(len(links))
                np.maximum.at(busiest, kind, row)
                times = [timer.transfer(float(rows), link) for rows, link in zip(busiest, links) if rows > 0]
                if top > 0:
                    times.append(timer.transfer(float(top), topo.network))
                setup._leg_time[setup.leg_key(l, tokens)] = max(times, default=0.0)
    return setup._leg_time[key]


def lane_tokens(setup: StepSetup) -> list[list[int]]:
    """Tokens each lane's ranks attend, per micro-batch."""
    S, R = setup.seq_len, setup.num_microbatches
    return [[(lane.seqs[j] if lane.seqs else 0) * S for j in range(R)] for lane in setup.lanes]


def network_rows(setup: StepSetup) -> float:
    """Token rows that cross the network between nodes in one step, every group's, every
    leg (dispatch and combine, forward and backward: zebra's rounds on both channels, or
    EP's four legs per layer and micro-batch)."""
    if setup.topology.num_nodes == 1:
        return 0.0
    R = setup.num_microbatches
    tok = lane_tokens(setup)
    if setup.schedule is not None:
        return sum(2 * setup.exchange(r.layer, [t[r.mb] for t in tok])[1] for r in setup.schedule.rounds)
    return sum(4 * setup.exchange(l, [t[j] for t in tok])[1] for l in range(setup.model.n_layers) for j in range(R))


class TaskTimes:
    """Each lane's compute tasks priced by the timer, each distinct one asked once: micro-
    batches of one size cost alike, and so do expert tasks that see as many tokens."""

    def __init__(self, setup: StepSetup, timer, forward_only: bool = False) -> None:
        self.setup, self.timer, self.forward_only = setup, timer, forward_only
        self.tokens = lane_tokens(setup)
        # the group's tokens per micro-batch (every rank's): what its experts share
        self.group = [sum(len(lane.ranks) * self.tokens[i][j] for i, lane in enumerate(setup.lanes))
                      for j in range(setup.num_microbatches)]
        self._memo: dict[tuple, float] = {}
        self._per_expert: dict[tuple, float] = {}  # keyed by the lanes' devices, alive as long as this
        self._tables: dict[tuple, np.ndarray] = {}
        self._codes: np.ndarray | None = None
        self._kinds: list[DeviceSpec] = []

    def __call__(self, i: int, kind: str, layer: int, mb: int) -> float:
        expert = kind in ("expert_fwd", "expert_bwd")
        # with copies (EP) what a copy serves depends on who sends: every lane's tokens
        copied = expert and copies.replicated(self.setup, layer)
        group = tuple(t[mb] for t in self.tokens) if copied else self.group[mb]
        key = (i, kind, layer, group) if expert else (i, kind, self.tokens[i][mb])
        if key not in self._memo:
            lane, timer = self.setup.lanes[i], self.timer
            dev, n = lane.device, self.tokens[i][mb]
            if kind == "attn_fwd":
                self._memo[key] = timer.attention(dev, n)
            elif kind == "attn_bwd":
                self._memo[key] = timer.attention(dev, n, backward=True)
            elif kind == "head":
                self._memo[key] = timer.head(dev, n, forward_only=self.forward_only)
            elif not copied and self.setup.measured_by_id():
                self._memo[key] = float(self.held_experts(np.array([i]), np.array([layer]), kind, mb)[0])
            else:
                served = copies.expert_tokens(self.setup, i, layer, list(group)) if copied \
                    else self.setup.expert_tokens(lane, layer, self.group[mb])
                self._memo[key] = sum(self._expert(dev, x, kind == "expert_bwd") for x in served)
        return self._memo[key]

    def _expert(self, dev: DeviceSpec, tokens: float, backward: bool) -> float:
        # under even routing every expert of a lane sees as many tokens: asked once
        key = (id(dev), tokens, backward)
        if key not in self._per_expert:
            self._per_expert[key] = self.timer.expert(dev, tokens, backward=backward)
        return self._per_expert[key]

    def held_experts(self, members: np.ndarray, layers: np.ndarray, kind: str, mb: int) -> np.ndarray:
        """The expert task (``kind``, micro-batch ``mb``) of each lane ``members[n]`` in
        layer ``layers[n]`` at the measured routing (no copies across senders: zebra,
        DistEP, EP without redundant experts), all at once. Every expert's time is asked of
        the timer as one array per device kind and micro-batch (hundreds of lanes each
        holding a few of 128 experts asked one number at a time was most of a search's time
        at a routing); a lane's is the sum over the experts it holds, in its order, as one
        would add them."""
        held = self.setup.held_ids()[layers, members]
        return add_columns(self._expert_tables(kind, mb)[self._codes[members][:, None], layers[:, None], held])

    def _expert_tables(self, kind: str, mb: int) -> np.ndarray:
        """Per device kind, layer and expert, the expert task's time on the tokens the
        measured routing gives it in micro-batch ``mb`` (its copies splitting them), and a
        zero after the last expert."""
        key = (kind, mb)
        if key not in self._tables:
            setup, m = self.setup, self.setup.model
            if self._codes is None:
                codes, self._kinds = distinct([lane.device for lane in setup.lanes])
                self._codes = np.array(codes, dtype=np.intp)
            load = np.array(setup.expert_load, dtype=float)
            n = np.array([setup.copies(layer) for layer in range(m.n_layers)], dtype=float)
            # as expert_tokens: group tokens times k times the share, over the copies
            tokens = (self.group[mb] * m.moe.top_k * load / np.maximum(n, 1.0)).ravel()
            table = np.zeros((len(self._kinds), m.n_layers, m.moe.num_experts + 1))
            for c, dev in enumerate(self._kinds):
                table[c, :, :-1] = expert_times(self.timer, dev, tokens, kind == "expert_bwd").reshape(m.n_layers, -1)
            self._tables[key] = table
        return self._tables[key]


def add_columns(each: np.ndarray) -> np.ndarray:
    """Each row's sum, column by column: the same additions in the same order as a loop
    over the row (numpy's own sum pairs them), so the same number to the last bit."""
    total = each[:, 0].copy()
    for j in range(1, each.shape[1]):
        total += each[:, j]
    return total


def expert_times(timer, dev: DeviceSpec, tokens: np.ndarray, backward: bool) -> np.ndarray:
    """``timer.expert`` of every element of ``tokens``: as one array where the timer takes
    one (``experts``: the pack's timers, the same numbers), else one number at a time."""
    many = getattr(timer, "experts", None)
    if many is not None:
        return np.asarray(many(dev, tokens, backward), dtype=float)
    return np.array([timer.expert(dev, float(x), backward=backward) for x in tokens], dtype=float)


class _Shape:
    """What a schedule's task graph looks like apart from its durations, for one pattern of
    attention ranks holding experts: channel positions and every member's task list with
    its dependencies as integer offsets. A planner's search builds thousands of graphs of a
    few shapes, each with dozens of lanes that share a few member patterns; the structure is
    worked out once per shape and member and only offset per lane."""

    def __init__(self, sched: Schedule, attention_holds: tuple[bool, ...]) -> None:
        L = sched.num_layers
        self.sched = sched
        rounds = sched.rounds
        self.n_rounds = nR = len(rounds)
        self.position = position = {r: k for k, r in enumerate(rounds)}
        self.count_rounds = sched.count_rounds()
        # channel tasks, relative to the first: dispatches k, combines nR + k, counts 2 nR + c
        self.count_at = {key: 2 * nR + c for c, key in enumerate(self.count_rounds)}
        self.attention_index = {t: n for n, t in enumerate(sched.attention)}
        early = sched.early_rounds(attention_holds)
        self.early = [r in early for r in rounds]
        emitters: dict[int, list[int]] = {}
        for n, t in enumerate(sched.attention):
            emitters.setdefault(position.get(emitted_round(t, L), -1), []).append(n)
        self.emitters = [emitters.get(k, []) for k in range(nR)]
        # the attention task after which each round's combine is posted, where that is not
        # its emitter (the combine then waits for it on every attention rank); a round posted
        # at the same point as the one before it needs no edge of its own: its channel runs
        # the rounds in order
        points = sched.combine_points(attention_holds)
        self.posted = [[p - 1] if p - 1 not in self.emitters[k] and (k == 0 or points[k - 1] != p) else []
                       for k, p in enumerate(points)]
        # the issue order as (is a combine, round position, layer), and each round's expert task
        self.issue = [(kind == "combine", position[r], r.layer) for kind, r in sched.issue_order(attention_holds)]
        self.round_layer = [r.layer for r in rounds]
        self.round_task = [r.expert_task for r in rounds]
        self.round_name = [str(t) for t in self.round_task]
        self._members: dict[tuple, _Member] = {}

    def member(self, has_attention: bool, holds: tuple[bool, ...]) -> "_Member":
        key = (has_attention, holds)
        if key not in self._members:
            self._members[key] = _Member(self, has_attention, holds)
        return self._members[key]


class _Member:
    """One member pattern's tasks in order: names, kinds, dependencies on the channels (as
    offsets from the first channel task), where each round's expert task and each attention
    task sit, and (expert members) the task each collective waits for."""

    def __init__(self, shape: _Shape, has_attention: bool, holds: tuple[bool, ...]) -> None:
        sched = shape.sched
        L, nR = sched.num_layers, shape.n_rounds
        self.holds = holds
        self.expert_at = [-1] * nR  # round k's expert task's position here
        self._edges: dict[bool, tuple[list, list, list]] = {}
        if not has_attention:  # the rounds of the layers it holds, in round order
            mine = [k for k in range(nR) if holds[shape.round_layer[k]]]
            self.tasks = [shape.round_task[k] for k in mine]
            self.names = [shape.round_name[k] for k in mine]
            self.deps = [[k] for k in mine]
            for pos, k in enumerate(mine):
                self.expert_at[k] = pos
            self.attention_at = []
            self.gates = self._gates(shape)
            return
        self.tasks = sched.member_tasks(has_attention, holds)
        self.names = [str(t) for t in self.tasks]
        self.deps: list[list[int]] = []
        self.attention_at = [-1] * len(sched.attention)
        for pos, t in enumerate(self.tasks):
            if t.kind in ("expert_fwd", "expert_bwd"):
                k = shape.position[Round("fwd" if t.kind == "expert_fwd" else "bwd", t.layer, t.mb)]
                self.expert_at[k] = pos
                self.deps.append([k])
                continue
            self.attention_at[shape.attention_index[t]] = pos
            deps = []
            need = awaited_round(t, L)
            if need is not None and need in shape.position:
                deps.append(nR + shape.position[need])
            g = sched.balance_group(t.mb)
            if g is not None and t.kind in ("attn_fwd", "head") and (t.kind == "head" or t.layer > 0):
                c = shape.count_at.get((L - 1 if t.kind == "head" else t.layer - 1, g))
                if c is not None:
                    deps.append(c)
            self.deps.append(deps)
        self.gates: dict[str, list[int]] | None = None

    def edges(self, shape: _Shape, every_gate: bool) -> tuple[list, list, list]:
        """The rounds' waits on this member's tasks, as (round, position) pairs per channel,
        and its early rounds' late headers as (round, position, next position or None).

        A channel runs its rounds one at a time in order, so a round need not wait for a
        task that an earlier round on its channel already waits for (or for one before it:
        a member's tasks run in order). Only the first round after each new answer gets the
        edge: O(tasks) edges instead of O(lanes x rounds) (``every_gate``: all of them)."""
        if every_gate not in self._edges:
            out: dict[str, list[tuple[int, int]]] = {"a2e": [], "e2a": []}
            waited = {"a2e": -1, "e2a": -1}
            late = []

            def gate(chan: str, k: int, on: int) -> None:
                if on >= 0 and (every_gate or waited[chan] < on):
                    waited[chan] = on
                    out[chan].append((k, on))

            for k in range(shape.n_rounds):
                if self.holds[shape.round_layer[k]]:
                    mine = self.expert_at[k]
                    gate("e2a", k, mine)
                    if shape.early[k] and self.gates is not None:
                        late.append((k, mine, mine + 1 if mine + 1 < len(self.tasks) else None))
                elif self.gates is not None:
                    gate("e2a", k, self.gates["combine"][k])
                if self.gates is not None:
                    gate("a2e", k, self.gates["dispatch"][k])
            self._edges[every_gate] = (out["e2a"], out["a2e"], late)
        return self._edges[every_gate]

    def _gates(self, shape: _Shape) -> dict[str, list[int]]:
        """An expert rank takes part in a collective once its host reaches it: after the
        expert task of the last round it answered before that point in the issue order."""
        gates = {"combine": [-1] * shape.n_rounds, "dispatch": [-1] * shape.n_rounds}
        combine, dispatch = gates["combine"], gates["dispatch"]
        answered = -1
        for is_combine, k, layer in shape.issue:
            if is_combine and self.holds[layer]:
                answered = self.expert_at[k]
            elif answered >= 0:
                (combine if is_combine else dispatch)[k] = answered
        return gates


_SHAPES: dict[tuple, _Shape] = {}


def graph_shape(sched: Schedule, attention_holds: tuple[bool, ...]) -> _Shape:
    """The schedule's :class:`_Shape`, kept while the schedule is the same object (the
    simulator's schedules are shared and live on; a few shapes per search)."""
    if sched.layered:  # its order does not depend on which layers attention ranks hold
        attention_holds = (True,) * sched.num_layers
    key = (id(sched), attention_holds)
    got = _SHAPES.get(key)
    if got is None or got.sched is not sched:
        if len(_SHAPES) > 256:
            _SHAPES.clear()
        got = _SHAPES[key] = _Shape(sched, attention_holds)
    return got


def _schedule_tasks(setup: StepSetup, timer, every_gate: bool = False
                    ) -> tuple[list[Task], dict[str, str], list[LateHeader]]:
    sched = setup.schedule
    m = setup.model
    L, R, E = m.n_layers, setup.num_microbatches, m.moe.num_experts
    if sched.num_layers != L or sched.num_microbatches != R:
        raise ValueError(f"schedule is for {sched.num_layers} layers x {sched.num_microbatches} micro-batches, "
                         f"the setup has {L} x {R}")
    lanes = setup.lanes
    times = TaskTimes(setup, timer, forward_only=sched.kind == "forward")
    tok = times.tokens
    att = [i for i, lane in enumerate(lanes) if lane.role == "attention"]
    attention_holds = tuple(any(lane.experts[l] for lane in lanes if lane.role == "attention") for l in range(L))
    shape = graph_shape(sched, attention_holds)
    members = [shape.member(lane.role == "attention", tuple(e > 0 for e in lane.experts)) for lane in lanes]
    tasks: list[Task] = []
    policies: dict[str, str] = {}
    # each lane's tasks one after another: lane i's task at position p is base[i] + p
    base = []
    for i, lane in enumerate(lanes):
        res = lane_resource(i, lane)
        policies[res] = "order"
        base.append(len(tasks))
        mem = members[i]
        for pos, (t, name) in enumerate(zip(mem.tasks, mem.names)):
            tasks.append(Task(name, res, times(i, t.kind, t.layer, t.mb), [], (pos,), t.kind, t.layer, t.mb))
    first = len(tasks)  # the channels' tasks follow: see _Shape
    nR = shape.n_rounds
    # a round's two legs move as many rows: priced once for both channels
    legs = [round_transfer_time(setup, timer, r.layer, [t[r.mb] for t in tok]) for r in sched.rounds]
    for chan, label in (("a2e", "D"), ("e2a", "C")):
        policies[chan] = "order"
        for pos, (r, dur) in enumerate(zip(sched.rounds, legs)):
            tasks.append(Task(f"{label}{r.phase[0]}{r.layer}.{r.mb}", chan, dur, [], (pos,),
                              "dispatch" if chan == "a2e" else "combine", r.layer, r.mb))
    policies["dense"] = "order"
    count_bytes = E * 8
    dense_link = setup.dense_link()
    for pos, (l, g) in enumerate(shape.count_rounds):
        tasks.append(Task(f"N{l}.{g}", "dense", timer.allreduce(count_bytes, setup.attention_dp, dense_link),
                          [], (pos,), "count", l, -1))
    for i in range(len(lanes)):
        b = base[i]
        for pos, deps in enumerate(members[i].deps):
            if deps:
                tasks[b + pos].deps.extend(first + d for d in deps)
    # Every member issues the collectives in one order (Schedule.issue_order). An expert rank
    # takes part in one once its host reaches it, and the communication stream waits for the
    # compute queued by then: the expert task of the last round it answered before that
    # point. Where a round q is early, the next round's receive is issued before q's experts
    # are queued if it was emitted by then (else after them: run_step_dag settles which),
    # and the attention ranks post q's combine with the next round's dispatch.
    late: list[LateHeader] = []
    next_emitters: dict[int, list[int]] = {}  # per early round, the next round's emitters' tasks
    for k in range(nR):
        early = shape.early[k]
        nxt = shape.emitters[k + 1] if early else []
        posted = shape.posted[k]
        for i in att:
            at, b = members[i].attention_at, base[i]
            tasks[first + k].deps.extend(b + at[n] for n in shape.emitters[k])
            tasks[first + nR + k].deps.extend(b + at[n] for n in posted)
        if early:
            next_emitters[k] = [base[a] + members[a].attention_at[n] for a in att for n in nxt]
    for i, lane in enumerate(lanes):
        b = base[i]
        on_combine, on_dispatch, headers = members[i].edges(shape, every_gate)
        for k, pos in on_combine:
            tasks[first + nR + k].deps.append(b + pos)
        for k, pos in on_dispatch:
            tasks[first + k].deps.append(b + pos)
        # the next round's receive goes before round k's experts only if its header is in
        # by the time they could start: run_step_dag checks, once timed
        for k, pos, follow in headers:
            if next_emitters.get(k):
                late.append(LateHeader(b + pos, first + k + 1, list(next_emitters[k]),
                                       None if follow is None else b + follow))
    for g, mbs in enumerate(sched.balance_groups):
        for l in range(L):
            c = tasks[first + shape.count_at[(l, g)]]
            for i in att:
                at, b = members[i].attention_at, base[i]
                c.deps.extend(b + at[shape.attention_index[ScheduleTask("attn_fwd", l, j)]] for j in mbs)
    return tasks, policies, late


LABELS = {"attn_fwd": "Af", "expert_fwd": "Xf", "head": "H", "expert_bwd": "Xb", "attn_bwd": "Ab"}
# EP's checkpointed blocks: the forward task each recompute repeats
RECOMPUTED = {"attn_re": "attn_fwd", "expert_re": "expert_fwd"}


def _ep_tasks(setup: StepSetup, timer) -> tuple[list[Task], dict[str, str], list[LateHeader]]:
    """EP: every rank attends and hosts experts; micro-batches one after another. The
    all-to-alls are synchronous (one task for every rank); each rank picks its ready tasks
    by priority: at the top layer a micro-batch's forward, head and backward back to back,
    below it forward by layer and backward down the layers.

    Where blocks are checkpointed (the timer's cost model recomputes), a block's backward
    first runs its forward again, experts and both exchanges included (an EP block's
    experts are inside it): attention, dispatch, experts, combine, then the backward's own
    exchanges; the backward tasks are what is left of their recomputing price."""
    L, R = setup.model.n_layers, setup.num_microbatches
    lanes = setup.lanes
    times = TaskTimes(setup, timer)
    recompute = bool(getattr(getattr(timer, "cost", None), "activation_checkpointing", False))
    att = [i for i, lane in enumerate(lanes) if lane.has_attention]
    hosts = [[i for i, lane in enumerate(lanes) if lane.experts[l]] for l in range(L)]
    tasks: list[Task] = []
    ids: dict[tuple, int] = {}
    legs: dict[tuple[int, int], float] = {}

    def add(key: tuple, name: str, resource: str, duration: float, deps: list[tuple], priority: tuple,
            kind: str, l: int, j: int) -> None:
        tasks.append(Task(name, resource, duration, [ids[d] for d in deps], priority, kind, l, j))
        ids[key] = len(tasks) - 1

    def duration(i: int, kind: str, l: int, j: int) -> float:
        if kind in RECOMPUTED:  # the forward once more
            return times(i, RECOMPUTED[kind], l, j)
        own = times(i, kind, l, j)
        if recompute and kind in ("attn_bwd", "expert_bwd"):  # its recompute is a task of its own
            return max(own - times(i, kind.replace("bwd", "fwd"), l, j), 0.0)
        return own

    def compute(kind: str, on: list[int], l: int, j: int, deps) -> None:
        if kind in RECOMPUTED:
            priority, name = (2 * L - l, -1, j), f"{LABELS[RECOMPUTED[kind]]}{l}.{j}r"
        else:
            sub = list(LABELS).index(kind)
            priority = (l, j, sub) if l == L - 1 else (l, sub, j) if sub < 2 else (2 * L - l, sub - 3, j)
            name = f"H.{j}" if kind == "head" else f"{LABELS[kind]}{l}.{j}"
        for i in on:
            add((kind, i, l, j), name, lane_resource(i, lanes[i]), duration(i, kind, l, j), deps(i), priority,
                kind, l, j)

    def exchange(kind: str, phase: str, l: int, j: int, deps: list[tuple]) -> None:
        if (l, j) not in legs:
            legs[(l, j)] = round_transfer_time(setup, timer, l, [t[j] for t in times.tokens])
        label = ("D" if kind == "dispatch" else "C") + phase
        add((label, l, j), f"{label}{l}.{j}", "a2e" if kind == "dispatch" else "e2a", legs[(l, j)], deps,
            (l, j) if phase == "f" else (2 * L - l, j), kind, l, j)

    for j in range(R):
        for l in range(L):
            # a micro-batch starts once every rank's backward of the previous one is done
            first = [("attn_bwd", i, 0, j - 1) for i in att] if j > 0 else []
            compute("attn_fwd", att, l, j, lambda i: [("Cf", l - 1, j)] if l > 0 else first)
            exchange("dispatch", "f", l, j, [("attn_fwd", i, l, j) for i in att])
            compute("expert_fwd", hosts[l], l, j, lambda i: [("Df", l, j)])
            exchange("combine", "f", l, j, [("expert_fwd", i, l, j) for i in hosts[l]])
        compute("head", att, L - 1, j, lambda i: [("Cf", L - 1, j)])
        for l in reversed(range(L)):
            above = [("head", i, L - 1, j) if l == L - 1 else ("attn_bwd", i, l + 1, j) for i in att]
            if recompute:
                compute("attn_re", att, l, j, lambda i: [above[att.index(i)]])
                exchange("dispatch", "r", l, j, [("attn_re", i, l, j) for i in att])
                compute("expert_re", hosts[l], l, j, lambda i: [("Dr", l, j)])
                exchange("combine", "r", l, j, [("expert_re", i, l, j) for i in hosts[l]])
                above = [("Cr", l, j)]
            exchange("dispatch", "b", l, j, above)
            compute("expert_bwd", hosts[l], l, j, lambda i: [("Db", l, j), ("expert_fwd", i, l, j)])
            exchange("combine", "b", l, j, [("expert_bwd", i, l, j) for i in hosts[l]])
            compute("attn_bwd", att, l, j, lambda i: [("Cb", l, j)])
    policies = {"a2e": "fifo", "e2a": "fifo"}
    for i, lane in enumerate(lanes):
        policies[lane_resource(i, lane)] = "priority" if lane.has_attention else "fifo"
    return tasks, policies, []


def disaggregated_step(makespan: float, tails: dict, waves: int = 1, carried: bool = False) -> float:
    if carried:  # the tails are in the graph (carries_tails)
        return makespan
    # Every tail starts when the last task of any rank ends: zebra and DistEP agree on the
    # step's loss (an all-reduce over every rank) before any rank's gradient sync and
    # optimizer, and under EP every rank holds the dense weights, whose gradient all-reduce
    # (DDP's) completes only once the slowest rank's backward has ended (each rank's own
    # last task plus its tail came out short: on A40+V100 at 4K the faster rank waited 45 ms
    # of a 1.78 s step). Waves run one after another (the next batch starts once the last
    # one's loss is agreed), the tail once after the last
    return waves * makespan + max(tails.values(), default=0.0)


def simulate_step(setup: StepSetup, timer, schedule: str = "zebra", keep_timeline: bool = True) -> StepResult:
    """Simulate one step of ``setup``; times come from ``timer`` (a TaskTimer)."""
    tasks, policies, tails, late = build_tasks(setup, timer)
    tl = run_step_dag(tasks, policies, late)
    lanes = setup.lanes
    per_res_busy: dict[str, float] = {}
    per_res_spans: dict[str, list[tuple[float, float]]] = {}
    for t, s, e in zip(tl.tasks, tl.start, tl.end, strict=True):
        if t.kind in COMPUTE_KINDS:
            per_res_busy[t.resource] = per_res_busy.get(t.resource, 0.0) + (e - s)
        if t.kind in COMPUTE_KINDS or t.kind == "tail":  # a carried tail is the rank's work, not a bubble
            per_res_spans.setdefault(t.resource, []).append((s, e))
    compute_end = tl.makespan
    step = disaggregated_step(compute_end, tails, setup.waves if setup.schedule is not None else 1,
                              carries_tails(setup))
    busy: dict[int, float] = {}
    devices: dict[int, str] = {}
    bubbles: dict[str, list[tuple[float, float]]] = {}
    for i, lane in enumerate(lanes):
        r = lane_resource(i, lane)
        b = per_res_busy.get(r, 0.0)
        spans = sorted(per_res_spans.get(r, []))
        gaps, cur = [], 0.0
        for s, e in spans:
            if s > cur + 1e-12:
                gaps.append((cur, s))
            cur = max(cur, e)
        if compute_end > cur + 1e-12:
            gaps.append((cur, compute_end))
        bubbles[lane.name] = gaps
        for rank in lane.ranks:
            busy[rank] = setup.waves * b  # the bubbles and timeline are one wave's
            devices[rank] = lane.device.name
    tokens = setup.waves * setup.replicas * sum(len(lane.ranks) * sum(lane.seqs) * setup.seq_len
                                                for lane in lanes if lane.seqs)
    network = (setup.waves * network_rows(setup) * setup.model.d_model * timer.cost.dtype_bytes
               if setup.topology.num_nodes > 1 else 0.0)
    return StepResult(schedule, step, tokens, busy, devices, bubbles, [lane.name for lane in lanes],
                      setup.num_microbatches, tl if keep_timeline else None, network_bytes=network,
                      waves=setup.waves)
