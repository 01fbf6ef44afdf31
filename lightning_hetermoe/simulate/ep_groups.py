"""EP's group size: the sizes a run can be set to (``expert_parallel_size``) and the one
the simulator prices fastest.

``world / k`` EP groups of ``k`` consecutive ranks each hold every expert and exchange
inside themselves; each expert's gradients are summed over the groups once a step. On
several nodes a group kept inside a node keeps the per-layer all-to-alls off the network
and sends only that sum across it: on two servers of 2 A40 + 2 V100 joined by 25 Gbit/s
Ethernet, D1 at 4K tokens steps 1.37x faster in two groups of 4 than in one of 8; on 64
GPUs of ``bench/plan_scale.py``'s mix in nodes of 8, D1 at 8K, 3.2x faster in groups of 8
than in one of 64. On one node the world-wide group is usually the fastest (each rank
holds fewer experts, and nothing is summed over groups), but not always: D1 with 8 experts
at 4K on four A40s (the paper's yardstick) steps 1.37x faster as plain data parallelism
(groups of 1: every expert on every rank, no all-to-all). So the planner's EP rows and
``mode="auto"`` price every size a run could use and keep the fastest.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..cluster.devices import DeviceSpec
from ..cluster.spec import LinkConfig
from ..cluster.topology import Topology
from ..configs import ModelConfig
from .predict import predict_step
from .schedules import EP_SCHEDULES
from .step import StepResult


def ep_group_sizes(link: LinkConfig | Topology, world: int) -> list[int]:
    """EP group sizes worth pricing on ``world`` ranks, largest first: every divisor of the
    world whose groups of consecutive ranks each sit inside one node or cover whole nodes.
    A group that straddles nodes pays the network as the aligned group above it does while
    each rank holds more experts; leaving it out keeps the sizes few at scale (10,000 ranks
    have 25 divisors)."""
    if world < 1:
        raise ValueError(f"EP needs at least one rank, got world={world}")
    node_of = link.node_of if isinstance(link, Topology) and link.num_nodes > 1 else None
    if node_of is not None and len(node_of) != world:
        raise ValueError(f"the topology places {len(node_of)} ranks, the run has {world}")
    size_of: dict[int, int] = {}
    for n in node_of or ():
        size_of[n] = size_of.get(n, 0) + 1
    sizes = []
    for k in range(world, 0, -1):
        if world % k:
            continue
        if node_of is not None:
            groups = [node_of[g * k:(g + 1) * k] for g in range(world // k)]
            if not all(len(set(grp)) == 1 or all(grp.count(n) == size_of[n] for n in set(grp)) for grp in groups):
                continue
        sizes.append(k)
    return sizes


def fastest_ep(schedule: str, devs: Sequence[DeviceSpec], model: ModelConfig, link: LinkConfig | Topology, timer,
               *, seq_len: int, total_seqs: int, **kwargs: Any) -> tuple[int, StepResult]:
    """``schedule`` (``ep`` or ``ep_balanced``) at the size of :func:`ep_group_sizes` whose
    step is the shortest, and that step (a tie keeps the larger group: fewer experts on
    each rank); ``kwargs`` go to :func:`~.predict.predict_step`. ``ValueError`` where no
    size fits, the world-wide group's."""
    if schedule not in EP_SCHEDULES:
        raise ValueError(f"fastest_ep prices ep and ep_balanced, not {schedule!r}")
    best: tuple[int, StepResult] | None = None
    first_error: ValueError | None = None
    for k in ep_group_sizes(link, len(devs)):
        try:
            res = predict_step(schedule, devs, model, link, timer, seq_len=seq_len, total_seqs=total_seqs,
                               ep_size=k, **kwargs)
        except ValueError as err:
            first_error = first_error or err
            continue
        if best is None or res.step_time < best[1].step_time:
            best = (k, res)
    if best is None:
        raise first_error or ValueError("EP does not fit at any group size")
    return best
