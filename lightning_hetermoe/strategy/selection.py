"""Which backend a run uses, decided once at set-up.

``mode="auto"`` (the default) predicts every schedule that can run here with the run's own
clock (the cost model, a profile, or an emulated workload) and takes the fastest by
predicted throughput: ``zebra`` and ``distep`` on the planner's plan, ``ep``,
``ep_balanced`` (expert parallelism with speed-proportional shares, where the devices
differ) and ``datacentric`` (HEXA-MoE's experts-to-the-tokens). One device trains as a plain single device. The choice and the runner-up are
printed; a plan, when one runs, is printed as a table and written to ``plan.json``.

Routing is never even: before planning, a few sampled global batches go through the freshly
initialised model, each rank forwarding its share of them; the planner searches at their
pooled expert shares, and every prediction is the mean of the step at each batch's own
routing (:mod:`.routing_warmup`).

Rank 0 decides and broadcasts, so every rank builds the same backend from the same plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..cluster import ClusterConfig, DeviceSpec
from ..configs import ConfigError, ModelConfig
from ..model_contract import ModelContractError, describe_model
from ..plan.plan import RUN_AS, TIE_RATIO
from ..routing_record import check_shape
from ..simulate.schedules import EP_SCHEDULES
from .arguments import DISAGGREGATED, check_plan, check_waves, optimizer_of
from .averaging import averages_on
from .backends.base import ParallelBackend, Simulated
from .batch import tensors
from .routing_warmup import split_routing, stage_loader, warmup_routing
from ..materialize import built_on_meta
from ..cluster.devices import check_bf16
from .precision import precision_name

AUTO_CANDIDATES = tuple(RUN_AS)  # every schedule a run can be set to


def loader_batch_shape(trainer) -> tuple[int, int]:
    """``(sequences per rank, sequence length)`` of the stage's loader, read without iterating
    it: its ``batch_size`` and its dataset's first sample (``[seq_len, ...]`` first tensor).
    An ``IterableDataset`` has no first sample to index: the first one a fresh iterator of it
    yields is read (a stream starts again at each ``iter``; the loader's own are untouched)."""
    try:
        loader = stage_loader(trainer)
        dataset = loader.dataset
        first = next(iter(dataset)) if isinstance(dataset, IterableDataset) else dataset[0]
        return int(loader.batch_size), int(tensors(first)[0].shape[0])
    except Exception as err:
        raise ConfigError(
            "the strategy times zebra and plans from the batch shape, read from the loader's batch_size and its "
            f"dataset's first sample ([seq_len, ...]); that failed ({type(err).__name__}: {err}): give the loader a "
            "batch_size and a dataset whose first sample (dataset[0], or the first an IterableDataset yields) is "
            "[seq_len, ...], or train with mode='ep'") from None


def run_devices(cluster: ClusterConfig | None, device: torch.device, world_size: int) -> list[DeviceSpec]:
    """The devices the run plans for: the cluster config's, the CUDA devices of every rank,
    or plain CPUs."""
    from ..cluster.devices import detect_cuda_devices, get_device

    if cluster is not None:
        return cluster.specs()
    if device.type == "cuda":
        return list(detect_cuda_devices())
    return [get_device("cpu")] * world_size


def run_topology(cluster: ClusterConfig | None, device: torch.device) -> Any:
    """What the run's transfers cross: the cluster config's nodes, or on GPUs without one
    the nodes found from every rank's hostname (a collective); ``None``: one node."""
    import socket

    from .. import comm
    from ..cluster.topology import cluster_topology, topology_from_hosts

    if cluster is not None:
        return cluster_topology(cluster)
    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    rows = comm.gather_objects(comm.world(), (socket.gethostname(), p.name, (int(p.major), int(p.minor))),
                               what="strategy.hosts")
    return topology_from_hosts([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def select_backend(strategy: Any, trainer: Any) -> ParallelBackend:
    """Bind the run's clock, choose the schedule, build its backend (every rank)."""
    args, clock = strategy.args, strategy.clock
    module, world, rank = strategy.lightning_module, strategy.world_size, strategy.global_rank
    devices = run_devices(args.cluster, strategy.root_device, world)
    clock.topology = run_topology(args.cluster, strategy.root_device)
    precision = precision_name(strategy.precision_plugin)
    check_bf16(precision, devices, args.allow_emulated_bf16)  # detected devices too
    needs_clock = (args.mode in ("auto", *DISAGGREGATED) and world > 1 or args.emulated or args.batch_split == "speed"
                   or args.expert_parallel_size == "auto")
    model = _Description.of(module)
    try:
        per_rank, seq_len = loader_batch_shape(trainer)
        clock.bind(model.config(), per_rank, seq_len, world, devices, precision, optimizer_of(module),
                   averages_on(trainer.callbacks if trainer is not None else [], strategy.root_device))
    except (ConfigError, ModelContractError) as err:
        if needs_clock:
            raise ConfigError(str(err)) from None
        clock.devices = devices  # plain EP of a model the clock cannot read: no predictions

    # One device trains as a plain single device: nothing to plan, and one device holding
    # every expert costs the same under any routing, so no warm-up batch is run for it.
    single = world == 1 and args.mode == "auto"
    if args.expert_load is not None and clock.bound and not single:
        # an earlier run's measured routing (every rank checks it alike): the planner places
        # at it and every prediction prices it, instead of the warm-up's or even routing
        record = check_shape(args.expert_load, model.config(), "strategy expert_load")
        clock.expert_load, clock.batch_loads = record.mean_share, [record.mean_share]
        if rank == 0:
            source = clock.routing_source = record.source or f"strategy expert_load's {record.steps} steps"
            what = "predicting" if args.plan is not None else "planning"  # a given plan is priced, not made
            print(f"hetermoe: {what} at the routing of {source} (model {record.model!r}; the hottest expert "
                  f"{record.hottest_over_mean():.2f}x the mean)", flush=True)
    elif clock.bound and not built_on_meta(module) and not single:
        # every rank forwards its deal of the warm-up (the strategy made the weights rank 0's);
        # a model on the meta device cannot run yet: it plans with even routing
        clock.expert_load, clock.batch_loads = split_routing(
            warmup_routing(module, trainer, clock.per_rank, clock.per_rank * world, strategy.precision_plugin,
                           rank, world))
        if clock.batch_loads:
            clock.routing_source = "the initial routers' on sampled batches"
    ep_size = None
    if single:
        choice, plan = "single", None
    else:
        choice, plan, ep_size = _decide(args, clock, world, module, model) if rank == 0 else (None, None, None)
        choice, plan, ep_size, clock.expert_load, clock.batch_loads = strategy.broadcast(
            (choice, None if plan is None else plan.to_dict(), ep_size, clock.expert_load, clock.batch_loads), src=0)
        if plan is not None:
            from ..plan import Plan

            plan = Plan.from_dict(plan)
    if plan is not None:  # on every rank, once all have the plan
        check_waves(plan, trainer.accumulate_grad_batches)
    backend = _build(args, clock, choice, plan, module, model, strategy.root_device, rank, world,
                     measure_busy=strategy.measure_busy, ep_size=ep_size)
    clock.prediction = clock.predict(backend.simulated())
    if plan is not None and rank == 0:
        _announce_plan(trainer, plan)
    if rank == 0 and args.mode == "ep" and args.expert_parallel_size is None:
        suggest_ep_size(clock, choice, world)
    return backend


PLAN_PROGRESS_S = 10.0  # a plan running longer says what it is doing this often
HINT_RATIO = 1.1  # a smaller EP group predicted this much faster is worth a line at set-up


def suggest_ep_size(clock: Any, name: str, world: int) -> str | None:
    """``mode="ep"`` left at one group over the world: where the run's clock prices a
    smaller group at least :data:`HINT_RATIO` faster, one line saying which and by how much
    (printed and returned)."""
    if not clock.bound or world < 2:
        return None
    k, times = _fastest_ep(clock, name)
    one, best = times[world], times[k]
    if one < best * HINT_RATIO:
        return None
    line = (f"hetermoe[ep]: {ep_groups_phrase(k, world)} is predicted {one / best:.2f}x faster here than one group "
            f"of {world}: set strategy.expert_parallel_size={k} (or auto)")
    print(line, flush=True)
    return line


def chosen_ep_size(clock: Any, name: str, world: int) -> int:
    """``expert_parallel_size="auto"``: the group size whose step the run's clock prices
    shortest among those that fit (rank 0), in one line beside one world-wide group."""
    k, times = _fastest_ep(clock, name)
    beside = f", predicted {times[world] / times[k]:.2f}x faster than one group of {world}" if k != world else ""
    print(f"hetermoe[{name}]: expert_parallel_size=auto: {k}, {ep_groups_phrase(k, world)}{beside}", flush=True)
    return k


def ep_groups_phrase(k: int, world: int) -> str:
    """What EP in groups of ``k`` ranks out of ``world`` is, in words."""
    if k == 1:
        return "plain data parallelism (every rank holding every expert, no all-to-all)"
    if k == world:
        return f"one EP group of {world} (each rank a 1/{world} slice of the experts)"
    return f"{world // k} EP groups of {k} (each holds every expert and exchanges inside itself)"


def dense_backend(strategy: Any) -> ParallelBackend | None:
    """A model without MoE layers trains as plain DDP in every mode that runs it: expert
    parallelism with no experts (one device under ``auto``: a single device); rank 0 prints
    one line saying so. ``None``: the model holds MoE layers (:func:`select_backend` chooses).
    Every rank decides alike from its own copy of the model: no collective."""
    from ..model_contract import moe_layers

    module, args, world = strategy.lightning_module, strategy.args, strategy.world_size
    if moe_layers(module):
        return None
    name = type(module).__name__
    args.check_dense(name)  # again: a model built in configure_model() is first seen here
    devices = run_devices(args.cluster, strategy.root_device, world)
    check_bf16(precision_name(strategy.precision_plugin), devices, args.allow_emulated_bf16)
    strategy.clock.devices = devices
    choice = "single" if world == 1 and args.mode == "auto" else "ep"
    if strategy.global_rank == 0:
        how = "on one device" if choice == "single" else f"as plain DDP over {world} ranks (ep with no experts)"
        print(f"hetermoe[{args.mode}]: {name} holds no lightning_hetermoe.MoELayer: it trains {how}", flush=True)
    return _build(args, strategy.clock, choice, None, module, _Description.of(module), strategy.root_device,
                  strategy.global_rank, world, measure_busy=strategy.measure_busy)


@dataclass(frozen=True)
class _Description:
    """The model's description (:func:`describe_model`), derived once at set-up; or why it
    cannot be, raised where a step needs it."""

    config_or_none: ModelConfig | None
    error: ModelContractError | None

    @staticmethod
    def of(module: Any) -> "_Description":
        try:
            return _Description(describe_model(module), None)
        except ModelContractError as err:
            return _Description(None, err)

    def config(self) -> ModelConfig:
        if self.error is not None:
            raise self.error
        return self.config_or_none


def _decide(args: Any, clock: Any, world: int, module: Any, model: _Description) -> tuple[str, Any, int | None]:
    """Rank 0: the schedule, its plan if it runs one, and EP's group size where ``auto``
    chose EP (``None``: the strategy's own ``expert_parallel_size``)."""
    if args.mode == "ep":
        name = "ep_balanced" if args.batch_split == "speed" else "ep"
        return name, None, (chosen_ep_size(clock, name, world) if args.expert_parallel_size == "auto" else None)
    if args.mode == "datacentric":
        return "datacentric", None, None
    if args.mode in DISAGGREGATED:
        return args.mode, priced_for_the_run(_plan(args, clock, world, model.config(), required=True,
                                                   schedule=args.mode), clock, world), None
    if args.plan is not None:  # auto with a given plan runs what the plan was made for (given: not planned)
        return args.plan.schedule, priced_for_the_run(_plan(args, clock, world, model.config(), required=True),
                                                      clock, world), None
    disaggregable = _can_disaggregate(world, module, model)
    plan = _plan(args, clock, world, model.config(), required=False, schedule="zebra") if disaggregable else None
    if plan is not None:
        priced_for_the_run(plan, clock, world)  # the table it prints, and every candidate it holds, priced once
    throughput: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name in AUTO_CANDIDATES:
        if name in DISAGGREGATED and plan is None:
            continue
        if name == "ep_balanced" and len({d.name for d in clock.devices}) < 2:
            continue  # identical devices: the speed split is the equal split
        row = plan.predicted.get(name) if plan is not None else None
        if name in EP_SCHEDULES and row is None:  # else the row priced_for_the_run priced, at its size
            try:
                sizes[name], tokens, step = _ep_step(clock, name, plan)
            except ValueError:
                continue
            rate = tokens / step
        else:
            rate = _run_throughput(clock, name, plan, world)
            if name in EP_SCHEDULES:
                sizes[name] = row.get("ep_size") or world
        if rate:  # else it does not fit in memory
            throughput[name] = rate
    if not throughput:
        raise ConfigError("mode='auto': no schedule fits this cluster and model (every prediction failed); set "
                          "strategy.mode explicitly")
    labels = {name: f"{name} (expert_parallel_size={k})" for name, k in sizes.items() if k != world}
    best, line = choice_line(throughput, labels)
    print(line, flush=True)
    if best not in DISAGGREGATED:
        return best, None, sizes.get(best)
    plan.schedule = best
    return best, plan, None


def _fastest_ep(clock: Any, name: str) -> tuple[int, dict[int, float]]:
    """EP ``name``'s group size whose step the run's clock prices shortest (the sizes come
    largest first: a tie keeps the larger group), and every size's step
    (:meth:`~.run_clock.RunClock.ep_step_times`)."""
    times = clock.ep_step_times(name)
    return min(times, key=times.get), times


def _ep_step(clock: Any, name: str, plan: Any) -> tuple[int, float, float]:
    """EP ``name`` in this run at its fastest group size: that size and ``(tokens,
    seconds)`` of one optimizer step, once per wave of a plan that has waves (as
    :func:`_run_step`)."""
    size, times = _fastest_ep(clock, name)
    waves = plan.waves if plan is not None else 1
    return size, waves * clock.tokens_per_step, waves * times[size]


def _run_step(clock: Any, name: str, plan: Any, world: int) -> tuple[float, float]:
    """``(tokens, seconds)`` of one optimizer step of schedule ``name`` in this run as its
    clock predicts it: the mean over the held-out warm-up batches, zebra and DistEP on
    ``plan``, the others on the run's batch, once per wave of a plan that has waves.
    ``ValueError`` where it does not fit in memory."""
    if name in DISAGGREGATED:
        return plan.step_seqs * clock.seq_len, clock.step_time(Simulated(name, plan=plan))
    waves = plan.waves if plan is not None else 1
    return waves * clock.tokens_per_step, waves * clock.step_time(Simulated(name, ep_size=world))


def _run_throughput(clock: Any, name: str, plan: Any, world: int) -> float | None:
    """Tokens/s of schedule ``name`` in this run (``None`` where it does not fit): the
    plan's row where it has one (:func:`priced_for_the_run` priced it), else
    :func:`_run_step`'s."""
    row = plan.predicted.get(name) if plan is not None else None
    if row is not None:
        return row.get("tokens_per_s")
    try:
        tokens, step = _run_step(clock, name, plan, world)
    except ValueError:
        return None
    return tokens / step


def priced_for_the_run(plan: Any, clock: Any, world: int) -> Any:
    """``plan`` with its table at this run's own predictions, what ``mode="auto"`` compares
    and summary.json reports (:func:`_run_step`; as it was where the clock is not bound).
    The planner's table prices the batches it placed the experts at, which a placement
    fitted to them balances better than the run's (the tiny model on an A40 and a V100:
    zebra at 1,021,192 tokens/s there, at 1,018,006 over the held-out batches, both
    printed by one run)."""
    if not clock.bound:
        return plan
    for name, row in plan.predicted.items():
        ep_size = None
        try:
            if name in EP_SCHEDULES:  # at its fastest group size at the run's routing
                ep_size, tokens, step = _ep_step(clock, name, plan)
            else:
                tokens, step = _run_step(clock, name, plan, world)
        except ValueError:
            row.update(tokens_per_s=None, step_time_s=None)  # the table says it does not fit
            continue
        row.update(tokens_per_s=tokens / step, step_time_s=step)
        if ep_size is not None:
            row["ep_size"] = ep_size
    return plan


def choice_line(throughput: dict[str, float], labels: dict[str, str] | None = None) -> tuple[str, str]:
    """The fastest of the predicted ``throughput`` (tokens/s by schedule; the first in its
    order among equals) and the line that announces it beside the runner-up (each named by
    its ``labels`` entry where it has one)."""
    ranked = sorted(throughput, key=throughput.get, reverse=True)  # stable: ties keep their order
    best = ranked[0]
    name = (labels or {}).get
    line = f"hetermoe[auto]: chose {name(best, best)} ({_rate(throughput[best])} predicted)"
    if len(ranked) > 1:
        second = ranked[1]
        ratio = throughput[best] / throughput[second]
        # a tie (a layout on which both run the same steps) is not "1.00x slower"
        line += f"; runner-up {name(second, second)} ({_rate(throughput[second])}, " + (
            f"{ratio:.2f}x slower)" if ratio >= TIE_RATIO else f"within {TIE_RATIO - 1:.1%})")
    return best, line


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f} tokens/s"


def _can_disaggregate(world: int, module: Any, model: _Description) -> bool:
    """Zebra and distep can run this model here (auto weighs them only then)."""
    if world < 2 or not getattr(module, "automatic_optimization", False):
        return False
    return model.error is None


def _plan(args: Any, clock: Any, world: int, model_cfg: ModelConfig, required: bool, schedule: str = "zebra") -> Any:
    """The plan the run gives, or a new one from the planner for ``schedule`` (``None`` if
    none fits and none is ``required``), its memory priced for the optimizer and the weight
    averages the clock was bound with."""
    from ..plan import ClusterView, make_plan
    from ..plan.progress import watched

    if args.plan is not None:
        check_plan(args.plan, model_cfg, world)
        if clock.per_rank * world != args.plan.total_seqs:
            raise ConfigError(f"the plan is for {args.plan.total_seqs} sequences per step, the loaders give "
                              f"{clock.per_rank} x {world} ranks = {clock.per_rank * world}")
        return copy.deepcopy(args.plan)  # the run prices its table: the caller's plan stays as given
    cluster = args.cluster if args.cluster is not None else ClusterView("detected", clock.devices, clock.links())
    try:
        with watched(every_s=PLAN_PROGRESS_S):  # rank 0 plans while the others wait: a long plan says so
            plan = make_plan(cluster, clock.model, seq_len=clock.seq_len, global_batch_tokens=clock.tokens_per_step,
                             profile=args.profile, asym_ea=args.asym_ea, num_microbatches=args.num_microbatches,
                             require_expert_ranks=args.require_expert_ranks, timer=clock.timer,
                             expert_load=clock.expert_load, place_at_load=_place_at_load(args),
                             shard_optimizer_state=_zero_priced(args), optimizer=clock.optimizer,
                             weight_averages=clock.weight_averages,
                             max_waves=1)  # the loaders' batch is one wave: accumulate_grad_batches is the user's
    except ValueError as err:
        if required:
            raise ConfigError(f"mode={args.mode!r}: no plan fits: {err}") from None
        return None
    check_plan(plan, model_cfg, world)
    plan.schedule = schedule
    return plan


def _place_at_load(args: Any) -> bool:
    """Whether the planner chooses the experts' ids at the routing it plans at: asked, or
    by default where that routing is a record (``expert_load``: a trained model's, which
    lasts); a freshly initialised router's warm-up routing drifts within a few steps."""
    return args.place_at_load if args.place_at_load is not None else args.expert_load is not None


def _zero_priced(args: Any) -> bool | None:
    """Whether the plan prices the dense optimizer state sharded over the attention ranks:
    as the strategy will run it (ZeRO-1 needs sharded checkpoints); ``None``: ``auto``
    checkpoints, which the planner decides by the same size rule."""
    if not args.shard_optimizer_state or args.checkpoint_format == "full":
        return False
    return True if args.checkpoint_format == "sharded" else None


def _build(args: Any, clock: Any, choice: str, plan: Any, module: Any, model: _Description, device: torch.device,
           rank: int, world: int, *, measure_busy: bool, ep_size: int | None = None) -> ParallelBackend:
    if choice == "single":
        from .backends.single import SingleDeviceBackend

        return SingleDeviceBackend(clock, device, measure_busy=measure_busy)
    if choice in EP_SCHEDULES:
        from .backends.ep import ExpertParallelBackend

        return ExpertParallelBackend(ep_size or args.fixed_ep_size, choice == "ep_balanced", clock, rank,
                                     world, device, measure_busy=measure_busy, replica_dispatch=args.replica_dispatch)
    if choice == "datacentric":
        from .backends.datacentric import DataCentricBackend

        return DataCentricBackend(clock, rank, world, device)
    from .backends.zebra import ZebraBackend

    if not module.automatic_optimization:
        raise ConfigError(f"mode={choice!r} runs the backward itself: it needs automatic optimization")
    balance = model.config().moe.aux_loss_coef > 0
    return ZebraBackend(plan, choice, rank, balance=balance, device=device, clock=clock)


def _announce_plan(trainer: Any, plan: Any) -> None:
    print(str(plan), flush=True)
    root = Path(trainer.default_root_dir)
    root.mkdir(parents=True, exist_ok=True)
    plan.to_json(str(root / "plan.json"))
