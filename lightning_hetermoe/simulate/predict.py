"""One way into the simulator: one step's prediction under any schedule.

Zebra and DistEP run a plan's first ZP group (:func:`~.schedules.plan_setup`); the EP
schedules lay the batch out as the EP backend does (:func:`~.schedules.ep_setup`,
:func:`~.schedules.simulate_ep_ideal`); data-centric is priced in closed form
(:mod:`.datacentric`). The planner's table, the run clock (what a run predicts of itself,
what ``mode="auto"`` and the rebalancer compare) and the recipes all ask here.
"""

from __future__ import annotations

import copy
from typing import Sequence

from ..cluster.devices import DeviceSpec
from ..cluster.spec import LinkConfig
from ..cluster.topology import Topology
from ..configs import ModelConfig, OptimConfig
from ..placement import Placement
from .datacentric import datacentric_step_time
from .lane_vectors import simulate_step_time
from .schedules import EP_SCHEDULES, SCHEDULES, plan_setup, simulate_ep, simulate_ep_ideal
from .step import StepResult, simulate_step

PREDICTED = SCHEDULES + ("datacentric",)


def predict_step(
    schedule: str,
    devs: Sequence[DeviceSpec],
    model: ModelConfig,
    link: LinkConfig | Topology,
    timer,
    *,
    plan=None,
    seq_len: int = 0,
    total_seqs: int = 0,
    num_microbatches: int | None = None,
    placement: Placement | None = None,
    ep_size: int | None = None,
    expert_load: list[list[float]] | None = None,
    keep_timeline: bool = False,
    replica_dispatch: str = "local_first",
    optimizer: OptimConfig | None = None,
    weight_averages: int = 0,
) -> StepResult:
    """One step of ``schedule`` (one of :data:`PREDICTED`) on ``devs``.

    ``plan``: what zebra and DistEP run, and the batch every schedule is priced on; without
    one, ``seq_len`` and ``total_seqs`` give the batch (a plan carries its own).
    ``num_microbatches``: EP's micro-batches (``None``: the fewest that fit in memory).
    ``placement``: where the experts live instead of the plan's (over its ZP group's
    members) or EP's contiguous split (over ``ep_size`` EP ranks, rank ``r`` holding
    ``r % ep_size``'s; ``None``: every rank in one EP group, else ``world / ep_size``
    groups, each exchanging inside itself, the experts' gradients summed over the groups).
    ``expert_load``: per layer, each expert's share of the routing
    (``None``: even). ``replica_dispatch``: which copy serves a token where EP keeps copies
    (:mod:`lightning_hetermoe.copy_routing`). ``optimizer``: the ``optim`` config the run
    trains with, whose state EP's fewest micro-batches and data-centric's memory check
    price (``None``: unfused AdamW; zebra and DistEP run the plan, priced when it was made),
    with ``weight_averages`` copies of the weights kept on the device beside it.
    Raises ``ValueError`` where the schedule does not fit in memory.
    """
    if plan is not None:  # every wave's sequences: the schedules without waves take the step's batch
        seq_len, total_seqs = plan.seq_len, plan.step_seqs
    if schedule in ("zebra", "distep"):
        if plan is None:
            raise ValueError(f"predict_step: {schedule} runs a plan; none was given")
        if placement is not None:
            plan = copy.copy(plan)  # the caller's plan keeps its placement
            plan.placement = placement.owners()
        setup = plan_setup(plan, devs, model, link, schedule=schedule, expert_load=expert_load)
        return simulate_step(setup, timer, schedule, keep_timeline)
    if schedule in EP_SCHEDULES:
        return simulate_ep(devs, model, seq_len=seq_len, total_seqs=total_seqs, link=link, timer=timer,
                           balanced=schedule == "ep_balanced", keep_timeline=keep_timeline, expert_load=expert_load,
                           num_microbatches=num_microbatches, placement=placement, ep_size=ep_size,
                           replica_dispatch=replica_dispatch, optimizer=optimizer, weight_averages=weight_averages)
    if schedule == "ep_ideal":
        return simulate_ep_ideal(devs, model, seq_len=seq_len, total_seqs=total_seqs, link=link, timer=timer,
                                 optimizer=optimizer, weight_averages=weight_averages)
    if schedule == "datacentric":
        step = datacentric_step_time(devs, model, seq_len=seq_len, total_seqs=total_seqs, link=link, timer=timer,
                                     expert_load=expert_load, optimizer=optimizer,
                                     weight_averages=weight_averages)
        # a closed form: no lanes, no busy time, no exchange rows (network_bytes None: not modelled)
        return StepResult(schedule, step, total_seqs * seq_len, {}, {r: d.name for r, d in enumerate(devs)}, {}, [],
                          1, network_bytes=None)
    raise ValueError(f"unknown schedule {schedule!r}; choose from {PREDICTED}")


def simulate_plan(plan, devs, model, link, timer, *, schedule: str = "zebra", keep_timeline: bool = True,
                  expert_load: list[list[float]] | None = None, optimizer: OptimConfig | None = None,
                  weight_averages: int = 0) -> StepResult:
    """Predict one step of ``plan`` under ``schedule`` (see :func:`predict_step`); EP in
    the groups its row in the plan's table was priced at (``ep_size``; none: one group)."""
    ep_size = (plan.predicted.get(schedule) or {}).get("ep_size") if schedule in EP_SCHEDULES else None
    return predict_step(schedule, devs, model, link, timer, plan=plan, keep_timeline=keep_timeline,
                        expert_load=expert_load, optimizer=optimizer, weight_averages=weight_averages,
                        ep_size=ep_size)


def predict_step_time(schedule: str, devs: Sequence[DeviceSpec], model: ModelConfig, link: LinkConfig | Topology,
                      timer, *, plan, expert_load: list[list[float]] | None = None) -> float:
    """The step time :func:`predict_step` gives ``plan`` under zebra or DistEP, without the
    per-rank breakdown: a planner's search compares hundreds of them."""
    if schedule not in ("zebra", "distep"):
        raise ValueError(f"predict_step_time: {schedule!r} is not disaggregated; use predict_step")
    return simulate_step_time(plan_setup(plan, devs, model, link, schedule=schedule, expert_load=expert_load), timer)
