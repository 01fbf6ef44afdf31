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

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from ..cluster import ClusterConfig
from ..config import ConfigError, from_cfg
from ..contract import ModelContractError, describe_model, moe_layers
from .batch import batch_size, gather_global_batch, sequence_length, split_sizes, take
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


class HeterMoEStrategy(DDPStrategy):
    strategy_name = "hetermoe"

    def __init__(
        self,
        mode: str = "ep",
        plan: Any = None,
        cluster: ClusterConfig | dict | None = None,
        expert_parallel_size: int | None = None,
        batch_split: str = "equal",
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
        self.expert_parallel_size = expert_parallel_size
        self.batch_split = batch_split
        self.ep_groups: ExpertParallelGroups | None = None
        self._sharded = False
        self._emulation = None
        self._shares: list[int] | None = None

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
        device = self.cluster.devices[rank] if self.cluster is not None else "?"
        return f"{self.mode} rank, device {device}"

    def setup_environment(self) -> None:
        watch_launcher()
        self._validate_world(self.world_size)
        super().setup_environment()
        self.ep_groups = ExpertParallelGroups.build(self.expert_parallel_size or self.world_size)

    # -- model set-up -------------------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        assert self.ep_groups is not None
        placements = shard_experts(model, self.ep_groups)
        self._sharded = True
        self._report_placement(placements)
        if self.cluster is not None and self.cluster.emulate:
            from ..emulation import apply_emulation

            self._emulation = apply_emulation(model, self.cluster, self.global_rank)
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
        log.info(f"hetermoe[{self.mode}]: {len(placements)} MoE layers, experts per EP rank {sizes}{uneven}, "
                 f"{self.world_size // self.ep_groups.ep_size} replica(s)")

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # Dense and expert gradients live in different groups: the global norm needs both.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if self.batch_split == "speed":
            self._shares = None  # computed from the first global batch

    # -- the batch ----------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.batch_split == "speed" and args:
            args = (self._speed_share(args[0]),) + tuple(args[1:])
        return super().training_step(*args, **kwargs)

    def _speed_share(self, batch: Any) -> Any:
        """This rank's speed-proportional share of the global batch (``ep_balanced``)."""
        full = gather_global_batch(batch)
        total = batch_size(full)
        if self._shares is None or sum(self._shares) != total:
            self._shares = speed_shares(self.cluster, self.lightning_module, total, sequence_length(full))
        start, count = split_sizes(total, self._shares)[self.global_rank]
        self._loss_weight = count * self.world_size / total
        return take(full, start, count)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.batch_split == "speed":
            # DDP averages over ranks; with unequal shares each rank's mean must count by its size.
            closure_loss = closure_loss * self._loss_weight
        return super().backward(closure_loss, *args, **kwargs)

    # -- gradients ----------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            if self._sharded:
                reduce_expert_grads(self.lightning_module, self.ep_groups)
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def _clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        expert_ids = {id(p) for _, l in moe_layers(self.lightning_module) for p in l.experts.parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        dense_sq = sum((p.grad.detach().double().square().sum() for p in params if id(p) not in expert_ids),
                       torch.zeros((), dtype=torch.float64))
        total = (dense_sq + expert_grad_sq_norm(self.lightning_module, self.ep_groups)).sqrt()
        coef = (clip_val / (total + 1e-6)).clamp(max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))

    # -- placement-independent state ----------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self.lightning_module.state_dict()
        if not self._sharded:
            return state
        for name, layer in moe_layers(self.lightning_module):
            placement = layer.dispatcher.placement
            for pname, p in layer.experts.named_parameters(recurse=False):
                key = f"{name}.experts.{pname}"
                state[key] = gather_experts(p.detach(), placement, self.ep_groups.ep_group)
        return state

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if not self._sharded:
            return state
        # ``Optimizer.state_dict()`` hands out the optimizer's own per-parameter dicts: copy
        # them before writing gathered tensors, or the live optimizer would step on them.
        state = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
        for layer, p, slot in self._expert_optimizer_slots(state, optimizer):
            for key, value in list(slot.items()):
                if torch.is_tensor(value) and value.shape == p.shape:
                    slot[key] = gather_experts(value, layer.dispatcher.placement, self.ep_groups.ep_group)
        return state

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self._sharded:
            for opt_state, optimizer in zip(checkpoint["optimizer_states"], self.optimizers):
                self._slice_optimizer_state(opt_state, optimizer)
        super().load_optimizer_state_dict(checkpoint)

    def _slice_optimizer_state(self, opt_state: dict[str, Any], optimizer) -> None:
        for layer, p, slot in self._expert_optimizer_slots(opt_state, optimizer):
            mine = torch.tensor(layer.dispatcher.placement[self.ep_groups.ep_rank], dtype=torch.long)
            for key, value in list(slot.items()):
                if torch.is_tensor(value) and value.dim() == p.dim() and value.shape[1:] == p.shape[1:] \
                        and value.shape[0] == layer.num_experts:
                    slot[key] = value[mine]

    def _expert_optimizer_slots(self, opt_state: dict[str, Any], optimizer):
        """(layer, expert parameter, its per-parameter optimizer state) for every expert
        parameter that has state; optimizer state is keyed by parameter position."""
        params = (p for g in getattr(optimizer, "_optimizer", optimizer).param_groups for p in g["params"])
        index = {id(p): i for i, p in enumerate(params)}
        for _, layer in moe_layers(self.lightning_module):
            for p in layer.experts.parameters(recurse=False):
                slot = opt_state["state"].get(index.get(id(p)))
                if slot:
                    yield layer, p, slot

    def on_exception(self, exception: BaseException) -> None:
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
        # After a successful fit every rank holds all experts again, so the user's module
        # (and the spawn launcher's returned weights) are complete and usable anywhere.
        module = self.lightning_module
        if self._sharded and module is not None and module.trainer is not None \
                and module.trainer.state.status == TrainerStatus.RUNNING:
            unshard_experts(module, self.ep_groups)
            self._sharded = False
        if self._emulation is not None:
            self._emulation.remove()
            self._emulation = None
        watch_launcher(armed=False)
        super().teardown()


def speed_shares(cluster: ClusterConfig, module: Any, total: int, seq_len: int) -> list[int]:
    """Sequences per rank in proportion to each device's attention speed (``ep_balanced``)."""
    from ..cluster.devices import resolve_cluster
    from ..profile.timer import make_timer
    from ..simulate.schedules import ep_balanced_shares, ep_speed

    model = describe_model(module)
    timer = make_timer(model, seq_len)
    return ep_balanced_shares(total, [ep_speed(d, timer, model, seq_len) for d in resolve_cluster(cluster)])
