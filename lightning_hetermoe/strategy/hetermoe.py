"""``HeterMoEStrategy``: DDP for the dense part, expert parallelism for the experts.

Modes: ``ep`` (plain expert parallelism on any number of ranks) runs today. The
constructor already takes ``mode``, ``plan`` and ``cluster`` so that the zebra executor
and DistEP slot in without changing how users build the strategy.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.nn.parallel import DistributedDataParallel

from ..cluster import ClusterConfig
from ..config import from_cfg
from .expert_parallel import (
    ExpertParallelGroups,
    expert_grad_sq_norm,
    expert_param_names,
    gather_experts,
    moe_layers,
    reduce_expert_grads,
    shard_experts,
    unshard_experts,
)
from .launchers import HydraAwareScriptLauncher

log = logging.getLogger(__name__)

MODES = ("ep", "zebra", "distep")
IMPLEMENTED_MODES = ("ep",)


def validate_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"strategy mode={mode!r} is invalid: must be one of {MODES}")
    if mode not in IMPLEMENTED_MODES:
        raise ValueError(f"strategy mode={mode!r} is not available in this version: use one of {IMPLEMENTED_MODES}")
    return mode


class HeterMoEStrategy(DDPStrategy):
    strategy_name = "hetermoe"

    def __init__(
        self,
        mode: str = "ep",
        plan: Any = None,
        cluster: ClusterConfig | dict | None = None,
        expert_parallel_size: int | None = None,
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
        self.plan = plan
        self.cluster = None if cluster is None else from_cfg(ClusterConfig, cluster)
        if expert_parallel_size is not None and expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size={expert_parallel_size} is invalid: must be >= 1")
        self.expert_parallel_size = expert_parallel_size
        self.ep_groups: ExpertParallelGroups | None = None
        self._sharded = False

    def _configure_launcher(self) -> None:
        # The connector calls this once the device count is known and before any process
        # starts: the right moment to reject a world that cannot work.
        self._validate_world(self.num_processes * self.num_nodes)
        if self._start_method == "popen":
            self._launcher = HydraAwareScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            super()._configure_launcher()

    def _validate_world(self, world_size: int) -> None:
        if self.cluster is not None and self.cluster.world_size != world_size:
            raise ValueError(
                f"cluster '{self.cluster.name}' names {self.cluster.world_size} devices but the trainer runs "
                f"{world_size} processes: set trainer devices*num_nodes={self.cluster.world_size}"
            )
        ep = self.expert_parallel_size or world_size
        if world_size % ep:
            raise ValueError(f"expert_parallel_size={ep} is invalid: must divide the world size {world_size}")

    def setup_environment(self) -> None:
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

            apply_emulation(model, self.cluster, self.global_rank)
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
        # Per-parameter optimizer tensors shaped like a sharded expert are gathered too.
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

    def teardown(self) -> None:
        # After a successful fit every rank holds all experts again, so the user's module
        # (and the spawn launcher's returned weights) are complete and usable anywhere.
        module = self.lightning_module
        if self._sharded and module is not None and module.trainer is not None \
                and module.trainer.state.status == TrainerStatus.RUNNING:
            unshard_experts(module, self.ep_groups)
            self._sharded = False
        if module is not None and self.cluster is not None and self.cluster.emulate:
            from ..emulation import installed

            handle = installed(module)
            if handle is not None:
                handle.remove()
        super().teardown()
