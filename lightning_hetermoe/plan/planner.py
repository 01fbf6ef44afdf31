"""The planner: roles, ZP groups, micro-batch count and expert placement for a cluster.

Search (steps 1-4 are ``search.py``'s, for one batch), each candidate scored by the step
simulator (zebra schedule):

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

Memory prices the dense optimizer state sharded over the attention ranks where the
strategy shards it. Everything is deterministic, so every rank computes the same plan.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
from dataclasses import replace
from typing import Any, Sequence

from ..configs import ModelConfig, OptimConfig, from_cfg
from ..profile.cost_model import CostModel, optimizer_step_traffic
from ..profile.memory import MemoryModel, small_training_state
from ..profile.profile import Profile
from ..profile.timer import CachedTimer, make_timer
from ..simulate.bound import throughput_bound
from ..simulate.ep_groups import fastest_ep
from ..simulate.predict import predict_step, predict_step_time
from ..simulate.schedules import EP_SCHEDULES, SCHEDULES, ep_speed
from .cluster_view import ClusterView, as_cluster
from .fit import LayoutSearch, member_capacity, optimizer_shares
from .load_placement import place_at_load
from .plan import Plan
from . import progress
from .replica import copy_counts, one_copy, stands_in
from .search import Search, kind_counts, many_splits

MAX_WAVES = 4  # make_plan's default: at most this many batches accumulated per optimizer step
# On few ranks a wave count at most this much slower than the best so far is not the end:
# the next may pay (4 H100 + 6 A40 + 6 V100, W2 at 32K: 2 waves 2.9% slower than 1, 4 waves
# 7% faster). Over the paper's 100 configurations going on past any shortfall found the same
# plans as past 1%; on 16 GPUs it searched counts 4-9% short that never paid, up to 2.6 s more.
WAVES_SLACK = 0.05


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
    the last count's activations bound its plan (each wave adds a pipeline fill and drain),
    on more than ``MAX_SPLITS`` ranks only while they pay. There, where one search takes
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
        if best is not None and many_splits(len(view.devices)) and not _probe_pays(
                best, waves, view, model, seq_len=seq_len, global_batch_tokens=global_batch_tokens, **kwargs):
            break
        progress.stage(f"{'all' if copies else 'a copy of'} {len(view.devices):,} GPUs in {waves} "
                       f"wave{'s' if waves > 1 else ''}")
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
            # one search costs seconds on many ranks; on few, a count that did not pay by a
            # little can come before one that does (WAVES_SLACK)
            if many_splits(len(view.devices)) or waves * 2 > max_waves or \
                    _zebra_rate(plan) < _zebra_rate(best) * (1 - WAVES_SLACK) or \
                    not _activations_bind_as_asked(plan, view, model, kwargs):
                break
            waves *= 2
            continue
        best = plan
        searched.append(plan)
        if waves * 2 > max_waves or not _activations_bind_as_asked(plan, view, model, kwargs):
            break
        waves *= 2
    if copied is not None and (best is None or _zebra_rate(copied) > _zebra_rate(best) * (1 + 1e-9)):
        best = copied
    if many_splits(len(view.devices)) and not pinned:
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
EP_GROUPS = ("fastest", "world")  # how the EP rows price EP's group size


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
    cluster searched at each copy's attention ranks of each kind times k, over every group count and R, at
    that copy's waves: the fastest, or ``None`` where no copy plans."""
    # only zebra's step is compared on the way; the plan kept is predicted in full after.
    # A copy (16 ranks and up) has more than 64 sets of attention ranks where the cluster
    # has three kinds: its search takes the role order's prefixes, as a grid of sets there
    # took a plan of 256-1,024 GPUs past 10 s (OLMoE-1B-7B flat 1.15x faster, the rest as fast)
    zebra = {**kwargs, "schedules": ("zebra",), "_brief": True, "_grid": False}
    splits: dict[int, list[int | tuple[int, ...]]] = {}  # waves -> role splits (see plan_for_batch's _splits)
    for k in ks:
        try:
            one = _fastest_waves(one_copy(view, k), model, seq_len=seq_len,
                                 global_batch_tokens=global_batch_tokens // k, max_waves=max_waves, copies=False,
                                 **zebra)
        except ValueError:
            continue  # the copy is too small to hold the model: larger ones may
        # the copy's attention ranks of each kind times k, and as many first in the role order
        # (where the copy's are not its own role order's first, either can be the faster whole)
        splits.setdefault(one.waves, []).extend([tuple(k * n for n in kind_counts(one.devices, one.attention_ranks)),
                                                 k * len(one.attention_ranks)])
    best = None
    for waves, Ms in splits.items():
        progress.stage(f"all {len(view.devices):,} GPUs at the copies' role splits")
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
                             weight_averages=kwargs.get("weight_averages", 0),
                             ep_groups=kwargs.get("ep_groups", "fastest"))


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
    return _split_in_waves(view, model, [len(view.devices)], 1, seq_len=seq_len,
                           global_batch_tokens=global_batch_tokens, max_waves=max_waves, bar=bar, **kwargs)


