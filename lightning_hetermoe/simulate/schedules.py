"""The five schedules the simulator runs step by step, built from a plan or a bare device list
(:func:`~.predict.predict_step` chooses among them, and prices data-centric besides).

* ``zebra``: disaggregated roles (attention ranks / expert ranks), R micro-batches that
  overlap (Theorem-1 order), Asym-EA placement: the plan as it would run.
* ``distep``: the same roles but no micro-batch overlap and no Asym-EA; micro-batches
  run one after another (gradient accumulation), so attention and expert ranks take
  turns.
* ``ep``: every rank holds attention and ``E/W`` experts per layer and gets an equal share
  of the batch; all-to-alls are synchronous, so the slowest rank sets the pace.
* ``ep_balanced``: EP with each rank's share of sequences proportional to its speed.
* ``ep_ideal``: each device kind trains alone as its own EP job on its share of the
  batch; the throughputs are summed (EP(Ideal) in the paper).
"""

from __future__ import annotations

import functools

from typing import Any, Sequence

import numpy as np

from ..cluster.spec import LinkConfig
from ..cluster.topology import Topology
from ..cluster.devices import DeviceSpec
from ..configs import ModelConfig, OptimConfig
from ..profile.memory import MemoryModel
from ..apportion import apportion, split_microbatches
from ..placement import Placement, contiguous_placement
from ..task_order import answers_layered
from .step import Lane, StepResult, StepSetup, simulate_step

SCHEDULES = ("zebra", "distep", "ep", "ep_balanced", "ep_ideal")
EP_SCHEDULES = ("ep", "ep_balanced")  # the runnable EP schedules: priced at a group size a run can be set to


def make_lanes(members: list[tuple]) -> list[Lane]:
    """Merge ranks ``(rank, device, role, seqs_per_mb, experts_per_layer[, expert_ids_per_layer])``
    that behave alike (the same expert ids too, when given: loads may differ per expert)."""
    lanes: dict[tuple, Lane] = {}
    for rank, dev, role, seqs, experts, *rest in members:
        ids = [list(x) for x in rest[0]] if rest else []
        key = (dev, role, tuple(seqs), tuple(experts), tuple(tuple(x) for x in ids))
        if key in lanes:
            lanes[key].ranks.append(rank)
        else:
            lanes[key] = Lane(device=dev, ranks=[rank], seqs=list(seqs), experts=list(experts), role=role,
                              expert_ids=ids)
    return list(lanes.values())


# ---- EP --------------------------------------------------------------------------------
def ep_speed(dev: DeviceSpec, timer, model: ModelConfig, seq_len: int) -> float:
    """Sequences per second of attention work (all layers, forward+backward, LM head) on ``dev``.

    In EP the experts stay evenly spread, so a rank's expert work does not depend on its
    share of the batch; only the attention side can be balanced by the split.
    """
    L = model.n_layers
    per_seq = L * (timer.attention(dev, seq_len) + timer.attention(dev, seq_len, backward=True))
    return 1.0 / (per_seq + timer.head(dev, seq_len))


def ep_balanced_shares(total_seqs: int, speeds: Sequence[float]) -> list[int]:
    """Sequences per EP rank in proportion to ``speeds``, at least one each: every EP rank
    takes part in every all-to-all, and a rank without tokens would only wait."""
    W = len(speeds)
    if total_seqs < W:
        raise ValueError(f"{total_seqs} sequences cannot give each of {W} EP ranks one")
    return [1 + s for s in apportion(total_seqs - W, speeds)]


