"""``HeterMoEStrategy``: the Lightning side of every mode.

* ``ep``: DDP for the dense part, expert parallelism for the experts (all-to-all over an
  expert-parallel group). ``batch_split="speed"`` gives each rank a share of the global
  batch proportional to its device's speed (``ep_balanced`` in the simulator).
* ``zebra`` and ``distep``: the plan's disaggregated roles, run by the zebra runtime
  (:mod:`.zebra`).

Whatever the mode, training equals single-process training on the global batch, and
checkpoints hold full expert tensors (placement-independent).
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ..cluster import ClusterConfig
from ..config import ConfigError, from_cfg
from ..contract import ModelContractError, describe_model, moe_layers
from ..plan.rebalance import moved_copies
from .batch import batch_size, gather_global_batch, split_sizes, take
from .expert_parallel import (
    ExpertParallelGroups,
    expert_grad_sq_norm,
    expert_param_names,
    gather_experts,
    reduce_expert_grads,
    shard_experts,
    unshard_experts,
)
from .launchers import CheckedSpawnLauncher, HydraAwareScriptLauncher, watch_launcher

log = logging.getLogger(__name__)

MODES = ("ep", "zebra", "distep")
BATCH_SPLITS = ("equal", "speed")


def validate_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"strategy mode={mode!r} is invalid: must be one of {MODES}")
    return mode


def load_plan(plan: Any):
    """A Plan from a Plan, its dict, or the path of a ``plan.json``; ``None`` stays ``None``."""
    from ..plan import Plan

    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, Path)):
        path = Path(plan)
        if not path.is_file():
            raise ConfigError(f"strategy plan={str(plan)!r} is invalid: expected a Plan, its dict, or the path of a "
                              f"plan.json (written by recipes/plan.py or a zebra run); no such file")
        try:
            return Plan.from_json(str(path))
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"strategy plan={str(plan)!r} is not a valid plan.json: {err}") from None
    raise ConfigError(f"strategy plan={plan!r} is invalid: expected a Plan, its dict, or the path of a plan.json")


def load_profile(profile: Any):
    from ..profile import Profile

    if profile is None or isinstance(profile, Profile):
        return profile
    path = Path(str(profile))
    if not path.is_file():
        raise ConfigError(f"strategy profile={str(profile)!r} is invalid: expected a Profile or the path of a "
                          f"profile JSON (written by recipes/profile_devices.py); no such file")
    return Profile.from_json(str(path))


class HeterMoEStrategy(DDPStrategy):
    strategy_name = "hetermoe"

    def __init__(
        self,
        mode: str = "ep",
        plan: Any = None,
        cluster: ClusterConfig | dict | None = None,
        expert_parallel_size: int | None = None,
        batch_split: str = "equal",
        num_microbatches: int | None = None,
        asym_ea: bool = True,
        require_expert_ranks: bool = True,
        profile: Any = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self.mode = validate_mode(mode)
        self.plan = load_plan(plan)
        if self.plan is not None and self.mode == "ep":
            raise ConfigError("strategy plan is used by mode='zebra' and 'distep'; mode='ep' places experts evenly "
                              "and takes no plan")
        self.cluster = None if cluster is None else from_cfg(ClusterConfig, cluster, "cluster")
        if expert_parallel_size is not None and (not isinstance(expert_parallel_size, int) or expert_parallel_size < 1):
            raise ConfigError(f"strategy expert_parallel_size={expert_parallel_size!r} is invalid: must be an "
                              f"integer >= 1")
        if expert_parallel_size is not None and self.mode != "ep":
            raise ConfigError("strategy expert_parallel_size is for mode='ep'; zebra and distep take ZP groups "
                              "from the plan")
        if batch_split not in BATCH_SPLITS:
            raise ConfigError(f"strategy batch_split={batch_split!r} is invalid: must be one of {BATCH_SPLITS}")
        if batch_split == "speed" and self.mode != "ep":
            raise ConfigError("strategy batch_split='speed' is for mode='ep'; zebra and distep split the batch "
                              "as their plan says")
        if num_microbatches is not None and (not isinstance(num_microbatches, int) or num_microbatches < 1):
            raise ConfigError(f"strategy num_microbatches={num_microbatches!r} is invalid: must be an integer >= 1 "
                              f"(or null: the planner chooses)")
        if num_microbatches is not None and self.mode == "ep":
            raise ConfigError("strategy num_microbatches is for mode='zebra' and 'distep'")
        self.expert_parallel_size = expert_parallel_size
        self.batch_split = batch_split
        self.num_microbatches = num_microbatches
        self.asym_ea = bool(asym_ea)
        self.require_expert_ranks = bool(require_expert_ranks)
        self.profile = load_profile(profile)
        self.ep_groups: ExpertParallelGroups | None = None
        self._sharded = False
        self._emulation = None
        self._shares: list[int] | None = None
        self._runtime = None  # zebra / distep
        self._workload = None
        self._timer = None
        self._last_step_s: float | None = None  # wall time of the last optimizer step
        self._step_started: float | None = None
        self._busy_mark: dict[str, float] | None = None
        self._last_busy: dict[str, float] | None = None  # the last step's busy time by kind
        # Set by ExpertLoadMonitor: time each task of an EP rank on its real device.
        self.measure_busy = False
        self._meter = None
        self.emulator = None  # this rank's emulated clock, when the cluster is emulated
        self._step_grads: list = []
        self.prediction: dict[str, Any] | None = None

    # -- launch -------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        # The connector calls this once the device count is known and before any process
        # starts: the right moment to reject a world that cannot work.
        self._validate_world(self.num_processes * self.num_nodes)
        if self._start_method == "popen":
            self._launcher = HydraAwareScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                                      pre_launch=self.check_model, describe_rank=self.describe_rank)
        else:
            self._launcher = CheckedSpawnLauncher(self, start_method=self._start_method, pre_launch=self.check_model)

    def _validate_world(self, world_size: int) -> None:
        if self.cluster is not None and self.cluster.world_size != world_size:
            raise ConfigError(
                f"cluster '{self.cluster.name}' names {self.cluster.world_size} devices but the trainer runs "
                f"{world_size} processes: set trainer devices*num_nodes={self.cluster.world_size}"
            )
        ep = self.expert_parallel_size or world_size
        if world_size % ep:
            raise ConfigError(f"strategy expert_parallel_size={ep} is invalid: must divide the world size {world_size}")
        if self.batch_split == "speed" and self.cluster is None:
            raise ConfigError("strategy batch_split='speed' needs a cluster config naming each rank's device")
        if self.mode != "ep" and world_size < 2:
            raise ConfigError(f"strategy mode={self.mode!r} needs at least 2 ranks (attention and experts), the "
                              f"trainer runs {world_size}")
        if self.plan is not None and self.plan.world_size != world_size:
            raise ConfigError(f"the plan is for {self.plan.world_size} ranks, the trainer runs {world_size}")
        if self.plan is not None and self.cluster is not None and list(self.plan.devices) != \
                [d.name for d in self.cluster.specs()]:
            raise ConfigError(f"the plan is for devices {self.plan.devices}, cluster '{self.cluster.name}' names "
                              f"{self.cluster.devices}")

    def check_model(self, model: Any) -> None:
        """Everything about the model that can be checked before processes start."""
        try:
            layers = moe_layers(model)
            if not layers:
                if self.mode != "ep":
                    describe_model(model)  # raises the contract's sentence
                rank_zero_warn(f"HeterMoEStrategy found no lightning_hetermoe.MoELayer in {type(model).__name__}: "
                               f"it trains as plain DDP. The strategy places and routes the experts of MoELayer "
                               f"modules (each the direct child of a decoder block).")
                return
            if (self.cluster is not None and (self.cluster.emulate or self.batch_split == "speed")) \
                    or self.mode != "ep":
                describe_model(model)
        except ModelContractError as err:
            raise ConfigError(str(err)) from None
        from ..kernels import triton_available, unavailable_reason

        device = self.root_device if self.parallel_devices else torch.device("cpu")
        for name, layer in layers:
            if layer.experts.backend == "triton" and not triton_available(device):
                raise ConfigError(f"model.moe.expert_backend='triton' is invalid on {device}: "
                                  f"{unavailable_reason(device)}; use expert_backend=auto or torch ({name})")

    def describe_rank(self, rank: int) -> str:
        plan = self._runtime.plan if self._runtime is not None else self.plan
        if plan is not None:
            return f"{plan.roles[rank]} rank, device {plan.devices[rank]}"
        device = self.cluster.devices[rank] if self.cluster is not None else "?"
        return f"{self.mode} rank, device {device}"

    def setup_environment(self) -> None:
        watch_launcher()
        self._validate_world(self.world_size)
        super().setup_environment()
        if self.mode == "ep" and self.ep_groups is None:
            self.ep_groups = ExpertParallelGroups.build(self.expert_parallel_size or self.world_size)

    # -- model set-up -------------------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        assert self.ep_groups is not None
        placements = shard_experts(model, self.ep_groups)
        self._sharded = True
        self._report_placement(placements)
        if self.cluster is not None and self.cluster.emulate:
            from ..emulate import apply_emulation

            self._emulation = apply_emulation(model, self.cluster, self.global_rank, workload=self._workload)
            self.emulator = self._emulation.emulator
        elif self.measure_busy:
            from ..emulate import BusyMeter, install

            self._meter = BusyMeter(self.root_device)
            self._emulation = install(model, self._meter, head=True)
        ignore = expert_param_names(model) + [
            f"{n}.experts.expert_ids" if n else "experts.expert_ids" for n, _ in moe_layers(model)
        ]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
        return super()._setup_model(model)

    def _report_placement(self, placements: dict[str, list[list[int]]]) -> None:
        if self.global_rank != 0 or not placements:
            return
        first = next(iter(placements.values()))
        sizes = [len(p) for p in first]
        uneven = " (uneven split)" if len(set(sizes)) > 1 else ""
        # rank_zero_info reaches plain scripts too (Lightning's logger prints INFO), not only Hydra runs
        rank_zero_info(f"hetermoe[{self.mode}]: {len(placements)} MoE layers, experts per EP rank {sizes}{uneven}, "
                       f"{self.world_size // self.ep_groups.ep_size} replica(s)")

    def setup(self, trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.mode != "ep":
            # Fitting: the layout first, so the optimizer is built over this rank's parameters
            # only. Otherwise Lightning re-syncs the whole module first (DDP does it without
            # its wrapper), which needs every rank to still hold every tensor.
            self._zebra_setup(trainer, apply=fitting)
        elif self.cluster is not None and self.prediction is None:
            try:
                self._timing(trainer)
            except ConfigError:
                if self.cluster.emulate or self.batch_split == "speed":
                    raise  # both need the batch shape; plain EP does not
            else:
                self.prediction = self._predict()
        super().setup(trainer)
        if self.mode != "ep" and not fitting:
            self._runtime.apply(self.lightning_module)
        if fitting:
            # Dense and expert gradients live in different groups: the global norm needs both.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if self.batch_split == "speed":
            self._shares = None  # computed from the first global batch

    def configure_ddp(self) -> None:
        if self.mode == "ep":
            super().configure_ddp()
        # zebra/distep: no DDP wrapper; the runtime sums gradients in the right groups itself

    # -- zebra / distep -----------------------------------------------------------------
    def _zebra_setup(self, trainer, apply: bool = True) -> None:
        from lightning.pytorch.plugins.precision import MixedPrecision

        module = self.lightning_module
        if not module.automatic_optimization:
            raise ConfigError(f"mode={self.mode!r} runs the backward itself: it needs automatic optimization")
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ConfigError(f"mode={self.mode!r} supports precision 32-true and bf16-mixed; 16-mixed scales the "
                              f"loss, which the executor's own backward does not")
        if self._runtime is None:
            from .zebra.runtime import ZebraRuntime

            self._timing(trainer)
            model_cfg = describe_model(module)
            if self.plan is not None:
                plan = self.plan
                check_plan(plan, model_cfg, self.world_size)
                if self._per_rank * self.world_size != plan.total_seqs:
                    raise ConfigError(f"the plan is for {plan.total_seqs} sequences per step, the loaders give "
                                      f"{self._per_rank} x {self.world_size} ranks = {self._per_rank * self.world_size}")
            else:
                plan = self._make_plan(trainer, model_cfg)
                check_plan(plan, model_cfg, self.world_size)
            self.emulator = self._make_emulator()
            self._runtime = ZebraRuntime(plan, self.mode, self.global_rank,
                                         balance=model_cfg.moe.aux_loss_coef > 0, device=self.root_device,
                                         clock=self.emulator,
                                         timeout_s=self._timeout.total_seconds() if self._timeout else 1800.0)
            self._announce_plan(trainer, plan)
            self.prediction = self._predict()
        if apply:
            self._runtime.apply(module)

    def _timing(self, trainer) -> None:
        """The clock this run is planned, emulated and predicted with: an emulated cluster's
        workload clock, a measured profile, or the cost model of the model run."""
        from ..emulate import emulated_workload
        from ..profile.timer import make_timer

        run = describe_model(self.lightning_module)
        self._per_rank, self._seq_len = loader_batch_shape(trainer)
        if self.cluster is not None and self.cluster.emulate:
            self._workload = emulated_workload(self.cluster, run, self._seq_len)
            self._clock_model, self._clock_seq = self._workload.model, self._workload.seq_len
            self._timer = self._workload.timer
        else:
            self._workload = None
            self._clock_model, self._clock_seq = run, self._seq_len
            self._timer = make_timer(run, self._seq_len, self.profile)

    def _make_emulator(self):
        if self._workload is None:
            return None
        from ..emulate import rank_emulator

        return rank_emulator(self.cluster, self.global_rank, self._workload)

    def _make_plan(self, trainer, model_cfg):
        from ..cluster import ClusterConfig as _CC
        from ..cluster.devices import detect_cuda_devices
        from ..plan import make_plan

        if self.cluster is not None:
            cluster = self.cluster
        elif self.root_device.type == "cuda":
            cluster = [d for d in detect_cuda_devices()]
        else:
            cluster = _CC(name=f"cpu{self.world_size}", devices=["cpu"] * self.world_size)
        try:
            return make_plan(cluster, self._clock_model, seq_len=self._clock_seq,
                             global_batch_tokens=self._per_rank * self.world_size * self._clock_seq,
                             profile=self.profile, asym_ea=self.asym_ea, num_microbatches=self.num_microbatches,
                             require_expert_ranks=self.require_expert_ranks, timer=self._timer)
        except ValueError as err:
            raise ConfigError(f"mode={self.mode!r}: no plan fits: {err}") from None

    def _predict(self, expert_load: list[list[float]] | None = None) -> dict[str, Any] | None:
        """The simulator's step time for this very run (its plan, its clock), scaled like the
        emulated clock; ``None`` without a cluster config (no device names to simulate).
        ``expert_load`` (per layer, each expert's share) replaces even routing."""
        if self.cluster is None:
            return None
        scale = self.cluster.time_scale if self.cluster.emulate else 1.0
        step = self._simulate(expert_load)
        return {"schedule": "ep_balanced" if self.batch_split == "speed" else self.mode,
                "step_time_s": step * scale, "device_step_time_s": step,
                "workload_tokens_per_step": self._per_rank * self.world_size * self._clock_seq}

    def _simulate(self, expert_load: list[list[float]] | None = None,
                  placement: list[list[list[int]]] | None = None) -> float:
        """The simulator's device step time of this run (its plan or EP layout, its clock),
        with ``placement`` (``[layer][holder]`` -> ids) instead of the current one if given."""
        from ..simulate import ep_setup, simulate_plan, simulate_step

        devs, link = self.cluster.specs(), self.cluster.link
        if self._runtime is not None:
            plan = self._runtime.plan
            if placement is not None:
                plan = copy.deepcopy(plan)
                for l, per_member in enumerate(placement):
                    for m, held in enumerate(per_member):
                        for e in held:
                            plan.placement[l][e] = m
            return simulate_plan(plan, devs, self._clock_model, link, self._timer, schedule=self.mode,
                                 keep_timeline=False, expert_load=expert_load).step_time
        setup = ep_setup(devs, self._clock_model, seq_len=self._clock_seq, total_seqs=self._per_rank * self.world_size,
                         link=link, timer=self._timer, balanced=self.batch_split == "speed", num_microbatches=1,
                         expert_load=expert_load)
        if placement is not None:
            for lane in setup.lanes:
                ids = [placement[l][lane.ranks[0] % self.ep_groups.ep_size] for l in range(len(placement))]
                lane.expert_ids, lane.experts = ids, [len(x) for x in ids]
        return simulate_step(setup, self._timer, "ep", keep_timeline=False).step_time

    # -- placement while training runs (rebalancing) ---------------------------------------
    def holders(self) -> list[str]:
        """Who can hold experts, in the order placements list them: EP-group ranks (ep) or
        the ZP group's members (zebra/distep), as ``device`` names."""
        if self._runtime is not None:
            lay = self._runtime.layout
            return [lay.plan.devices[r] for r in lay.members]
        if self.cluster is None:
            return ["cpu"] * self.ep_groups.ep_size
        return [self.cluster.devices[r] for r in range(self.ep_groups.ep_size)]

    def current_placement(self) -> list[list[list[int]]]:
        """``[layer][holder]`` -> expert ids held (copies repeat an id across holders)."""
        if self._runtime is not None:
            lay = self._runtime.layout
            return [[lay.experts_of(r, l) for r in lay.members] for l in range(lay.num_layers)]
        return [[list(p) for p in layer.dispatcher.placement] for _, layer in moe_layers(self.lightning_module)]

    def apply_placement(self, new: list[list[list[int]]]) -> int:
        """Move experts to ``new`` (``[layer][holder]`` -> ids), at a step boundary, on every
        rank (a collective; every rank passes the same decision). Weights and every
        per-parameter optimizer tensor (Adam moments, momentum buffers) travel with their
        expert; copies start from the same values. Returns the copies that moved."""
        module = self.lightning_module
        current = self.current_placement()
        layers = moe_layers(module)
        moved = 0
        for l, (_, layer) in enumerate(layers):
            if new[l] == current[l]:
                continue
            mine = new[l][self._holder_index()]
            moved += moved_copies(new[l], current[l])
            idx = torch.tensor(mine, dtype=torch.long)
            for p in layer.experts.parameters(recurse=False):
                full = self._gather_layer(l, layer, p.data)  # gathered with the placement still in force
                states = []
                for opt in self.optimizers:
                    st = opt.state.get(p)
                    for key, value in (st or {}).items():
                        if torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape:
                            states.append((st, key, self._gather_layer(l, layer, value)))
                p.data = full[idx.to(full.device)].clone()
                p.grad = None
                for st, key, value in states:
                    st[key] = value[idx.to(value.device)].clone()
            layer.experts.expert_ids = idx.to(layer.experts.expert_ids.device)
            if self._runtime is not None:
                self._runtime.set_layer_placement(l, new[l])
            else:  # in place: a new dispatcher would drop the emulated clock's exchange wrapper
                layer.dispatcher.set_placement(new[l])
        if self._runtime is not None:
            self._runtime.placement_changed()
        return moved

    def placement_is_live(self) -> bool:
        """Experts are spread over ranks right now (between set-up and teardown)."""
        return bool(self._spread_layers())

    def predict_placement(self, placement: list[list[list[int]]], expert_load: list[list[float]]) -> float:
        """The simulator's device step time of this run with ``placement`` and the measured
        ``expert_load`` (what the rebalancer compares candidates by)."""
        return self._simulate(expert_load, placement)

    def _holder_index(self) -> int:
        if self._runtime is not None:
            return self._runtime.layout.members.index(self.global_rank)
        return self.ep_groups.ep_rank

    def predict_at_load(self, expert_load: list[list[float]]) -> float | None:
        """The predicted step time (scaled like ``prediction``) with measured routing."""
        pred = self._predict(expert_load) if self.cluster is not None and self._timer is not None else None
        return None if pred is None else pred["step_time_s"]

    def rank_busy(self) -> dict[str, float] | None:
        """This rank's time in the last training step by kind: ``attention`` and ``experts``
        (compute), ``comm`` (transfers; under zebra they overlap compute), ``idle``. From
        the zebra executor's trace, the emulated clock, or (EP on real devices, when a
        monitor asked for it) a :class:`~lightning_hetermoe.emulate.BusyMeter`; else ``None``."""
        step = self._last_step_s
        if step is None:
            return None
        if self._runtime is not None and self._runtime.last is not None:
            out = self._runtime.last
            by = {"attention": 0.0, "experts": 0.0}
            for task, start, end in out.trace:
                by["experts" if task.kind.startswith("expert") else "attention"] += end - start
            comm = sum(getattr(out, "transfer_s", {}).values())
            return {**by, "comm": comm, "idle": max(step - by["attention"] - by["experts"], 0.0)}
        if self._last_busy is None:
            return None
        busy = dict(self._last_busy)
        busy["idle"] = max(step - busy["attention"] - busy["experts"] - busy["comm"], 0.0)
        return busy

    def _busy_step_start(self) -> None:
        if self.emulator is not None:
            self._busy_mark = {k: v.modelled_s for k, v in self.emulator.stats.items()}
        elif self._meter is not None:
            self._meter.reset()  # validation since the last step is not this step's work

    def _busy_step_end(self) -> None:
        """Busy time of the step that just ended (after its tail), by kind."""
        if self.emulator is not None and self._busy_mark is not None:
            now = {k: v.modelled_s for k, v in self.emulator.stats.items()}
            d = {k: now[k] - self._busy_mark.get(k, 0.0) for k in now}
            self._last_busy = {"attention": d["attention"] + d["head"] + d["tail"], "experts": d["experts"],
                               "comm": d["transfer"]}
        elif self._meter is not None:
            d = self._meter.take()
            self._last_busy = {"attention": d["attention"] + d["head"], "experts": d["experts"],
                               "comm": d["transfer"]}

    def emulation_report(self) -> dict[str, Any] | None:
        """Every rank's clock summary, gathered (a collective: call it on every rank)."""
        mine = self.emulator.summary() if self.emulator is not None else None
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [mine]} if mine else None
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        if all(e is None for e in everyone):
            return None
        tasks = sum(e["padded_tasks"] for e in everyone if e)
        overruns = sum(e["overruns"] for e in everyone if e)
        return {"ranks": everyone, "padded_tasks": tasks, "overruns": overruns,
                "overrun_fraction": overruns / tasks if tasks else 0.0}

    def _pad_tail(self, started: float) -> None:
        """Emulation: the step's tail (gradient sync + optimizer) takes the modelled time."""
        if self.emulator is None:
            return
        if self._runtime is not None:
            lay = self._runtime.layout
            held = sum(len(lay.mine(l)) for l in range(lay.num_layers))
            modelled = self.emulator.tail(experts_held=held, has_attention=lay.is_attention,
                                          replicas=len(lay.plan.zp_groups), attention_dp=len(lay.plan.attention_ranks))
        else:
            held = sum(layer.experts.num_local_experts for _, layer in moe_layers(self.lightning_module))
            modelled = self.emulator.tail(experts_held=held, has_attention=True,
                                          replicas=self.world_size // self.ep_groups.ep_size,
                                          attention_dp=self.world_size)
        self.emulator.pad("tail", "tail", started, modelled)

    def _announce_plan(self, trainer, plan) -> None:
        if self.global_rank != 0:
            return
        print(str(plan), flush=True)
        root = Path(trainer.default_root_dir)
        root.mkdir(parents=True, exist_ok=True)
        plan.to_json(str(root / "plan.json"))

    def _zebra_step(self, hook: str, context, args: tuple, kwargs: dict, train: bool) -> Any:
        from .zebra.logs import MicrobatchLogs

        module = self.lightning_module
        batch = args[0] if args else kwargs.pop("batch")
        rest, kw = tuple(args[1:]), dict(kwargs)
        full = gather_global_batch(batch)
        total = batch_size(full)
        fn = getattr(module, hook)
        accumulate = module.trainer.accumulate_grad_batches if train else 1
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def fiber_context():
            from contextlib import ExitStack

            stack = ExitStack()
            stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
            stack.enter_context(context())
            return stack

        # Lightning zeroes gradients between the step and ``backward()``, but the executor's
        # backward runs inside the step: collect this step's gradients apart and hand them
        # over in ``backward()`` (whatever accumulated before stays where it was).
        params = [p for p in module.parameters() if p.requires_grad] if train else []
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        with MicrobatchLogs(module) as logs:
            step = self._runtime.step_input(full, total, lambda mb, j: fn(mb, *rest, **kw), fiber_context, train,
                                            accumulate)
            out = self._runtime.run_step(step, task_context=context)
            logs.replay(step.sizes)
        if train:
            self._step_grads = [(p, p.grad) for p in params if p.grad is not None]
            for p, g in zip(params, before):
                p.grad = g
        return self._zebra_result(out, step, total, train)

    def _zebra_result(self, out, step, total: int, train: bool) -> Any:
        """The step's value on every rank: the global mean loss (training), this rank's
        outputs in micro-batch order (evaluation; ``None`` on expert ranks)."""
        if not train:
            outs = [out.results[j] for j in sorted(out.results)]
            if not outs:
                return None
            if all(isinstance(o, torch.Tensor) for o in outs) and all(o.dim() > 0 for o in outs):
                return torch.cat(outs)
            return outs[0] if len(outs) == 1 else outs
        from .zebra.executor import _loss_of

        loss = torch.zeros((), dtype=torch.float64)
        for j, result in out.results.items():
            loss = loss + _loss_of(result, j).detach().double().cpu() * (step.sizes[j] / total)
        dist.all_reduce(loss)
        return loss.float().to(self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._step_started is None:
            self._step_started = time.perf_counter()
            self._busy_step_start()
        if self._runtime is not None:
            return self._zebra_step("training_step", self.precision_plugin.train_step_context, args, kwargs, True)
        if self.batch_split == "speed" and args:
            args = (self._speed_share(args[0]),) + tuple(args[1:])
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None:
            return self._zebra_step("validation_step", self.precision_plugin.val_step_context, args, kwargs, False)
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None:
            return self._zebra_step("test_step", self.precision_plugin.test_step_context, args, kwargs, False)
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None:
            return self._zebra_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs, False)
        return super().predict_step(*args, **kwargs)

    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Logged metrics live on attention ranks only: reduce them there.
        if self._runtime is not None and group is None:
            group = self._runtime.groups.dense
            if group is None:  # an expert rank has nothing logged to reduce
                return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag)
        return bool(flag == self.world_size) if all else bool(flag)

    # -- the batch (ep, speed split) ------------------------------------------------------
    def _speed_share(self, batch: Any) -> Any:
        """This rank's speed-proportional share of the global batch (``ep_balanced``)."""
        full = gather_global_batch(batch)
        total = batch_size(full)
        if self._shares is None or sum(self._shares) != total:
            self._shares = speed_shares(self.cluster, self._clock_model, self._timer, total, self._clock_seq)
        start, count = split_sizes(total, self._shares)[self.global_rank]
        self._loss_weight = count * self.world_size / total
        return take(full, start, count)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._runtime is not None:
            # The executor already ran the backward inside the step; Lightning's hooks still run.
            module = self.lightning_module
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            for p, g in self._step_grads:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            self._step_grads = []
            return self.precision_plugin.post_backward(closure_loss, module)
        if self.batch_split == "speed":
            # DDP averages over ranks; with unequal shares each rank's mean must count by its size.
            closure_loss = closure_loss * self._loss_weight
        return super().backward(closure_loss, *args, **kwargs)

    # -- gradients ----------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        tail_started: list[float] = []

        def closure_then_reduce() -> Any:
            result = closure()
            tail_started.append(time.perf_counter())
            if self._runtime is not None:
                self._runtime.sync_grads(self.lightning_module)
            elif self._sharded:
                reduce_expert_grads(self.lightning_module, self.ep_groups)
            return result

        out = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        if tail_started:
            self._pad_tail(tail_started[0])
        if self._step_started is not None:
            self._last_step_s = time.perf_counter() - self._step_started
            self._step_started = None
            self._busy_step_end()
        return out

    def _clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self._runtime is not None:
            total = self._runtime.grad_sq_norm(self.lightning_module).sqrt()
        else:
            expert_ids = {id(p) for _, l in moe_layers(self.lightning_module) for p in l.experts.parameters()}
            dense_sq = sum((p.grad.detach().double().square().sum() for p in params if id(p) not in expert_ids),
                           torch.zeros((), dtype=torch.float64))
            total = (dense_sq + expert_grad_sq_norm(self.lightning_module, self.ep_groups)).sqrt()
        coef = (clip_val / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))

    # -- placement-independent state ----------------------------------------------------
    def _spread_layers(self) -> list[tuple[int, str, Any]]:
        """``(index, name, layer)`` of every MoE layer whose experts are spread over ranks now."""
        if not (self._sharded or (self._runtime is not None and self._runtime.applied)):
            return []
        return [(l, name, layer) for l, (name, layer) in enumerate(moe_layers(self.lightning_module))]

    def _gather_layer(self, l: int, layer: Any, local: torch.Tensor) -> torch.Tensor:
        if self._runtime is not None:
            return self._runtime.gather_layer(l, local)
        return gather_experts(local, layer.dispatcher.placement, self.ep_groups.ep_group)

    def _mine(self, l: int, layer: Any) -> list[int]:
        if self._runtime is not None:
            return self._runtime.layout.mine(l)
        return layer.dispatcher.placement[self.ep_groups.ep_rank]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self.lightning_module.state_dict()
        for l, name, layer in self._spread_layers():
            for pname, p in layer.experts.named_parameters(recurse=False):
                state[f"{name}.experts.{pname}"] = self._gather_layer(l, layer, p.detach())
        return state

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if not self._spread_layers():
            return state
        # ``Optimizer.state_dict()`` hands out the optimizer's own per-parameter dicts: copy
        # them before writing gathered tensors, or the live optimizer would step on them.
        state = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
        for l, layer, p, slot in self._expert_optimizer_slots(state, optimizer):
            for key, value in list(slot.items()):
                if torch.is_tensor(value) and value.shape == p.shape and value.dim() > 0:
                    slot[key] = self._gather_layer(l, layer, value)
        return state

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self._spread_layers():
            for opt_state, optimizer in zip(checkpoint["optimizer_states"], self.optimizers):
                self._slice_optimizer_state(opt_state, optimizer)
        super().load_optimizer_state_dict(checkpoint)

    def _slice_optimizer_state(self, opt_state: dict[str, Any], optimizer) -> None:
        for l, layer, p, slot in self._expert_optimizer_slots(opt_state, optimizer):
            mine = torch.tensor(self._mine(l, layer), dtype=torch.long)
            for key, value in list(slot.items()):
                if torch.is_tensor(value) and value.dim() == p.dim() and value.shape[1:] == p.shape[1:] \
                        and value.shape[0] == layer.num_experts:
                    slot[key] = value[mine]
        if self._runtime is not None and not self._runtime.layout.is_attention:
            # An expert rank holds no dense weights, so it keeps no dense optimizer state either.
            params = [p for g in getattr(optimizer, "_optimizer", optimizer).param_groups for p in g["params"]]
            for i, p in enumerate(params):
                if p.numel() == 0:
                    opt_state["state"].pop(i, None)

    def _expert_optimizer_slots(self, opt_state: dict[str, Any], optimizer):
        """(layer index, layer, expert parameter, its per-parameter optimizer state) for every
        expert parameter that has state; optimizer state is keyed by parameter position."""
        params = (p for g in getattr(optimizer, "_optimizer", optimizer).param_groups for p in g["params"])
        index = {id(p): i for i, p in enumerate(params)}
        for l, _, layer in self._spread_layers():
            for p in layer.experts.parameters(recurse=False):
                slot = opt_state["state"].get(index.get(id(p)))
                if slot:
                    yield l, layer, p, slot

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._runtime is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        # Dense weights live on attention ranks: the first of them writes (its state is complete).
        if self.global_rank == self._runtime.layout.saver:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self._runtime is None:
            return super().remove_checkpoint(filepath)
        if self.global_rank == self._runtime.layout.saver:
            self.checkpoint_io.remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        from .zebra.comm import ChannelError

        lost_peer = isinstance(exception, ChannelError) or "closed" in str(exception).lower() \
            or "reset by peer" in str(exception).lower()
        if not lost_peer and not isinstance(exception, KeyboardInterrupt):
            print(f"[hetermoe] rank {self.global_rank} ({self.describe_rank(self.global_rank)}) failed: "
                  f"{type(exception).__name__}: {exception}", file=sys.stderr, flush=True)
        # A peer's death surfaces here as a gloo "connection closed/reset": name the peer.
        report = getattr(self._launcher, "report_dead_children", None)
        if report is not None:
            report()
        super().on_exception(exception)

    def shutdown(self) -> None:
        """End of the job: every rank leaves the process group together, and rank 0 waits
        for the ranks it launched. Leaving it to interpreter exit lets the C++ threads of
        the store and of gloo be torn down mid-flight (an occasional exit 134)."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        for proc in getattr(self._launcher, "procs", []):
            proc.wait(timeout=120)

    def teardown(self) -> None:
        # After a successful run every rank holds the whole model again, so the user's
        # module (and the spawn launcher's returned weights) are complete and usable anywhere.
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        succeeded = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if self._sharded and succeeded:
            unshard_experts(module, self.ep_groups)
            self._sharded = False
        if self._runtime is not None and self._runtime.applied and succeeded:
            self._runtime.restore(module)
        if self._emulation is not None:
            self._emulation.remove()
            self._emulation = None
        watch_launcher(armed=False)
        super().teardown()


def check_plan(plan: Any, model_cfg: Any, world_size: int) -> None:
    """A plan must fit the world and the model; one clear error per mismatch."""
    if plan.world_size != world_size:
        raise ConfigError(f"the plan is for {plan.world_size} ranks, the trainer runs {world_size}")
    if plan.num_layers != model_cfg.n_layers:
        raise ConfigError(f"the plan is for {plan.num_layers} MoE layers, the model has {model_cfg.n_layers}")
    if plan.num_experts != model_cfg.moe.num_experts:
        raise ConfigError(f"the plan is for {plan.num_experts} experts per layer, the model has "
                          f"{model_cfg.moe.num_experts}")


def loader_batch_shape(trainer) -> tuple[int, int]:
    """``(sequences per rank, sequence length)`` of the stage's loader, read without iterating
    it: its ``batch_size`` and its dataset's first sample (``[seq_len, ...]`` first tensor)."""
    from lightning.pytorch.trainer.states import TrainerFn as Fn

    loop = {Fn.FITTING: trainer.fit_loop, Fn.VALIDATING: trainer.validate_loop, Fn.TESTING: trainer.test_loop,
            Fn.PREDICTING: trainer.predict_loop}[trainer.state.fn]
    try:
        loader = loop._data_source.dataloader()
        if isinstance(loader, (list, tuple)):
            loader = loader[0]
        if isinstance(loader, dict):
            loader = next(iter(loader.values()))
        per_rank = int(loader.batch_size)
        sample = loader.dataset[0]
        first = sample
        while isinstance(first, (list, tuple, dict)):
            first = first[0] if not isinstance(first, dict) else next(iter(first.values()))
        return per_rank, int(first.shape[0])
    except Exception as err:
        raise ConfigError(
            "zebra plans from the batch shape, read from the loader's batch_size and its dataset's first sample "
            f"([seq_len, ...]); that failed ({type(err).__name__}: {err}): pass a plan (plan=plan.json)") from None


def speed_shares(cluster: ClusterConfig, model: Any, timer: Any, total: int, seq_len: int) -> list[int]:
    """Sequences per rank in proportion to each device's attention speed (``ep_balanced``)."""
    from ..simulate.schedules import ep_balanced_shares, ep_speed

    return ep_balanced_shares(total, [ep_speed(d, timer, model, seq_len) for d in cluster.specs()])