def _best_split_in_more_waves(best: Plan, view: ClusterView, model: Any, *, seq_len: int, global_batch_tokens: int,
                              max_waves: int, bar: Plan | None = None, **kwargs: Any) -> Plan | None:
    """The search's best role split over every group count and R in 2, 4, ... times its
    waves, where its activations bind. The wave gate probes only the best layout itself in
    more waves; other group counts of its split may fit only there and win (DeepSeek-V2-Lite
    on 10,000 GPUs on nodes: the search keeps 250 groups of 20+20 in one wave and every rank
    attending in two, while at the one-wave split 125 groups of 40+40 in four waves plan 17%
    faster than both). One split costs a fraction of the search. ``None`` where it does not
    bind or nothing plans."""
    split, W = len(best.attention_ranks), len(view.devices)
    if split == W or not _activations_bind_as_asked(best, view, model, kwargs):
        return None  # every rank attending is its own family; unbound activations gain nothing from waves

    def most_groups(M: int) -> int:
        return math.gcd(M, W - M)

    # and a split one rank either side that deals into more ZP groups: where memory bound the
    # fewer waves to fewer groups, the search's best split there can be one that divides
    # badly (Mixtral on 64 GPUs: 25 attention ranks, one group, in one wave; in two, 24 in two
    # groups is 1.53x faster than every plan the search made)
    near = [M for M in (split - 1, split + 1) if 1 <= M < W and most_groups(M) > most_groups(split)]
    return _split_in_waves(view, model, [split, *near], best.waves * 2, seq_len=seq_len,
                           global_batch_tokens=global_batch_tokens, max_waves=max_waves, bar=bar, **kwargs)


def _split_in_waves(view: ClusterView, model: Any, splits: list[int], first: int, *, seq_len: int,
                    global_batch_tokens: int, max_waves: int, bar: Plan | None = None, **kwargs: Any) -> Plan | None:
    """The fastest plan at any of ``splits`` attention ranks, over every group count and R, in
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
                                  _splits=splits, _bar=best or bar, **brief)
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
    ep_groups: str = "fastest",
    _splits: Sequence[int | tuple[int, ...]] | None = None,
    _brief: bool = False,
    _grid: bool = True,
    _bar: Plan | None = None,
) -> Plan:
    """Plan ``model`` on ``cluster`` for steps of ``global_batch_tokens`` in sequences of ``seq_len``,
    run as ``waves`` batches of an equal number of sequences (gradient accumulation).

    ``profile`` (measured times) replaces the cost model when given; ``timer`` (any task
    timer, e.g. an emulated workload's clock) replaces both. ``num_microbatches``,
    ``num_attention_ranks`` and ``num_zp_groups`` pin a choice instead of searching it
    (a pinned count of attention ranks: the ranks most suited to attention, first in the
    role order; searched, any count of each device kind may attend).
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
    with ``device="cpu"``: none). ``ep_groups``: the EP rows at the fastest group size a run
    can be set to (``"fastest"``, ``simulate/ep_groups.py``; the row's ``ep_size``) or as
    one group over every rank (``"world"``: the papers' EP baseline).

    Where memory binds, every layout the plan format can express is checked (see
    ``fit.py``): a batch that fits in one gets a plan, and a refusal names the binding
    constraint and the largest batch that plans.

    The planner's own calls narrow the search to some role splits (``_splits``, each the
    role order's first ranks, or a tuple of attention ranks of each device kind, kinds
    sorted by name, each over every group count and R: what plans of the cluster's alike
    copies suggest, ``replica.py``) and, where they only compare the plans' own
    steps, ask for those alone (``_brief``: no data-centric prediction, no network bytes);
    ``_bar``, a plan found elsewhere, is the mark group counts are probed against;
    ``_grid`` False: past ``MAX_ATTENTION_SETS`` sets of attention ranks the role order's
    prefixes alone, not a grid of sets (a copy's search inside a large cluster's).
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
    if ep_groups not in EP_GROUPS:
        raise ValueError(f"ep_groups={ep_groups!r} is invalid: choose from {EP_GROUPS}")
    with _cycle_collector_paused():
        return _plan(view, model, seq_len=seq_len, total=total // waves, waves=waves, profile=profile,
                     cost_model=cost_model,
                     asym_ea=asym_ea, num_microbatches=num_microbatches, max_microbatches=max_microbatches,
                     num_attention_ranks=num_attention_ranks, num_zp_groups=num_zp_groups,
                     require_expert_ranks=require_expert_ranks, schedules=schedules, timer=timer,
                     expert_load=expert_load, place_at_load=place_at_load,
                     shard_optimizer_state=shard_optimizer_state, optimizer=optimizer,
                     weight_averages=weight_averages, ep_groups=ep_groups, splits=_splits, brief=_brief, bar=_bar,
                     grid=_grid)


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
          optimizer: OptimConfig | None = None, weight_averages: int = 0, ep_groups: str = "fastest",
          splits: Sequence[int | tuple[int, ...]] | None = None, brief: bool = False,
          bar: Plan | None = None, grid: bool = True) -> Plan:
    """:func:`plan_for_batch` once its arguments are checked."""
    timer = _search_timer(model, seq_len, timer, profile, cost_model, optimizer)
    search = Search(view, model, seq_len, total, timer, asym_ea, max_microbatches, expert_load,
                     sharded=_sharded(model, shard_optimizer_state), waves=waves, optimizer=optimizer,
                     weight_averages=weight_averages)
    if bar is not None and bar.predicted.get("zebra"):
        search.bar = (search.per_batch(bar.predicted["zebra"]["step_time_s"], bar), bar)
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
        # a count and a vector can name the same ranks (a copy's set that is its own prefix):
        # each set once
        named = [order[:s] if isinstance(s, int) else search.attention_of(s, order) for s in splits]
        fit = [a for a in named if len(a) in Ms and all(search.holdable(r) for r in a)]
        sets = list({tuple(sorted(a)): a for a in fit}.values())
        got = search.finals([(search.led_by(a, order), len(a)) for a in sets], Rs, num_zp_groups)
        if got is None:
            raise ValueError(f"no layout of the attention splits {list(splits)} fits {view.name}")
        plan = got[1]
    else:
        # a pinned count pins the split: the role order's first ranks, the ones most suited to attention
        plan = search.best(order, Ms, Rs, num_zp_groups, every_set=num_attention_ranks is None, grid=grid)
    if place_at_load and expert_load is not None:
        _place_at_load(plan, search, expert_load)
    if not brief:
        progress.stage(f"the plan's step under each schedule ({', '.join(schedules)})")
    plan.predicted = predict(plan, view, model, timer, schedules, expert_load, brief=brief, optimizer=optimizer,
                             weight_averages=weight_averages, ep_groups=ep_groups)
    plan.bound_tokens_per_s = throughput_bound(view.devices, timer, model, seq_len, batch_tokens=total * seq_len)
    cost = getattr(timer, "cost", None)
    if cost is not None:
        plan.precision = cost.describe()
    return plan