def ep_setup(
    devs: Sequence[DeviceSpec],
    model: ModelConfig,
    *,
    seq_len: int,
    total_seqs: int,
    link: LinkConfig | Topology,
    timer,
    balanced: bool = False,
    ranks: Sequence[int] | None = None,
    num_microbatches: int | None = None,
    expert_load: list[list[float]] | None = None,
    placement: Placement | None = None,
    ep_size: int | None = None,
    group: int = 0,
    optimizer: OptimConfig | None = None,
    weight_averages: int = 0,
) -> StepSetup:
    """The EP step of EP group ``group``: every rank attends its share of the batch and
    holds its EP rank's contiguous slice of the experts, or ``placement``'s. ``ep_size``
    consecutive ranks form an EP group (``None``: all of them, one group); with several,
    the others are the setup's replicas, as the EP strategy runs them: each group's
    exchange stays inside it, and each expert's gradients are summed over its copies in
    the other groups after the backward. The micro-batches, where not given, the fewest
    that fit on every rank with ``optimizer``'s state
    (:func:`~lightning_hetermoe.profile.memory.optimizer_pricing`) and ``weight_averages``
    copies of the weights."""
    W = len(devs)
    if W == 0:
        raise ValueError("EP needs at least one rank")
    ep = ep_size or W
    if ep < 1 or W % ep:
        raise ValueError(f"ep_size={ep} is invalid: must divide the {W} ranks")
    G = W // ep
    if not 0 <= group < G:
        raise ValueError(f"group={group} is invalid: {W} ranks form {G} EP group(s) of {ep}")
    ranks = list(ranks) if ranks is not None else list(range(W))
    if balanced:
        seqs = ep_balanced_shares(total_seqs, [ep_speed(d, timer, model, seq_len) for d in devs])
    else:
        seqs = apportion(total_seqs, [1.0] * W)
    contiguous = contiguous_placement(model.moe.num_experts, ep)  # what the EP strategy runs
    ids = [[contiguous[i % ep]] * model.n_layers for i in range(W)]
    experts = [[len(contiguous[i % ep])] * model.n_layers for i in range(W)]
    if placement is not None:
        held = [[placement.experts_of(i % ep, l) for l in range(placement.num_layers)] for i in range(ep)]
        ids = [held[i % ep] for i in range(W)]
        experts = [[len(x) for x in h] for h in ids]
    # one number of micro-batches for every rank: the strategy runs one
    R = num_microbatches or _fewest_microbatches(MemoryModel.for_optimizer(model, optimizer, weight_averages),
                                                 [(d, n, sum(held)) for d, n, held in zip(devs, seqs, experts)],
                                                 ep, seq_len)
    if R is None:
        raise ValueError(
            f"EP does not fit: even one sequence of {seq_len} tokens per micro-batch exceeds a rank's memory"
        )
    mine = range(group * ep, (group + 1) * ep)
    # Expert ids price a measured routing or a placement's copies; at even routing only the
    # counts do, and leaving the ids out lets the group's alike ranks share a lane (a group of
    # hundreds of ranks of a few kinds is then a graph of a few lanes).
    by_id = expert_load is not None or placement is not None
    members = [(ranks[i], devs[i], "ep", split_microbatches(seqs[i], R), experts[i], *([ids[i]] if by_id else []))
               for i in mine]
    return StepSetup(
        lanes=make_lanes(members),
        model=model,
        seq_len=seq_len,
        num_microbatches=R,
        link=link,
        replicas=G,
        attention_dp=W,
        expert_load=expert_load,
        # each rank's copies of its experts in the other groups, itself first
        replica_ranks=({ranks[i]: [ranks[(i + h * ep) % W] for h in range(G)] for i in mine} if G > 1 else None),
        dense_ranks=ranks if G > 1 else None,
        copy_routes=None if placement is None or placement.routes is None
        else [placement.layer_routes(l) for l in range(placement.num_layers)],
    )


