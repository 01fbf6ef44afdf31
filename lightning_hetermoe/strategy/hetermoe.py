"""``HeterMoEStrategy``: Lightning's hooks for every parallelism the pack runs.

The parallelism itself lives in a backend chosen once at set-up (:mod:`.selection`):
single device, expert parallelism (``ep``, ``ep_balanced``), or zebra/DistEP. This class
holds what Lightning asks of a strategy and delegates each hook; the run's clock and
predictions are :class:`~.run_clock.RunClock`, placement-independent expert state is
:class:`~.expert_state.ExpertState`, argument checks are :mod:`.arguments`.

Whatever the backend, training equals single-process training on the global batch, and
checkpoints hold full expert tensors (placement-independent).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning_hetermoe.comm as comm
from ..cluster import ClusterConfig
from ..configs import ConfigError
from ..ckpt import CheckpointFormatError, is_sharded_checkpoint
from ..ckpt.consolidate import read_meta
from ..ckpt.loading import check_same_model
from ..ckpt import save as save_pieces
from ..model_contract import describe_model, moe_layers
from ..convert.hf import export_info
from ..moe.expert_bias import ExpertBiasUpdater
from ..placement import Placement
from ..simulate.schedules import EP_SCHEDULES
from ..staging import (is_earlier_copy, missing_parents, partial_sibling, remove_empty, remove_stale,
                       replace_directory, unfinished_note)
from .. import standin
from . import heartbeat, sigterm
from .arguments import MODES, StrategyArguments, check_passed_on
from .backends.base import OUTSIDE_STEP_TIMEOUT_S, ParallelBackend, broadcast_whole
from .averaging import (average_bytes, averagers, averages, averages_on, follow_layout, load_average, made_whole,
                        saved_with_average)
from .expert_state import ExpertState, expert_tensor_names
from ..materialize import Materializer, built_on_meta
from .sharded_state import FORMAT_VERSION, META_FILE, WEIGHTS_ONLY_RESUME, ShardedState
from .grad_norm import clip_, step_takes_scale, unfold
from .gloo_at_scale import connect_lazily, raise_open_files
from .memory_watch import (MemoryWatch, optimizer_bytes_per_param, optimizer_step_bytes, predict_rank,
                           return_freed_memory)
from .zero import ELEMENTWISE, OptimizerSharding, shardable
from .precision import AgreedGradScaler, agree_on_overflow, clip_fused_too, clip_synced_grads, precision_name
from .progress import StepProgress
from .shared_metrics import SharedCallbackMetrics, mirror_logged_metrics
from .launchers import (CheckedSpawnLauncher, HydraAwareScriptLauncher, end_job_for_silent_peer, failure_in_hand,
                        lost_peer, register_exit_hook, stop_watching, watch_launcher)
from .run_clock import RunClock
from .gc_schedule import CollectBetweenSteps
from .summary import count_whole_model
from .metric_sync import sync_metrics_over
from .piece_groups import regroup_pieces
from .together import stop_together

# where a sharded checkpoint must be for every rank to write or read its part
_SHARED_PATH = ("on a file system every node sees, under a path that names it on each (an absolute one: a relative "
                "path is taken from each process's working directory)")


class HeterMoEStrategy(DDPStrategy):
    """Lightning's strategy for MoE training on mixed GPUs: ``Trainer(strategy="hetermoe")``
    or ``HeterMoEStrategy(...)``. At set-up it plans (or takes ``plan``) and runs one
    parallelism: ``mode="zebra"`` (HeterMoE: attention on the newer GPUs, experts on the
    older ones, micro-batches interleaved), ``"distep"``, ``"ep"`` (expert parallelism,
    ``batch_split="speed"`` for speed-proportional batches), ``"datacentric"`` (HEXA-MoE),
    or ``"auto"``, the fastest its clock predicts. Every mode trains as one process would
    on the global batch. ``cluster`` names the devices (a config or its dict; emulated
    mixes run on CPU processes); README "Using the strategy" gives every argument.
    Arguments it does not know go on to Lightning's ``DDPStrategy``."""

    strategy_name = "hetermoe"

    def __init__(
        self,
        mode: str = "auto",
        plan: Any = None,
        cluster: ClusterConfig | dict | None = None,
        expert_parallel_size: int | str | None = None,
        batch_split: str = "equal",
        replica_dispatch: str = "local_first",
        num_microbatches: int | None = None,
        asym_ea: bool = True,
        require_expert_ranks: bool = False,
        profile: Any = None,
        expert_load: Any = None,
        place_at_load: bool | None = None,
        heartbeat_timeout_s: float | None = 30.0,
        progress_timeout_s: float | None = 300.0,
        allow_emulated_bf16: bool = False,
        checkpoint_format: str = "auto",
        shard_optimizer_state: bool = True,
        gc_every_n_steps: int | None = 50,
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
        check_passed_on(kwargs)  # a typo is named here, not by DistributedDataParallel in every process
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, **kwargs)
        self.args = StrategyArguments(mode=mode, plan=plan, cluster=cluster, expert_parallel_size=expert_parallel_size,
                                      batch_split=batch_split, replica_dispatch=replica_dispatch,
                                      num_microbatches=num_microbatches, asym_ea=asym_ea,
                                      require_expert_ranks=require_expert_ranks, profile=profile,
                                      expert_load=expert_load, place_at_load=place_at_load,
                                      heartbeat_timeout_s=heartbeat_timeout_s,
                                      progress_timeout_s=progress_timeout_s,
                                      allow_emulated_bf16=allow_emulated_bf16,
                                      checkpoint_format=checkpoint_format,
                                      shard_optimizer_state=shard_optimizer_state,
                                      gc_every_n_steps=gc_every_n_steps)
        self.gc = CollectBetweenSteps(self.args.gc_every_n_steps)  # Python's collector while training
        self.clock = RunClock(self.args.cluster, self.args.profile, rank=0)
        self.backend: ParallelBackend | None = None
        self._built_whole = True  # the user built the model whole (not on the meta device)
        self._ddp_trainable: frozenset[int] = frozenset()  # the parameters DDP's reducer sums
        self._grads_synced = True  # the gradients of the last backward are summed over the ranks
        self._loaded_sharded = False  # the checkpoint being restored is a sharded one
        self._average_bytes = 0  # the weight averages this rank keeps on its device (Lightning's WeightAveraging)
        # a checkpoint asked for while this rank handles an error: None (no such save under
        # way), else why it is not saved ('' where every rank asked for it: it is)
        self._error_save: str | None = None
        self._saves_sharded = False  # checkpoint_format resolved at the first set-up (auto: by size)
        self._whole_numel: dict[str, int] = {}  # each parameter's whole size, by name, at the first set-up
        # the whole expert parameters the optimizers hold after a run, by id: their names
        self._whole_optimizer_names: dict[int, str] = {}
        self._sharding: OptimizerSharding | None = None  # dense optimizer state sharded over replicas
        self.memory: MemoryWatch | None = None  # this rank's memory: what it holds, its peak, its budget
        self.progress: StepProgress | None = None  # this rank's steps, for the stuck-rank watchdog
        self._expert_bias: ExpertBiasUpdater | None = None  # when some router balances by a bias
        self._placement_at_end: Placement | None = None  # where the experts were when the last fit ended
        # Set by ExpertLoadMonitor before set-up: time each task of a rank on its real device.
        self.measure_busy = False
        self._standin: torch.device | None = None  # HETERMOE_STANDIN: a CPU run computes on the stand-in

    # -- what the user asked for, and what runs ---------------------------------------------
    @property
    def mode(self) -> str:
        """The mode asked for (``auto`` until set-up resolves it; see :attr:`schedule`)."""
        return self.args.mode

    @property
    def cluster(self) -> ClusterConfig | None:
        return self.args.cluster

    @property
    def schedule(self) -> str | None:
        """What runs: ``single``, ``ep``, ``ep_balanced``, ``zebra`` or ``distep`` (after set-up)."""
        return self.backend.schedule if self.backend is not None else None

    @property
    def expert_parallel_size(self) -> int | None:
        """Ranks per EP group where EP runs (after set-up): the size asked for, or the one
        ``mode="auto"`` or ``expert_parallel_size="auto"`` chose; ``None`` under the other
        schedules."""
        return getattr(self.backend, "ep_size", None) if self.schedule in EP_SCHEDULES else None

    @property
    def plan(self) -> Any:
        """The plan that runs (zebra, distep), else the one given."""
        return getattr(self.backend, "plan", None) or self.args.plan

    @property
    def prediction(self) -> dict[str, Any] | None:
        """The simulator's step time for this run (its plan, its clock); ``None`` without a cluster config."""
        return self.clock.prediction

    # -- launch -------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        # The connector calls this once the device count is known and before any process
        # starts: the right moment to reject a world that cannot work.
        self.args.check_world(self.num_processes * self.num_nodes, precision_name(self.precision_plugin))
        self.args.check_nodes(self.num_nodes, self.num_processes)
        if self._start_method == "popen":
            self._launcher = HydraAwareScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                                      pre_launch=self.check_model, describe_rank=self.describe_rank)
        else:
            self._launcher = CheckedSpawnLauncher(self, start_method=self._start_method, pre_launch=self.check_model)

    @property
    @override
    def root_device(self) -> torch.device:
        """The compute device: Lightning's, or on a CPU run with ``HETERMOE_STANDIN`` the
        stand-in device (:mod:`lightning_hetermoe.standin`)."""
        return self._standin or super().root_device

    def check_model(self, model: Any, trainer: Any = None) -> None:
        """Everything about the model (and the trainer's callbacks) that can be checked before processes start."""
        world = self.num_processes * self.num_nodes
        device = self.root_device if self.parallel_devices else torch.device("cpu")
        self.args.check_model(model, device, world)
        self.args.check_memory(model, world, averages_on(trainer.callbacks, device) if trainer is not None else 0)
        if trainer is not None:
            self.args.check_callbacks(trainer.callbacks, model, world, trainer.state.fn == TrainerFn.FITTING)

    def describe_rank(self, rank: int) -> str:
        if self.backend is not None:
            return self.backend.describe_rank(rank)
        plan = self.args.plan
        if plan is not None:
            return f"{plan.roles[rank]} rank, device {plan.devices[rank]}"
        # before set-up under mode="auto" no schedule is chosen yet: no "auto rank"
        role = "schedule not chosen yet" if self.mode == "auto" else f"{self.mode} rank"
        if self.cluster is not None:
            return f"{role}, device {self.cluster.devices[rank]}"
        devices = self.parallel_devices or []
        if rank == self.global_rank and self.local_rank < len(devices):  # its own device is known before set-up
            return f"{role}, device {devices[self.local_rank]}"
        return role  # another rank's device, without a cluster config: unknown here

    @override
    def setup_environment(self) -> None:
        watch_launcher()
        self.args.check_world(self.world_size, precision_name(self.precision_plugin))
        self._standin = None  # the CPU accelerator checks its device first (every stage)
        # before the process group's gloo groups connect (gloo_at_scale's doc)
        lazy = connect_lazily()
        short = raise_open_files(self.world_size, warn=not lazy)
        if short is not None:
            rank_zero_warn(short)
        super().setup_environment()
        if super().root_device.type == "cpu" and standin.requested():
            self._standin = standin.enable()  # after the CPU accelerator checked its device
        self.clock.rank = self.global_rank
        if self.memory is None:
            if self.root_device.type == "cpu":
                return_freed_memory()
            self.memory = self._memory_watch()
        comm.configure(self.root_device, self.args.vendors)
        if self.progress is None and self.args.progress_timeout_s is not None:
            self.progress = StepProgress(self.args.progress_timeout_s)
        heartbeat.ensure(self.global_rank, self.world_size, self.args.heartbeat_timeout_s, self.describe_rank,
                         on_silent=end_job_for_silent_peer, progress=self.progress)

    # -- set-up -------------------------------------------------------------------------
    # -- construction ---------------------------------------------------------------------
    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)`` builds on the meta device: no process
        allocates the model; each materialises its share at set-up."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` runs on the meta device (Lightning calls it inside this)."""
        with torch.device("meta"):
            yield

    @override
    def setup(self, trainer) -> None:
        # Lightning's DDP order, with the backend laying the model out on its device before
        # the optimizers are built over what this rank keeps.
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        # Lightning installs its SIGTERM handler after this, and the handler's broadcast would
        # meet whatever collective the rank is in: quiet from the start
        sigterm.quiet_handler(trainer, self.world_size)
        # again for a model whose layers configure_model built
        self.args.check_callbacks(trainer.callbacks, self.lightning_module, self.world_size, fitting)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        on_meta = built_on_meta(self.model)
        if not on_meta:
            self.model_to_device()
        if self.backend is None:
            self._built_whole = not on_meta
            if self._built_whole:
                self._warn_built_whole()
            if self._built_whole and self.world_size > 1:
                # rank 0's values everywhere before anything reads them: every rank forwards
                # its share of the routing warm-up, then the backend slices out its part
                # (processes seeded apart start equal)
                broadcast_whole(self.lightning_module, "strategy.weights")
            self._saves_sharded = self._checkpoint_sharded()  # before the backend slices: alike on every rank
            # each parameter's whole size, for the model summaries (meta tensors have theirs)
            self._whole_numel = {name: p.numel() for name, p in self.lightning_module.named_parameters()}
            from .selection import dense_backend, select_backend

            self.backend = dense_backend(self) or select_backend(self, trainer)
            self.backend.outside_step_timeout_s = self._outside_step_timeout_s
            # again at what mode="auto" chose
            self.args.check_callbacks(trainer.callbacks, self.lightning_module, self.world_size, fitting,
                                      schedule=self.schedule, ep_size=self.expert_parallel_size)
        self.backend.setup(self.lightning_module, fitting, self._materializer() if on_meta else None)
        self._share_callback_metrics(trainer)
        sync_metrics_over(self.lightning_module, self.backend.metrics_group(None))
        count_whole_model(trainer.callbacks, self._whole_numel, self.backend.runs_bare_forward)
        self.model_to_device()  # whatever the model built outside the meta device
        # (before DDP wraps the module: a weight average copies the module alone)
        follow_layout(trainer, self.lightning_module, ExpertState(self.backend, self.lightning_module).local_state)
        self._average_bytes = average_bytes(trainer, self.lightning_module, self.root_device)
        if fitting:
            self._expert_bias = ExpertBiasUpdater([layer for _, layer in moe_layers(self.lightning_module)])
        agree_on_overflow(self.precision_plugin)
        clip_fused_too(self.precision_plugin)
        self._tune_kernels()
        if fitting:
            if self.backend.wraps_ddp:
                self.configure_ddp()
            self.setup_optimizers(trainer)
            # groups chosen by shape (weight decay on matrices) see the experts' whole shapes
            regroup_pieces(self.lightning_module, self.optimizers, self.backend.piece_shapes())
            self._sharding = self._shard_optimizer_state()
            if self.memory is not None:
                self.memory.predicted = self._predict_memory()
            # Dense and expert gradients live in different groups: the global norm needs both.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
            clip_synced_grads(self.precision_plugin, self._sync_grads)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _share_callback_metrics(self, trainer) -> None:
        """Where only some ranks log, every rank's callbacks read the same metrics (first)."""
        source = self.backend.metrics_source()
        mine = [c for c in trainer.callbacks if isinstance(c, SharedCallbackMetrics)]
        for c in mine:
            trainer.callbacks.remove(c)
        if source is not None:
            trainer.callbacks.insert(0, SharedCallbackMetrics(source, self.backend.local_evaluation_names))
        mirror_logged_metrics(trainer, source)

    def _shard_optimizer_state(self) -> OptimizerSharding | None:
        """ZeRO-1 over the ranks that hold the dense weights alike (see :mod:`.zero`)."""
        group = self.backend.dense_replicas()
        if not self.args.shard_optimizer_state or not self.sharded_checkpoints or group is None or group.size < 2:
            return None
        from lightning.pytorch.callbacks import BaseFinetuning

        tuners = [type(c).__name__ for c in self.lightning_module.trainer.callbacks if isinstance(c, BaseFinetuning)]
        if tuners:  # it finds the module's parameters in the optimizers' groups, where shards would stand
            rank_zero_warn(f"HeterMoEStrategy: optimizer state stays whole on every replica: {tuners} reads and "
                           f"adds the optimizer's parameter groups by the module's parameters")
            return None
        unfit = [type(getattr(o, "_optimizer", o)).__name__ for o in self.optimizers if not shardable(o)]
        if unfit:
            rank_zero_warn(f"HeterMoEStrategy: optimizer state stays whole on every replica: {unfit} may read more "
                           f"than an element's own state (sharded: {list(ELEMENTWISE)})")
            return None
        experts = {id(p) for _, layer in moe_layers(self.lightning_module) for p in layer.experts.parameters()}
        in_optimizers = {id(p) for o in self.optimizers for g in getattr(o, "_optimizer", o).param_groups
                         for p in g["params"]}
        # (a 0-d parameter stays whole: its state is a few bytes, and 0-d state reads as a scalar)
        params = [(n, p) for n, p in self.lightning_module.named_parameters()
                  if id(p) not in experts and id(p) in in_optimizers and p.dim() > 0 and p.numel() > 0]
        devices = self.clock.devices
        weights = [devices[r].memory_gb for r in group.ranks] if len(devices) == self.world_size else None
        return OptimizerSharding(self.optimizers, params, group, weights)

    def _memory_watch(self) -> MemoryWatch:
        budget, scale = None, None
        cluster = self.args.cluster
        if cluster is not None and cluster.memory_scale is not None:
            spec = cluster.specs()[self.global_rank]
            budget, scale = spec.memory_gb * 1e9, cluster.memory_scale
        return MemoryWatch(self.global_rank, self.root_device, budget,
                           lambda: self.describe_rank(self.global_rank), scale)

    def _predict_memory(self) -> Any:
        """What this rank should need, from what it holds and the batch it runs."""
        from ..profile.memory import activation_bytes

        clock, act = self.clock, 0.0
        bytes_ = 4 if precision_name(self.precision_plugin) == "32-true" else 2
        if clock.bound and self.backend.holds_dense:  # the run's own model and sequences (not an emulated workload's)
            tokens = clock.per_rank * clock.run_seq_len
            plan = self.plan if self.backend.schedule in ("zebra", "distep") else None
            if plan is not None:  # an attention rank runs its share of the global batch, R micro-batches in flight
                tokens = plan.seqs_per_rank[self.global_rank] * clock.run_seq_len
            R = self.backend.num_microbatches or 1
            act = activation_bytes(describe_model(self.lightning_module), tokens_in_flight=tokens, mb_tokens=tokens / R,
                                   act_bytes=bytes_)
        shards = self._sharding.group.size if self._sharding is not None else 1
        rows = self._expert_rows_bytes(bytes_) if clock.bound else 0.0
        return predict_rank(self.lightning_module, self.backend.expert_pieces, mode=self.backend.schedule,
                            dense_shards=shards, optimizer_bytes=optimizer_bytes_per_param(self.optimizers),
                            activations=act, step=optimizer_step_bytes(self.optimizers), expert_rows=rows,
                            averages=self._average_bytes)

    def _expert_rows_bytes(self, act_bytes: int) -> float:
        """What the experts this rank holds keep for their backward at once, at even routing:
        under zebra every token of its ZP group is in flight (DistEP: one micro-batch of them),
        under ep one batch of every rank's; none under ep where the blocks are checkpointed
        (the experts run inside them) or in data-centric mode (the layer is its block's)."""
        from ..model_contract import checkpoints_activations, moe_layers
        from ..moe.experts import Experts
        from ..profile.memory import routed_row_values

        clock, plan, schedule = self.clock, self.plan, self.backend.schedule
        checkpointed = checkpoints_activations(self.lightning_module)
        if schedule in ("zebra", "distep") and plan is not None:
            group = next(g for g in plan.zp_groups if self.global_rank in g.members)
            tokens = sum(plan.seqs_per_rank[r] for r in group.attention_ranks) * clock.run_seq_len
            if schedule == "distep":
                tokens /= max(plan.distep_microbatches, 1)
        elif schedule == "ep" and not checkpointed:
            tokens = clock.per_rank * clock.run_seq_len * self.world_size
        else:
            return 0.0
        total = 0.0
        for _, layer in moe_layers(self.lightning_module):
            d_model = layer.experts.d_model
            values = routed_row_values(d_model, layer.cfg, checkpointed) if isinstance(layer.experts, Experts) \
                else 2 * d_model  # your own experts: the rows and answer (what they keep inside is theirs)
            total += layer.experts.num_local_experts * tokens * layer.top_k / layer.num_experts * values
        return total * act_bytes

    def check_memory(self, at: str) -> None:
        """This rank's peak against its budget (a :class:`MemoryBudgetError` past it)."""
        if self.memory is not None and self.lightning_module is not None:
            self.memory.check(self.lightning_module, self.optimizers, at, self._average_bytes)

    def memory_report(self) -> list[dict[str, Any]] | None:
        """Every rank's memory (peak, budget, what it held at most), gathered: a collective."""
        if self.memory is None:
            return None
        if self.lightning_module is not None:  # the checks count only now and then: the state as it ends
            self.memory.count(self.lightning_module, self.optimizers, self._average_bytes)
        mine = self.memory.report()
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        return comm.gather_objects(comm.world(), mine, what="strategy.memory_report")

    def _materializer(self) -> Materializer:
        """Every rank materialises with rank 0's seeds: the pack's per-module seeds and the
        run's seed for the rest (no value moves between ranks, only these integers)."""
        seeds = [m.init_seed for m in self.lightning_module.modules() if isinstance(getattr(m, "init_seed", None), int)]
        run_seed = torch.initial_seed() & ((1 << 63) - 1)
        seeds, run_seed = self.broadcast((seeds, run_seed), src=0)
        mine = [m for m in self.lightning_module.modules() if isinstance(getattr(m, "init_seed", None), int)]
        if len(mine) != len(seeds):
            raise ConfigError(f"rank {self.global_rank} built a different model than rank 0 ({len(mine)} seeded "
                              f"modules against {len(seeds)}): every process must build the same model")
        for m, seed in zip(mine, seeds, strict=True):
            m.init_seed = seed
        return Materializer(self.root_device, run_seed)

    def _warn_built_whole(self) -> None:
        from ..profile.memory import small_training_state

        params = sum(p.numel() for p in self.model.parameters())
        # a small model built whole costs nothing worth a warning, and gives the planner its
        # warm-up routing: the line init_on_meta=auto draws
        if self.world_size < 2 or small_training_state(params):
            return
        state_gb = sum(p.numel() * p.element_size() for p in self.model.parameters()) / 1e9
        rank_zero_warn(
            f"HeterMoEStrategy: the model was built whole in every process ({params / 1e6:,.1f}M parameters, "
            f"{state_gb:.2f} GB of weights each, before gradients and optimizer state); each rank then keeps only "
            f"its share. Build it in the LightningModule's configure_model() or under "
            f"`with trainer.init_module(empty_init=True):` and each process allocates only what it holds.")

    def _tune_kernels(self) -> None:
        """Warm the Triton expert kernels a step will launch, now, outside any overlapped
        region (:func:`lightning_hetermoe.kernels.warmup.warm_up_keys`: nothing in single and
        ep modes unless autotuning is on; under zebra/distep the plan's row counts on every
        layer shape this rank holds), in the run's compute dtype; on CPU nothing runs."""
        if self.root_device.type != "cuda":
            return
        from ..kernels import warm_up
        from ..kernels.availability import tf32_enabled, triton_runs_dtype
        from ..kernels.chooser import backend_for
        from ..kernels.tuning import autotune_enabled
        from ..kernels.warmup import LayerShape, warm_up_keys

        plugin = self.precision_plugin
        autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(getattr(plugin, "precision", ""))
        shapes, dtype = [], autocast
        for _, layer in moe_layers(self.lightning_module):
            ex = layer.experts
            dtype = autocast or ex.w_up.dtype
            # auto may run another backend for this dtype (grouped_mm for bf16 on sm90)
            on_triton = backend_for(ex.backend, self.root_device, dtype) == "triton"
            shapes.append(LayerShape(ex.d_model, ex.d_ff, ex.activation, ex.b_up is not None, layer.top_k,
                                     ex.num_local_experts) if on_triton else None)
        if dtype is None or not triton_runs_dtype(dtype, "cuda", torch.cuda.get_device_capability(self.root_device),
                                                  tf32_enabled()):
            return  # no layer on Triton, or its fp32 runs on the torch loop
        backend = self.backend
        for key in warm_up_keys(getattr(backend, "schedule", ""), getattr(backend, "plan", None), self.global_rank,
                                shapes, dtype, autotune=autotune_enabled()):
            warm_up(key.d_model, key.d_ff, key.activation, key.bias, key.dtype, device=self.root_device,
                    rows=list(key.rows), experts=key.experts)

    @override
    def _get_process_group_backend(self) -> str:
        # NCCL and RCCL cannot form one communicator: a job mixing vendors starts on gloo
        # and comm builds each vendor's device groups on its own backend
        if self.args.mixes_vendors and self._process_group_backend is None:
            return "gloo"
        return super()._get_process_group_backend()

    @override
    def determine_ddp_device_ids(self) -> list[int] | None:
        return None if self._standin is not None else super().determine_ddp_device_ids()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, self.backend.ddp_ignored(model))
        self._ddp_trainable = trainable(model)
        if comm.world().staged or self._standin is not None:
            # DDP's buckets through comm: staged where the replicas span vendors, and recorded
            # (and on the stand-in, where gloo gets the CPU memory it holds); the stand-in's
            # replicas start equal (seeded), DDP's own broadcast of them would hand gloo a
            # tensor it cannot take
            self._ddp_kwargs.setdefault("process_group", comm.world().device)
            if self._standin is not None:
                self._ddp_kwargs.setdefault("init_sync", False)
            ddp = super()._setup_model(model)
            ddp.register_comm_hook(comm.world(), comm.ddp_allreduce_hook)
            return ddp
        return super()._setup_model(model)

    def _follow_trainable(self) -> None:
        """DDP sums the gradients of the parameters that required one when it was built: one
        unfrozen later (Lightning's BaseFinetuning, BackboneFinetuning) would train on each
        rank's own gradient, and one frozen later would leave DDP waiting for a gradient that
        never comes. Where the set changed, the model is wrapped again (a collective: every
        rank runs the same callbacks before the same batch). Plain DDP does neither."""
        if not isinstance(self.model, DistributedDataParallel) or trainable(self.lightning_module) == self._ddp_trainable:
            return
        kwargs = self._ddp_kwargs
        # no broadcast of rank 0's weights: the replicas trained alike, and on a GPU DDP builds
        # on a side stream, which could read them before the last optimizer step wrote them
        self._ddp_kwargs = {**kwargs, "init_sync": False}
        try:
            self.model = self.model.module
            self.configure_ddp()
        finally:
            self._ddp_kwargs = kwargs

    # -- the step -----------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # every rank reaches this step's first batch before any of the step's collectives
        self.gc.before_batch(self.lightning_module.trainer.global_step)
        # after every callback's and the module's own hook, before the step (and before
        # Lightning's no_sync for an accumulating batch)
        self._follow_trainable()
        self._grads_synced = False  # (a manual step may run its backward without manual_backward)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # before every batch Lightning asks rank 0 about SIGTERM on the device, which on a GPU
        # waits for every rank's queued optimizer step: asked on the host instead
        sigterm.ask_on_the_host(self.lightning_module.trainer, self.world_size)
        device, where = self.root_device, f"rank {self.global_rank} ({self.describe_rank(self.global_rank)})"
        if device.type == "cuda":  # the allocator's counts: read on the host, no sync
            self.gc.start(lambda: torch.cuda.memory_allocated(device),
                          torch.cuda.get_device_properties(device).total_memory, where)
        else:
            self.gc.start(where=where)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.gc.stop()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Zebra and DistEP keep the batch on the host: every rank's rows go to the attention
        ranks over the host side, and each moves the micro-batches it computes to its device.
        Moved first, an expert rank's rows would queue behind its optimizer step on its
        stream, and so would the device gather of the next batch: the attention ranks would
        wait through the expert ranks' tail instead of starting the next step's first layer
        (simulate.step.carries_tails). The module's transfer hooks run as ever, to the host."""
        if self.backend is not None and self.backend.batch_on_host and self.root_device.type != "cpu":
            device = torch.device("cpu")
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.step_started(self.root_device)
        if self.progress is not None:
            self.progress.started(self.lightning_module.trainer.global_step)
        return self._step("training_step", super().training_step, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_evaluation_batch()
        return self._step("validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_evaluation_batch()
        return self._step("test_step", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._before_evaluation_batch()
        return self._step("predict_step", super().predict_step, args, kwargs)

    def _step(self, hook: str, default: Any, args: tuple, kwargs: dict) -> Any:
        # inside: every rank runs it in step (the backend's check outside steps stays quiet)
        with self.backend.stepping():
            return self.backend.step(self.lightning_module, hook, default, self.precision_plugin, args, kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # a stream's length is known only when it ends: its batches are agreed on one by one
        stage = self.lightning_module.trainer.state.stage if self.lightning_module is not None else None
        return stop_together(super().process_dataloader(dataloader), comm.world() if self.world_size > 1 else None,
                             f"trainer {stage.value if stage is not None else 'loop'}")

    # -- evaluation loops -----------------------------------------------------------------
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.gc.pause()
        trainer = self.lightning_module.trainer
        self._check_equal_batches(trainer.num_sanity_val_batches if trainer.sanity_checking
                                  else trainer.num_val_batches, "validate")

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.gc.resume()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._check_equal_batches(self.lightning_module.trainer.num_test_batches, "test")

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._check_equal_batches(self.lightning_module.trainer.num_predict_batches, "predict")

    def _check_equal_batches(self, max_batches: list, stage: str) -> None:
        """Every step here is a collective over all ranks (zebra's rounds and outputs, ep's
        all-to-all, data-centric gathers): a rank with a batch more than its peers would wait
        on them for ever. Lightning's predict sampler deals rows without padding, so its
        loaders can differ by a batch; this says so before the first step."""
        if self.world_size == 1 or not max_batches:
            return
        mine = torch.tensor([int(b) if b != float("inf") else -1 for b in max_batches], dtype=torch.int64,
                            device="cpu")
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        comm.host_all_gather(comm.world(), parts, mine, what="strategy.batches")
        per_rank = [p.tolist() for p in parts]
        if any(-1 in p for p in per_rank) or all(p == per_rank[0] for p in per_rank):
            return  # a loader without a length cannot be checked ahead
        raise ConfigError(
            f"trainer.{stage}: the ranks' loaders give different numbers of batches (per rank, per loader: "
            f"{per_rank}); under mode={self.schedule or self.mode!r} every step is a collective over all ranks, so every rank must "
            f"run as many. Lightning's {stage} sampler deals the rows without padding: choose the number of rows N "
            f"and the batch size b so that every rank gets as many batches (with W ranks, ceil(ceil(N/W)/b) == "
            f"ceil(floor(N/W)/b)), or give the loader a sampler that pads, e.g. "
            f"lightning_hetermoe.model.sampling.GlobalOrderSampler(dataset, num_replicas=W, rank=r, shuffle=False, "
            f"drop_last=False) (its padding rows are computed twice)")

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        def default(loss: torch.Tensor) -> torch.Tensor:
            return super(HeterMoEStrategy, self).backward(loss, optimizer, *args, **kwargs)

        with self.backend.stepping():
            out = self.backend.backward(closure_loss, default, self.precision_plugin, self.lightning_module)
        self._grads_synced = False
        return out

    @override
    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        group = self.backend.metrics_group(group) if self.backend is not None else group
        if group is False:  # this rank logs nothing to reduce (an expert rank)
            return tensor
        if isinstance(tensor, torch.Tensor) and dist.is_available() and dist.is_initialized():
            # a logged value reduced over the device side (NCCL takes no CPU tensor)
            comm.check_device_traffic(tensor, "strategy.reduce (self.log with sync_dist=True)")
            if standin.is_standin(tensor):  # gloo gets the CPU memory it holds
                return super().reduce(standin.host_view(tensor).clone(), group=group,
                                      reduce_op=reduce_op).to(tensor.device)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if self.backend is not None:
            self.backend.check_user_collective("self.all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s object on every rank, over the host side: what Lightning and the
        pack broadcast is host metadata (checkpoint paths, the plan, the init seeds, the
        rebalancer's decision at each of its checks), and DDPStrategy's broadcast goes over
        the default group, NCCL on GPUs, staging every pickle through device memory behind
        a host sync."""
        if not comm.configured():
            return super().broadcast(obj, src)  # no group of the pack's yet (or any more)
        return comm.broadcast_object(comm.world(), obj, src, what="strategy.broadcast")

    @override
    def barrier(self, name: str | None = None) -> None:
        """Lightning's barriers (set-up, each checkpoint, teardown) over the host side:
        DDPStrategy's is a collective on the default group, on GPUs an NCCL all-reduce that
        synchronizes the device behind the barrier."""
        if name == "Trainer.save_checkpoint" and self._error_save is not None:
            skipped, self._error_save = bool(self._error_save), None  # the save after an error is over
            if skipped:
                return  # this rank saved nothing: nobody waits for it here
        if not comm.configured():
            return super().barrier(name)  # no group of the pack's yet (or any more)
        comm.host_barrier(comm.world(), what="strategy.barrier")

    @property
    def saving_alone(self) -> bool:
        """A checkpoint is being asked for on this rank alone, while it handles an error (see
        :meth:`_agree_to_save_after_error`): nothing of it may wait for the other ranks."""
        return bool(self._error_save)

    def _agree_to_save_after_error(self) -> None:
        """``OnExceptionCheckpoint`` (or any ``on_exception`` hook that saves) asks for a
        checkpoint while this rank handles an error. Saving takes every rank (experts are
        gathered or written in parts), so it goes ahead only where every rank asks for it
        within a step's bound: they all failed together (a SIGTERM, a Ctrl-C, an error every
        rank raises). A rank that failed alone would wait in the save forever for peers that
        wait in the step it left (under DDP only rank 0 writes, so nobody waits); where a peer
        is gone already (its socket closed) there is nothing to wait for. Either way this rank
        saves nothing, says so, and its error ends the job as before."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._error_save is not None or trainer is None or not trainer.interrupted or not comm.configured():
            return
        error = sys.exc_info()[1]
        if error is not None and lost_peer(error):
            self._error_save = "a peer is gone (its connection closed)"
            return
        timeout = self._outside_step_timeout_s()
        missing = comm.arrive_together(comm.world(), timeout)
        self._error_save = (f"rank(s) {', '.join(map(str, missing))} did not ask for it within {timeout:.0f} s: they "
                            f"are still in the step this rank left") if missing else ""

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A checkpoint's or early stop's agreement, over the host side: a flag on the device
        would be read back behind every kernel queued so far (a host sync)."""
        flag = torch.tensor(int(decision), dtype=torch.int64, device="cpu")
        comm.host_all_reduce(comm.world(), flag, what="strategy.decision")
        return bool(flag == self.world_size) if all else bool(flag)

    # -- gradients ----------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        tail_started: list[float] = []

        def closure_then_sync() -> Any:
            result = closure()
            first = not tail_started
            tail_started.append(time.perf_counter())
            self._sync_grads()
            if first and self._expert_bias is not None:
                # the routers' biases move by the step's load before the update is queued: a
                # collective after it would, on a GPU, wait for every rank's optimizer step
                # (the tail zebra carries into the next step)
                self._expert_bias.update(self._sum_over_ranks)
            return result

        try:
            out = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        finally:
            unfold(optimizer)  # the clip's divisor is this step's only
        if self._sharding is not None:
            self._sharding.share_updates()
        self.clock.step_ended(tail_started[0] if tail_started else None, self.backend.tail_shape())
        self.check_memory(f"in training step {self.lightning_module.trainer.global_step}")
        if self.progress is not None:
            self.progress.finished()
        return out

    def _sync_grads(self) -> None:
        """The gradients summed over the ranks, once after the last backward: in the
        optimizer step, or before it where the user's ``training_step`` clips them (manual
        optimization clips before ``opt.step()``, on gradients each rank still holds alone)."""
        if self._grads_synced:
            return
        self._grads_synced = True
        self.backend.sync_grads(self.lightning_module)
        if self._sharding is not None:
            self._sharding.prepare_grads()

    def _pause_progress(self) -> None:
        if self.progress is not None:
            self.progress.pause()

    def _before_evaluation_batch(self) -> None:
        self._pause_progress()
        # a SIGTERM stops every rank here (a collective: every rank runs every evaluation batch)
        sigterm.before_evaluation_batch(self.lightning_module.trainer, self.world_size)

    def _outside_step_timeout_s(self) -> float:
        """How long an MoE layer run outside a step waits for the other ranks (see
        ``ParallelBackend.guard_outside_step``): a step's bound, as the progress watchdog
        sets it, or the backend's default where the watchdog is off."""
        if self.progress is None:
            return OUTSIDE_STEP_TIMEOUT_S
        return self.progress.bound_s() or self.progress.floor_s

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        # every rank that routes tokens holds part of the global batch; the others add zeros
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return t
        out = t.clone()
        comm.all_reduce(comm.world(), out, what="expert_bias.load")
        return out

    def gradient_norm(self, optimizer: Any) -> torch.Tensor:
        """The L2 norm of the gradients ``optimizer`` steps, over every rank: what one process
        training on the global batch would compute (a dense gradient that several ranks hold
        counted once, an expert's on its holder, a ZeRO shard on its owner), unscaled where
        the loss scale is still on the gradients; inf or nan where any rank's are. A
        collective: every rank calls it at the same point of the step (the gradients
        complete: ``on_before_optimizer_step``). A device tensor: no host sync."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = self._scaled_norm(params)
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.unscaled_norm(optimizer, total) if isinstance(scaler, AgreedGradScaler) else total

    def _scaled_norm(self, params: list) -> torch.Tensor:
        if self._sharding is not None:
            own = [p for p in params if not self._sharding.is_shard(p)]
            return self.backend.grad_sq_norm(self.lightning_module, own,
                                             self._sharding.grad_sq_norm(self.root_device)).sqrt()
        return self.backend.grad_sq_norm(self.lightning_module, params).sqrt()

    def _clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = self._scaled_norm(params)
        scaler = getattr(self.precision_plugin, "scaler", None)
        # the loss scale's divisor joins the clip's where the gradients still carry it
        # (precision.clip_fused_too left them so for a fused step)
        if isinstance(scaler, AgreedGradScaler) and step_takes_scale(optimizer) and scaler.holds_scaled(optimizer):
            return scaler.unscale_in_step_(optimizer, total, clip_val)
        # a loss scaler sets the step's own divisor (to none, once it has unscaled)
        clip_(optimizer, [p.grad for p in params], total, clip_val, fold=scaler is None)

    # -- placement while training runs (the rebalancer's API) ----------------------------
    @property
    def placement(self) -> Placement | None:
        """Where experts live now (``None`` when they are not spread over ranks)."""
        if self.backend is None or not self.backend.spread:
            return None
        return self.backend.placement()

    @property
    def trained_placement(self) -> Placement | None:
        """Where the experts are, or, once a fit is over and the model whole again, where they
        were when it ended (a rebalancer's moves included: not the plan's placement);
        ``None`` where they were never spread over ranks."""
        now = self.placement
        return now if now is not None else self._placement_at_end

    def holders(self) -> list[str]:
        """Device names of the ranks that can hold experts, in the placement's holder order."""
        return self.backend.holder_devices() if self.backend is not None else []

    def copy_routing(self) -> tuple[str, list[float], list[int] | None] | None:
        """Where the placement may carry routes (expert parallelism, over one EP group or
        several alike ones: the same devices, batch shares and node pattern rank by rank):
        the replica dispatch rule, each holder's share of its group's batch and each
        holder's node (``None``: one node). ``None`` elsewhere."""
        return self.backend.copy_routing() if self.backend is not None else None

    def move_experts(self, new: Placement) -> int:
        """Move experts to ``new`` at a step boundary, on every rank (a collective: every
        rank passes the same placement). Weights and every per-parameter optimizer tensor
        travel with their expert, and so does each weight-averaging callback's average of it.
        Returns the expert copies that moved."""
        module = self.lightning_module
        carried = averages(module.trainer, module)
        moved = ExpertState(self.backend, module).move(new, self.optimizers, [a for _, a, _ in carried])
        for callback, average, state in carried:
            load_average(module.trainer, module, callback, average, state)
        self._average_bytes = average_bytes(module.trainer, module, self.root_device)
        return moved

    def predict(self, placement: Placement | None = None, expert_load: list[list[float]] | None = None,
                batch_loads: list[list[list[float]]] | None = None) -> dict[str, Any] | None:
        """The simulator's step of this run (``step_time_s`` in wall seconds, scaled like
        the emulated clock; ``device_step_time_s`` on the devices), with another
        ``placement`` and measured ``expert_load`` (per layer, each expert's share) or
        ``batch_loads`` (several steps' routing, the step averaged over them) if given;
        ``None`` without a cluster config or before set-up."""
        if self.backend is None:
            return None
        return self.clock.predict(self.backend.simulated(placement), expert_load, batch_loads)

    @property
    def num_microbatches(self) -> int | None:
        """R of the running schedule (zebra, distep), else ``None``."""
        return self.backend.num_microbatches if self.backend is not None else None

    # -- timing -------------------------------------------------------------------------
    def rank_busy(self) -> dict[str, float] | None:
        """This rank's time in the last training step by kind: ``attention`` and ``experts``
        (compute), ``comm`` (transfers; under zebra on real devices the exchange waited on
        with no task running, under emulation the modelled transfers, which overlap
        compute), ``idle``."""
        if self.clock.last_step_s is None or self.backend is None:
            return None
        # a backend's own task spans are device time: set against the step on that clock
        return self.backend.busy(self.clock.device_step_s()) or self.clock.busy()

    def emulation_report(self) -> dict[str, Any] | None:
        """Every rank's clock summary, gathered (a collective: call it on every rank)."""
        mine = self.clock.emulation_summary()
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [mine]} if mine else None
        everyone = comm.gather_objects(comm.world(), mine, what="strategy.emulation_report")
        if all(e is None for e in everyone):
            return None
        tasks = sum(e["padded_tasks"] for e in everyone if e)
        overruns = sum(e["overruns"] for e in everyone if e)
        # the worst rank's slip against its own modelled time: ranks run side by side, so how
        # far the slowest clock stretched is what the step time can have absorbed
        slip = max((e["slip_s"] / e["modelled_s"] for e in everyone if e and e["modelled_s"] > 0), default=0.0)
        return {"ranks": everyone, "padded_tasks": tasks, "overruns": overruns,
                "overrun_fraction": overruns / tasks if tasks else 0.0, "slip_fraction": slip}

    # -- placement-independent state ------------------------------------------------------
    @property
    def sharded_checkpoints(self) -> bool:
        """Checkpoints are directories every rank writes its part of (``checkpoint_format``;
        ``auto``: decided at the first set-up, see :meth:`_checkpoint_sharded`)."""
        return self._saves_sharded and self.backend is not None

    def _checkpoint_sharded(self) -> bool:
        """``checkpoint_format`` resolved (:meth:`.StrategyArguments.saves_sharded`; ``auto``:
        by the whole training state), counted from the model as built, before any rank keeps
        only its share: every rank decides alike. A small model gets Lightning's single file
        (``load_from_checkpoint`` reads it) and keeps its optimizer state whole."""
        return self.args.saves_sharded(sum(p.numel() for p in self.lightning_module.parameters()))

    def _sharded_state(self) -> ShardedState:
        return ShardedState(self.lightning_module, self.backend.expert_pieces, self.backend.holds_dense,
                            self.backend.stripped_shapes(), self._sharding)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # the first of the strategy's parts of a checkpoint (Lightning's dump_checkpoint)
        self._agree_to_save_after_error()
        if self.saving_alone:
            return {}
        if self.backend is None:
            return self.lightning_module.state_dict()
        if self.sharded_checkpoints:
            return self._sharded_state().module_state()
        return ExpertState(self.backend, self.lightning_module).module_state()

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self.saving_alone:
            return {}
        if self.sharded_checkpoints:
            return self._sharded_state().optimizer_state(optimizer)
        state = super().optimizer_state(optimizer)
        return ExpertState(self.backend, self.lightning_module).gathered_optimizer_state(state, optimizer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # the layout (which rank holds what) decides what each rank reads
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._loaded_sharded  # a sharded load filled the optimizers already

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path), src=0)
        self._check_every_rank_sees(path)
        self._loaded_sharded = is_sharded_checkpoint(path)
        # another model's checkpoint is named before a tensor is read into this one
        model = self._sharded_state().shapes_meta()
        strict, what = self.lightning_module.strict_loading, f"ckpt_path={path!r}"
        if not self._loaded_sharded:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
                raise CheckpointFormatError(f"{what} is not a Lightning checkpoint (it holds no state_dict)")
            saved = {n: t.shape for n, t in checkpoint["state_dict"].items() if torch.is_tensor(t)}
            check_same_model(saved, model, strict, what)
            return checkpoint
        meta = read_meta(path)
        check_same_model(meta["hetermoe"]["shapes"], model, strict, what)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting:  # the optimizers load here, before Lightning restores the callbacks
            if "optimizers" not in meta["hetermoe"]:
                raise KeyError(WEIGHTS_ONLY_RESUME)  # Lightning's words for its own file, before any tensor is read
            restore_finetuning_groups(self.lightning_module.trainer, self.lightning_module, meta.get("callbacks") or {})
        loaded = self._sharded_state().load(path, meta, self.optimizers if fitting else [], comm.world().host,
                                            strict=self.lightning_module.strict_loading, with_optimizers=fitting,
                                            with_current=fitting and bool(averagers(self.lightning_module.trainer
                                                                                    .callbacks)))
        self.check_memory(f"loading checkpoint {path}")
        return loaded

    @staticmethod
    def _check_every_rank_sees(path: str) -> None:
        """Every rank reads the checkpoint: one that has no such path (a node's own disk, a
        relative path from another working directory) would fail alone, its peers waiting
        in the load's next collective. Refused on every rank at once, naming the ranks."""
        if "://" in path:
            return  # a remote file system's URL: fsspec's to open, alike everywhere
        missing = [r for r, sees in enumerate(comm.gather_objects(comm.world(), os.path.exists(path),
                                                                  what="strategy.checkpoint.sees")) if not sees]
        if not missing:
            return
        if len(missing) == comm.world().size:
            raise ConfigError(f"ckpt_path={path!r} is invalid: no such file or directory{unfinished_note(path)}")
        raise ConfigError(f"ckpt_path={path!r} is invalid: rank(s) {missing} do not see it (no such file or "
                          f"directory there), and every rank reads its part: resume from a checkpoint {_SHARED_PATH}")

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self._loaded_sharded:
            return  # loaded in place by load_checkpoint
        experts = ExpertState(self.backend, self.lightning_module)
        loaded = experts.load_module_state(checkpoint["state_dict"], strict)
        if saved_with_average(checkpoint):
            # the averaging callback loads both into tensors laid out as the module is (the
            # average's part is what the module just loaded: cut once)
            checkpoint["state_dict"] = loaded
            checkpoint["current_model_state"] = experts.local_state(checkpoint["current_model_state"])

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        restore_finetuning_groups(self.lightning_module.trainer, self.lightning_module)
        experts = ExpertState(self.backend, self.lightning_module)
        states = list(checkpoint["optimizer_states"])
        for i, optimizer in enumerate(self.optimizers):
            if self._sharding is not None:  # a full file into optimizer state sharded over replicas
                states[i] = self._sharding.shard_full_state(states[i], optimizer)
            experts.slice_optimizer_state(states[i], optimizer)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.saving_alone:
            print(f"[hetermoe] rank {self.global_rank} ({self.describe_rank(self.global_rank)}) did not save "
                  f"{filepath}: it was asked for while this rank handled its error, and {self._error_save} (a "
                  f"checkpoint takes every rank)", file=sys.stderr, flush=True)
            return
        self._pause_progress()
        if self.backend is None:
            return
        # what an offline export to Hugging Face needs (python -m lightning_hetermoe.convert to-hf)
        info = {"version": FORMAT_VERSION, "hf": export_info(self.lightning_module)}
        averaged = saved_with_average(checkpoint)  # the average stands in state_dict, as this rank holds it
        if not self.sharded_checkpoints:
            if averaged:
                whole = ExpertState(self.backend, self.lightning_module).module_state(checkpoint["state_dict"])
                checkpoint = {**checkpoint, "state_dict": whole}
            if self.backend.writes_checkpoints(self.global_rank):
                self.checkpoint_io.save_checkpoint({**checkpoint, "hetermoe": info}, filepath,
                                                   storage_options=storage_options)
            return
        # Written under a hidden name beside the checkpoint and swapped in whole once every
        # rank's pieces and the meta are there: a save cut short (a node lost, a second
        # SIGTERM) leaves the checkpoint of that name as it was, where writing into it would
        # leave new pieces beside the old meta. Rank 0 names both, every rank writes there.
        path, staged = (Path(p) for p in self.broadcast((str(filepath), str(partial_sibling(filepath))), src=0))
        writer = self.backend.writes_checkpoints(self.global_rank)
        made = missing_parents(staged) if writer else []
        if writer:
            self._remove_stale(path)  # a save of this name killed before its end, an old copy left
            staged.mkdir(parents=True)
        # Every rank writes its pieces into the directory the writer made. A rank that cannot
        # see it (a disk of its node's own, a relative path from another working directory)
        # would write them into a directory of its own, and the checkpoint would lack them.
        comm.host_barrier(comm.world(), what="strategy.checkpoint.mkdir")
        seen = comm.gather_objects(comm.world(), (staged.is_dir(), writer), what="strategy.checkpoint.sees")
        saved = False
        try:
            blind = [r for r, (sees, _) in enumerate(seen) if not sees]
            if blind:
                made_by = next(r for r, (_, w) in enumerate(seen) if w)
                raise ConfigError(
                    f"the sharded checkpoint {path} cannot be saved: rank(s) {blind} do not see the directory rank "
                    f"{made_by} made for it ({staged}), and every rank writes its part there: save checkpoints "
                    f"{_SHARED_PATH}")
            self._save_sharded(checkpoint, staged, writer, averaged, info)
            left = replace_directory(staged, path) if writer else None  # a full checkpoint of the name goes too
            saved = True
            if left is not None:  # saved all the same: training goes on, and the disk it holds is named
                old, err = left
                print(f"[hetermoe] saved {path}; its earlier copy, now {old}, could not be removed "
                      f"({err.strerror or err}): the next save of {path.name} removes it, or remove it by hand",
                      file=sys.stderr, flush=True)
            elif writer:
                self._remove_stale(path)  # an earlier copy kept while the checkpoint was missing
        finally:
            if writer and not saved and staged.exists():
                shutil.rmtree(staged, ignore_errors=True)
            if not saved:
                remove_empty(made)  # the directories made for a checkpoint that is not there
        self.check_memory(f"saving checkpoint {path}")

    @staticmethod
    def _remove_stale(path: Path) -> None:
        for p in remove_stale(path):
            what = (f"an earlier copy of {path.name}, replaced" if is_earlier_copy(p, path)
                    else f"a save of {path.name} that did not finish")
            print(f"[hetermoe] removed {p}: {what}", file=sys.stderr, flush=True)

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path, writer: bool, averaged: bool,
                      info: dict[str, Any]) -> None:
        """Every rank's pieces of ``checkpoint`` into the directory ``path``, and its meta."""
        sharded = self._sharded_state()
        state = checkpoint.pop("state_dict")
        tensors = {f"state_dict.{n}": v for n, v in (sharded.module_state(state) if averaged else state).items()}
        if averaged:
            tensors.update({f"current_model_state.{n}": v for n, v in checkpoint.pop("current_model_state").items()})
        # ModelCheckpoint(save_weights_only=True) leaves the optimizers out: their meta says
        # so by its absence, as the missing key does in Lightning's file
        weights_only = "optimizer_states" not in checkpoint
        optimizers = []
        for i, opt in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors.update({f"optimizer_states.{i}.{n}": v for n, v in opt["tensors"].items()})
            optimizers.append(opt["meta"])
        save_pieces(tensors, path, process_group=comm.world().host)
        if writer:
            checkpoint["hetermoe"] = {**info, "shapes": sharded.shapes_meta(),
                                      **({} if weights_only else {"optimizers": optimizers})}
            torch.save(checkpoint, path / META_FILE)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.backend is not None and self.backend.writes_checkpoints(self.global_rank):
            try:
                self.checkpoint_io.remove_checkpoint(filepath)  # a file or a sharded directory
            except OSError as err:
                # a checkpoint ModelCheckpoint no longer keeps (save_top_k): one the file system
                # will not let go of (a network file system's busy file) is not worth the run,
                # whose other ranks would wait on this one in their next collective
                print(f"[hetermoe] could not remove {filepath}, a checkpoint no longer kept "
                      f"({err.strerror or err}): training goes on; remove it by hand", file=sys.stderr, flush=True)

    # -- the end ------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        peer_gone = lost_peer(exception)
        who = f"[hetermoe] rank {self.global_rank} ({self.describe_rank(self.global_rank)})"
        if isinstance(exception, SIGTERMException):  # a preemption, not a fault: every rank stops alike
            print(f"{who} stopped: the job got SIGTERM, and every rank stops before its next batch",
                  file=sys.stderr, flush=True)
        elif not peer_gone and not isinstance(exception, (KeyboardInterrupt, ConfigError)):
            # (a bad value is the user's, met alike on every rank: the command says it once)
            print(f"{who} failed: {type(exception).__name__}: {exception}", file=sys.stderr, flush=True)
        # A peer's death surfaces here as a gloo "connection closed/reset": name the peer (its
        # socket closes a moment before its process is reaped). This rank's own error has no
        # dead peer to wait for: it only checks, and the job ends without a pause.
        report = getattr(self._launcher, "report_dead_children", None)
        if report is not None and not isinstance(exception, ConfigError):  # (its ranks all end on it)
            report(wait_s=3.0 if peer_gone else 0.0)
        failure_in_hand()  # (a rank observer leaves the job's end, and what it says, to this thread)
        heartbeat.mark_failed()  # at exit this rank goes silent to its peers, not "finished"
        super().on_exception(exception)

    def shutdown(self) -> None:
        """End of the job: every rank stops and joins its heartbeat, leaves the process group
        together, and rank 0 waits for the ranks it launched. A daemon thread left inside a
        store call when the interpreter finalizes aborts the process (exit 134: the unwind
        of CPython's ``pthread_exit`` meets a noexcept C++ frame); ``stop`` joins it first."""
        heartbeat.stop()
        if dist.is_available() and dist.is_initialized():
            comm.host_barrier(comm.world(), what="strategy.shutdown")
            dist.destroy_process_group()
            comm.forget()
        for proc in getattr(self._launcher, "procs", []):
            proc.wait(timeout=120)
        stop_watching()

    @override
    def teardown(self) -> None:
        # After a successful run every rank holds a model built whole again, so the user's
        # module (and the spawn launcher's returned weights) are complete and usable anywhere.
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        succeeded = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if self.backend is not None:
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                # before the experts gather: what the run trained with (a validation or test
                # after it lays them out from the plan again, and is not what trained)
                self._placement_at_end = self.placement
            # a model built whole is whole again after a successful run; one built on the meta
            # device stays laid out (it may not fit anywhere whole): checkpoints save it sharded
            whole = succeeded and self._built_whole
            experts = ExpertState(self.backend, module) if whole and self.optimizers else None
            # the optimizer follows the model: each expert's moments gathered while laid out
            gathered = experts.gather_optimizer_states(self.optimizers) if experts is not None else []
            writer = None if self.backend.dense_on_every_rank else \
                next(r for r in range(self.world_size) if self.backend.writes_checkpoints(r))
            averages_back = made_whole(trainer, module, ExpertState(self.backend, module).module_state, writer,
                                       set(expert_tensor_names(module))) if whole else None
            self.backend.restore(module, gather=whole)
            if experts is not None:
                experts.adopt_whole(gathered, self._whole_optimizer_names)
                experts.follow_module(self.optimizers, self._whole_optimizer_names)
            if averages_back is not None:
                averages_back()
        if self._expert_bias is not None:
            self._expert_bias.remove()
            self._expert_bias = None
        watch_launcher(armed=False)
        # a script that never calls shutdown() (Trainer.fit in a user's script, LightningCLI)
        # still leaves the heartbeat, the watchers and the process group before finalization
        register_exit_hook()
        self.gc.stop()  # a failed run's too
        super().teardown()


__all__ = ["HeterMoEStrategy", "MODES"]


def trainable(module: torch.nn.Module) -> frozenset[int]:
    """The parameters of ``module`` that take a gradient (by identity)."""
    return frozenset(id(p) for p in module.parameters() if p.requires_grad)


def restore_finetuning_groups(trainer: Any, module: Any, states: dict[str, Any] | None = None) -> None:
    """The parameter groups a fine-tuning callback (Lightning's ``BaseFinetuning``) added
    before the checkpoint, back in the optimizers before their state loads. The callback
    puts them back in its ``on_fit_start`` once its state is restored; the strategy restores
    after set-up (the layout decides what each rank reads), after ``on_fit_start`` ran with
    nothing to restore, so its hook runs again here, where it has (it acts once per restore).
    ``states``: the checkpoint's callback states, for a load that comes before Lightning
    restores the callbacks (a sharded checkpoint fills the optimizers as it loads)."""
    import copy

    from lightning.pytorch.callbacks import BaseFinetuning

    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning):
            if states is not None and callback.state_key in states:
                callback.load_state_dict(copy.deepcopy(states[callback.state_key]))
            callback.on_fit_start(trainer, module)