def _place_at_load(plan: Plan, search: Search, expert_load: list[list[float]]) -> None:
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


def _layout_search(search: Search, **pins: Any) -> LayoutSearch:
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
    search = Search(view, model, seq_len, 1, timer, True, max_microbatches,
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
            optimizer: OptimConfig | None = None, weight_averages: int = 0, ep_groups: str = "fastest") -> dict:
    """Step time and tokens/s of ``plan`` under each schedule and data-centric (``None``
    and the error where one does not fit). ``brief``: each schedule's step time and
    tokens/s alone (zebra and DistEP by the search's own simulation), no data-centric.
    ``optimizer`` and ``weight_averages``: what EP's micro-batches and data-centric's
    memory are priced with, as the plan itself was. ``ep_groups``: EP at its fastest group
    size (the row's ``ep_size``) or as one group over every rank (``"world"``)."""
    view = as_cluster(cluster)
    out: dict[str, dict[str, float]] = {}
    for s in list(schedules) + ([] if brief else ["datacentric"]):
        if brief and s in ("zebra", "distep"):
            step = predict_step_time(s, view.devices, model, view.topology, timer, plan=plan, expert_load=expert_load)
            out[s] = {"step_time_s": step, "tokens_per_s": plan.step_seqs * plan.seq_len / step if step > 0 else 0.0}
            continue
        ep_size = None
        try:
            if s in EP_SCHEDULES and ep_groups == "fastest":  # as a run can be set to
                ep_size, res = fastest_ep(s, view.devices, model, view.topology, timer, seq_len=plan.seq_len,
                                          total_seqs=plan.step_seqs, plan=plan, expert_load=expert_load,
                                          optimizer=optimizer, weight_averages=weight_averages)
            else:
                res = predict_step(s, view.devices, model, view.topology, timer, plan=plan, expert_load=expert_load,
                                   optimizer=optimizer, weight_averages=weight_averages)
        except ValueError as err:
            # None, not NaN: the plan stays valid JSON and compares equal to its round trip
            out[s] = {"step_time_s": None, "tokens_per_s": None, "error": str(err)}
            continue
        out[s] = {"step_time_s": res.step_time, "tokens_per_s": res.tokens_per_s}
        if ep_size is not None:
            out[s]["ep_size"] = ep_size
        if view.topology.num_nodes > 1 and res.network_bytes is not None:
            out[s]["network_gb"] = res.network_bytes / 1e9
    return out