def _fewest_microbatches(memory: MemoryModel, members: list[tuple], ep: int, seq_len: int) -> int | None:
    """The fewest micro-batches with which every EP group fits: each group's experts see
    its own members' tokens, not the world's (groups alike are checked once)."""
    groups = {tuple(members[g * ep:(g + 1) * ep]) for g in range(len(members) // ep)}
    fewest = [memory.fewest_microbatches(list(g), seq_len) for g in groups]
    return None if None in fewest else max(fewest)


def simulate_ep(devs, model, *, seq_len, total_seqs, link, timer, balanced=False, keep_timeline=True,
                expert_load: list[list[float]] | None = None, num_microbatches: int | None = None,
                placement: Placement | None = None, ep_size: int | None = None,
                replica_dispatch: str = "local_first", optimizer: OptimConfig | None = None,
                weight_averages: int = 0) -> StepResult:
    """EP's step (see :func:`ep_setup`). With several EP groups each kind of group (its
    devices, rank by rank) is simulated once, by its first group, and the slowest is the
    step: the groups meet in the gradient sync after the backward. (A batch's remainder
    goes to the lower ranks first, so a kind's first group carries the most of its kind.)"""
    ep = ep_size or len(devs)
    groups = len(devs) // ep if ep > 0 and len(devs) % ep == 0 else 1
    kinds: dict[tuple, int] = {}
    for g in range(groups):
        kinds.setdefault(tuple(d.name for d in devs[g * ep:(g + 1) * ep]), g)
    slowest: StepResult | None = None
    for g in kinds.values():
        setup = ep_setup(devs, model, seq_len=seq_len, total_seqs=total_seqs, link=link, timer=timer,
                         balanced=balanced, expert_load=expert_load, num_microbatches=num_microbatches,
                         placement=placement, ep_size=ep_size, group=g, optimizer=optimizer,
                         weight_averages=weight_averages)
        setup.replica_dispatch = replica_dispatch
        res = simulate_step(setup, timer, "ep_balanced" if balanced else "ep", keep_timeline=keep_timeline)
        if slowest is None or res.step_time > slowest.step_time:
            slowest = res
    if groups > 1:
        # the whole batch, whichever group set the pace (groups' shares may differ)
        slowest.tokens = seq_len * total_seqs
    return slowest


def simulate_ep_ideal(devs, model, *, seq_len, total_seqs, link, timer,
                      optimizer: OptimConfig | None = None, weight_averages: int = 0) -> StepResult:
    """Each device kind runs EP alone on its rank share of the batch; throughputs add up."""
    kinds: dict[str, list[int]] = {}
    for r, d in enumerate(devs):
        kinds.setdefault(d.name, []).append(r)
    shares = apportion(total_seqs, [len(v) for v in kinds.values()])
    tokens, tps = 0, 0.0
    busy: dict[int, float] = {}
    devices: dict[int, str] = {}
    bubbles: dict[str, Any] = {}
    lanes: list[str] = []
    subs = []
    for (name, ranks), share in zip(kinds.items(), shares):
        if share == 0:
            continue
        sub_devs = [devs[r] for r in ranks]
        setup = ep_setup(sub_devs, model, seq_len=seq_len, total_seqs=share, link=link, timer=timer, ranks=ranks,
                         optimizer=optimizer, weight_averages=weight_averages)
        res = simulate_step(setup, timer, "ep", keep_timeline=False)
        subs.append(res)
        tokens += res.tokens
        tps += res.tokens_per_s
        bubbles.update(res.bubbles)
        lanes += res.lanes
        for r in ranks:
            devices[r] = name
            busy[r] = res.busy[r] / res.step_time  # utilisation; rescaled below
    step = tokens / tps
    busy = {r: u * step for r, u in busy.items()}
    return StepResult("ep_ideal", step, tokens, busy, devices, bubbles, lanes, max(s.num_microbatches for s in subs),
                      network_bytes=sum(s.network_bytes for s in subs))


# ---- plans -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def shared_schedule(kind: str, num_layers: int, num_microbatches: int, balance: bool, layered: bool = False):
    """One schedule per shape for every simulation (a search simulates thousands of plans of
    a few shapes; each schedule memoises its members' task lists). Read only. Room for every
    kind, R and order a search meets: a schedule evicted and built again is a new object, and
    the simulator's graph shapes (keyed by it) are worked out again (at 64, planning 1,024
    GPUs on nodes took 40-60% longer)."""
    from ..task_order import build_schedule

    return build_schedule(kind, num_layers, num_microbatches, balance=balance, layered=layered)


def plan_setup(
    plan, devs: Sequence[DeviceSpec], model: ModelConfig, link: LinkConfig | Topology, *, schedule: str = "zebra",
    expert_load: list[list[float]] | None = None,
) -> StepSetup:
    """The first ZP group of ``plan`` (all groups are identical) as a StepSetup;
    ``expert_load`` (per layer, each expert's share of the routing) replaces even routing."""
    group = plan.zp_groups[0]
    L = model.n_layers
    if schedule == "distep":
        R = plan.distep_microbatches or 1
    elif schedule in ("zebra", "forward"):
        R = plan.num_microbatches
    else:
        raise ValueError(f"plan_setup: schedule {schedule!r} is not disaggregated")
    placement = plan.placement_for(schedule)
    steps = shared_schedule(schedule, L, R, model.moe.aux_loss_coef > 0,
                            answers_layered([plan.roles[r] for r in group.members]))
    members = []
    n = len(group.members)
    # experts per member and layer, counted in arrays (a search sets up hundreds of groups of
    # hundreds of members)
    counts = np.zeros((n, L), dtype=np.intp)
    for l in range(L):
        counts[:, l] = np.bincount(np.asarray(placement[l], dtype=np.intp), minlength=n)[:n]
    held: list[dict[int, list[int]]] = []
    if expert_load:
        for l in range(L):
            per: dict[int, list[int]] = {}
            for e, q in enumerate(placement[l]):
                per.setdefault(q, []).append(e)
            held.append(per)
    split: dict[int, list[int]] = {}
    groups = [g.members for g in plan.zp_groups]  # (each call builds its list)
    for p, (rank, experts) in enumerate(zip(group.members, counts.tolist())):
        role = plan.roles[rank]
        seqs = []
        if role == "attention":
            s = plan.seqs_per_rank[rank]
            seqs = split.get(s) or split.setdefault(s, split_microbatches(s, R))
        # which experts matters only under measured routing: without it, ranks alike in
        # counts are one lane (the planner's search at thousands of ranks depends on it)
        ids = [[held[l].get(p, []) for l in range(L)]] if expert_load else []
        members.append((rank, devs[rank], role, seqs, experts, *ids))
    return StepSetup(
        lanes=make_lanes(members),
        model=model,
        seq_len=plan.seq_len,
        num_microbatches=R,
        link=link,
        schedule=steps,
        replicas=len(plan.zp_groups),
        attention_dp=len(plan.attention_ranks),
        expert_load=expert_load,
        replica_ranks={rank: [m[p] for m in groups] for p, rank in enumerate(group.members)},
        dense_ranks=list(plan.attention_ranks),
        waves=1 if schedule == "forward" else plan.waves,  # an evaluation batch is one wave
    )
