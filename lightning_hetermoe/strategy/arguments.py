"""The strategy's arguments, checked the moment they are given and again once the world is
known (before any process starts): every error names the field and what would be valid.

The arguments themselves import neither Lightning nor torch (the main job's recipe checks
its strategy group before they load, in a fraction of the seconds they take); the checks of
a model or a trainer's callbacks import what they read where they run."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cluster import ClusterConfig
from ..cluster.devices import PRECISIONS, check_bf16
from ..configs import ConfigError, OptimConfig, from_cfg
from ..profile import memory
from ..routing_record import load_record

if TYPE_CHECKING:
    import torch

MODES = ("auto", "ep", "zebra", "distep", "datacentric")
DISAGGREGATED = ("zebra", "distep")
# the modes that train a model without MoE layers, as plain DDP (check_dense)
DENSE_MODES = ("auto", "ep", "datacentric")
BATCH_SPLITS = ("equal", "speed")
REPLICA_DISPATCH = ("local_first", "even")  # lightning_hetermoe.copy_routing.RULES
CHECKPOINT_FORMATS = ("auto", "sharded", "full")


def load_plan(plan: Any):
    """A Plan from a Plan, its dict, or the path of a ``plan.json``; ``None`` stays ``None``."""
    from ..plan import Plan

    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        try:
            return Plan.from_dict(plan)
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"strategy plan is not a valid plan dict (Plan.to_dict()'s form): {err}") from None
    if isinstance(plan, (str, Path)):
        path = Path(plan)
        if not path.is_file():
            raise ConfigError(f"strategy plan={str(plan)!r} is invalid: expected a Plan, its dict, or the path of a "
                              f"plan.json (written by recipes/plan.py or a zebra run); no such file")
        try:
            return Plan.from_dict(json.loads(path.read_text()))  # (from_json would name the file again)
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
    try:
        return Profile.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as err:  # (json's decode error is a ValueError)
        raise ConfigError(f"strategy profile={str(profile)!r} is not a profile JSON (recipes/profile_devices.py "
                          f"writes one): {err}") from None


def _cluster_mapping(cluster: Any) -> Any:
    """A cluster config is a ClusterConfig or a mapping of its fields; anything else (a
    config group's name, a list of devices) is named here, not by the dataclass builder."""
    from collections.abc import Mapping

    from omegaconf import DictConfig

    if isinstance(cluster, (ClusterConfig, Mapping, DictConfig)):
        return cluster
    raise ConfigError(f"strategy cluster={cluster!r} is invalid: expected a ClusterConfig or its dict, e.g. "
                      f"{{'name': 'mix', 'devices': ['a40', 'v100']}} (the recipe's cluster=<name> loads "
                      f"conf/cluster/<name>.yaml into one)")


def _positive_int(name: str, value: Any, hint: str = "") -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"strategy {name}={value!r} is invalid: must be an integer >= 1{hint}")


@dataclass
class StrategyArguments:
    """What the user asked for (``mode="auto"`` is resolved at set-up, see :mod:`.selection`)."""

    mode: str = "auto"
    plan: Any = None
    cluster: ClusterConfig | dict | None = None
    expert_parallel_size: int | str | None = None  # ranks per EP group; "auto": the fastest the clock prices
    batch_split: str = "equal"
    replica_dispatch: str = "local_first"
    num_microbatches: int | None = None
    asym_ea: bool = True
    require_expert_ranks: bool = False
    profile: Any = None
    expert_load: Any = None
    # choose which expert goes where at the planning routing (counts are Asym-EA's): None
    # (auto) where that routing is a record (expert_load), not a fresh router's warm-up
    place_at_load: bool | None = None
    heartbeat_timeout_s: float | None = 30.0
    progress_timeout_s: float | None = 300.0
    allow_emulated_bf16: bool = False
    checkpoint_format: str = "auto"
    shard_optimizer_state: bool = True
    gc_every_n_steps: int | None = 50

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"strategy mode={self.mode!r} is invalid: must be one of {MODES}")
        self.plan = load_plan(self.plan)
        self.profile = load_profile(self.profile)
        if self.expert_load is not None:
            self.expert_load = load_record(self.expert_load, "strategy expert_load")
        self.cluster = None if self.cluster is None else from_cfg(ClusterConfig, _cluster_mapping(self.cluster),
                                                                  "cluster")
        if self.plan is not None and self.mode == "ep":
            raise ConfigError("strategy plan is used by mode='zebra', 'distep' and 'auto'; mode='ep' places experts "
                              "evenly and takes no plan")
        if self.plan is not None and self.mode == "auto" and self.plan.schedule not in DISAGGREGATED:
            raise ConfigError(f"strategy plan: its schedule {self.plan.schedule!r} is not one a plan runs "
                              f"({DISAGGREGATED}); set mode explicitly")
        if self.expert_parallel_size != "auto":
            _positive_int("expert_parallel_size", self.expert_parallel_size, " or 'auto' (the fastest group size the "
                          "run's clock prices)")
        if self.expert_parallel_size is not None and self.mode != "ep":
            raise ConfigError("strategy expert_parallel_size is for mode='ep' (auto, zebra and distep take their "
                              "groups from the plan)")
        if self.batch_split not in BATCH_SPLITS:
            raise ConfigError(f"strategy batch_split={self.batch_split!r} is invalid: must be one of {BATCH_SPLITS}")
        if self.batch_split == "speed" and self.mode != "ep":
            raise ConfigError("strategy batch_split='speed' is for mode='ep'; zebra and distep split the batch as "
                              "their plan says, and mode='auto' weighs the speed split itself")
        if self.replica_dispatch not in REPLICA_DISPATCH:
            raise ConfigError(f"strategy replica_dispatch={self.replica_dispatch!r} is invalid: must be one of "
                              f"{REPLICA_DISPATCH}")
        _positive_int("num_microbatches", self.num_microbatches, " (or null: the planner chooses)")
        _positive_int("gc_every_n_steps", self.gc_every_n_steps, " (or null: Python collects automatically)")
        if self.num_microbatches is not None and self.mode == "ep":
            raise ConfigError("strategy num_microbatches is for mode='zebra', 'distep' and 'auto'")
        self.asym_ea = bool(self.asym_ea)
        if self.place_at_load is not None and not isinstance(self.place_at_load, bool):
            raise ConfigError(f"strategy place_at_load={self.place_at_load!r} is invalid: must be true, false or null "
                              f"(null: true where strategy expert_load is given)")
        if self.place_at_load and self.mode in ("ep", "datacentric"):
            raise ConfigError(f"strategy place_at_load is for mode='zebra', 'distep' and 'auto' (a plan's placement); "
                              f"mode={self.mode!r} runs no plan: ExpertRebalancer moves experts at measured loads")
        if self.place_at_load and self.plan is not None:
            raise ConfigError("strategy place_at_load plans the placement, and strategy plan gives one: the given "
                              "plan runs as written (plan at a routing with recipes/plan.py plan.expert_load=...)")
        self.require_expert_ranks = bool(self.require_expert_ranks)
        self.allow_emulated_bf16 = bool(self.allow_emulated_bf16)
        self.shard_optimizer_state = bool(self.shard_optimizer_state)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ConfigError(f"strategy checkpoint_format={self.checkpoint_format!r} is invalid: must be one of "
                              f"{CHECKPOINT_FORMATS} ('sharded': a directory every rank writes its part of; 'full': "
                              f"one file with every tensor gathered into the first rank, for small models; 'auto': "
                              f"'full' up to {memory.SMALL_STATE_BYTES / 1e9:g} GB of training state, 'sharded' above)")
        t = self.heartbeat_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ConfigError(f"strategy heartbeat_timeout_s={t!r} is invalid: must be a number of seconds > 0 (or "
                              f"null: no silent-rank detection)")
        t = self.progress_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ConfigError(f"strategy progress_timeout_s={t!r} is invalid: must be a number of seconds > 0 (or "
                              f"null: no stuck-step detection)")

    @property
    def emulated(self) -> bool:
        return self.cluster is not None and self.cluster.emulate

    @property
    def vendors(self) -> list[str] | None:
        """Each rank's vendor, from the cluster config or else the plan's devices (``None``:
        neither names them; one vendor). Known before any process starts, as it must be:
        a job mixing vendors needs a gloo default group (see :mod:`lightning_hetermoe.comm`)."""
        if self.cluster is not None:
            return [spec.vendor for spec in self.cluster.specs()]
        if self.plan is not None:
            from ..cluster.devices import get_device

            try:
                return [get_device(name).vendor for name in self.plan.devices]
            except ValueError:
                return None  # a plan made for custom devices: the cluster config names their vendors
        return None

    @property
    def mixes_vendors(self) -> bool:
        return len(set(self.vendors or ())) > 1

    @property
    def fixed_ep_size(self) -> int | None:
        """The EP group size asked for as a number (``None``: the world's, or ``"auto"``'s,
        chosen at set-up)."""
        return None if self.expert_parallel_size == "auto" else self.expert_parallel_size

    # -- once the world is known --------------------------------------------------------
    def check_world(self, world_size: int, precision: str = "32-true") -> None:
        cluster, plan = self.cluster, self.plan
        if precision not in PRECISIONS:
            # every mode prices its compute and its traffic at the precision's width (DDP's
            # 64-true, transformer-engine's fp8, bitsandbytes' weights have none here)
            raise ConfigError(f"trainer precision={precision!r} is invalid under strategy='hetermoe': must be one of "
                              f"{PRECISIONS}")
        if cluster is not None:
            check_bf16(precision, cluster.specs(), self.allow_emulated_bf16)
        if cluster is not None and cluster.world_size != world_size:
            raise ConfigError(f"cluster '{cluster.name}' names {cluster.world_size} devices but the trainer runs "
                              f"{world_size} processes: set trainer devices*num_nodes={cluster.world_size}")
        ep = self.fixed_ep_size or world_size
        if world_size % ep:
            raise ConfigError(f"strategy expert_parallel_size={ep} is invalid: must divide the world size {world_size}")
        if self.batch_split == "speed" and cluster is None:
            raise ConfigError("strategy batch_split='speed' needs a cluster config naming each rank's device")
        if self.mode in DISAGGREGATED and world_size < 2 and plan is None:
            # (a given one-rank plan is a loop-back: its attention rank holds every expert)
            raise ConfigError(f"strategy mode={self.mode!r} needs at least 2 ranks (attention and experts), the "
                              f"trainer runs {world_size}; mode='auto' trains one device as a plain single device")
        if plan is not None and plan.world_size != world_size:
            raise ConfigError(f"the plan is for {plan.world_size} ranks, the trainer runs {world_size}")
        if plan is not None and cluster is not None and list(plan.devices) != [d.name for d in cluster.specs()]:
            raise ConfigError(f"the plan is for devices {plan.devices}, cluster '{cluster.name}' names "
                              f"{cluster.devices}")

    def check_nodes(self, num_nodes: int, per_node: int) -> None:
        """A cluster of nodes runs as Lightning's nodes: as many, each with its devices
        (Lightning starts the same number of processes on every node)."""
        cluster = self.cluster
        if cluster is None or not cluster.nodes or (cluster.emulate and num_nodes == 1):
            return  # an emulated cluster of nodes is played by the processes of one machine
        counts = [len(n.devices) for n in cluster.nodes]
        if num_nodes != cluster.num_nodes or any(c != per_node for c in counts):
            raise ConfigError(f"cluster '{cluster.name}' has {cluster.num_nodes} nodes of {counts} devices but the "
                              f"trainer runs num_nodes={num_nodes} x devices={per_node}: set trainer "
                              f"num_nodes={cluster.num_nodes}" + (f" and devices={counts[0]}" if len(set(counts)) == 1
                                                                  else "; Lightning runs as many processes on every "
                                                                       "node, so give every node as many devices"))

    def check_callbacks(self, callbacks: list, model: Any, world_size: int, fitting: bool,
                        schedule: str | None = None, ep_size: int | None = None) -> None:
        """``schedule`` and ``ep_size``: what set-up chose (``None``: before it, what was asked for).

        Lightning's ``StochasticWeightAveraging`` copies the whole module in its
        ``setup``, before the strategy lays it out over the ranks, and checkpoints that copy
        inside its own callback state, where no layout can be told apart: its first average
        would pair a rank's share with the whole model's tensors and fail, after however
        long the run trained. Refused before any of it, as Lightning refuses it under FSDP
        and DeepSpeed. ``WeightAveraging`` and ``EMAWeightAveraging`` (Lightning's newer
        averaging, the average in the checkpoint's ``state_dict``) work: the strategy takes
        their copy again from the laid-out module (:mod:`.averaging`), but not from a model
        built on the meta device: Lightning runs their set-up before the strategy's, and a
        copy of meta tensors fails there."""
        if not fitting:
            return  # they average only in fit
        from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

        from ..materialize import built_on_meta
        from ..model_contract import moe_layers

        averaging = [type(cb).__name__ for cb in callbacks if isinstance(cb, WeightAveraging)]
        if averaging and built_on_meta(model):
            raise ConfigError(f"{averaging[0]} copies the model in its set-up, which Lightning runs before the "
                              f"strategy materialises a model built on the meta device: its copy would hold no "
                              f"weights. Build the model whole (the main job: init_on_meta=false; "
                              f"Trainer.init_module() without empty_init=True), or remove the callback")
        if world_size < 2 or not moe_layers(model):
            return  # one rank holds the whole model; a dense model trains as DDP
        for cb in callbacks:
            if isinstance(cb, StochasticWeightAveraging):
                raise ConfigError(
                    f"{type(cb).__name__} does not work under HeterMoEStrategy on {world_size} ranks: it keeps a "
                    f"copy of the whole model taken before the strategy spreads the experts (and, under zebra, the "
                    f"dense weights) over the ranks, and checkpoints it in its own state, so its averages cannot "
                    f"follow what each rank holds (Lightning refuses it under FSDP and DeepSpeed alike). Use "
                    f"lightning.pytorch.callbacks.WeightAveraging (an equal-weight average, as SWA's) or "
                    f"EMAWeightAveraging, which work here, or train on one process")
        from lightning.pytorch.callbacks import ModelPruning

        for cb in callbacks:
            if isinstance(cb, ModelPruning):
                self._check_pruning(cb, model, world_size, schedule or self.mode,
                                    ep_size if schedule else self.fixed_ep_size)

    def _check_pruning(self, cb: Any, model: Any, world_size: int, schedule: str, ep_size: int | None) -> None:
        """Lightning's ``ModelPruning`` prunes each tensor where the rank holds it, renames it
        (``weight`` becomes ``weight_orig`` and a mask) and, for its lottery tickets, copies
        each pruned module in its set-up, before the strategy lays the model out. A tensor
        every rank holds whole prunes as in one process (tested under ep and data-centric);
        one a rank holds a share of, or none of, fails when the fit ends, after however long
        the run trained. Refused before any of it."""
        from ..model_contract import moe_layers

        if schedule in DISAGGREGATED:
            raise ConfigError(
                f"ModelPruning does not work under strategy mode={schedule!r} on {world_size} ranks: the expert ranks "
                f"hold none of the dense weights it prunes, and the strategy lays the weights out by the names "
                f"pruning renames. Prune under mode='ep' or 'datacentric' (every rank holds the dense weights whole), "
                f"or prune the trained model in one process")
        if schedule == "auto" or (ep_size == 1 and schedule in ("ep", "ep_balanced")):
            return  # set-up checks what it chose; EP groups of one rank hold every expert whole
        experts = {id(m) for _, layer in moe_layers(model) for m in layer.experts.modules()}
        # Lightning keeps what it prunes in private fields: what was given (before its set-up,
        # [] for every weight and bias) or, after, the list its set-up made of it
        given = getattr(cb, "_parameters_to_prune", None) or []
        names = getattr(cb, "_parameter_names", None) or cb.PARAMETER_NAMES
        targets = cb.filter_parameters_to_prune(cb.sanitize_parameters_to_prune(model, given, parameter_names=names))
        sharded = sorted({name for name, m in model.named_modules() if id(m) in experts
                          for module, _ in targets if module is m})
        if sharded:
            raise ConfigError(
                f"ModelPruning does not work on the experts under HeterMoEStrategy on {world_size} ranks: each rank "
                f"holds a share of each layer's experts, so it would pick a mask from its share (and its lottery "
                f"tickets copy the whole experts before the strategy lays them out). It was given "
                f"{', '.join(sharded[:3])}{' and more' if len(sharded) > 3 else ''}: prune the dense weights only "
                f"(parameters_to_prune without the experts' modules), or prune the trained model in one process")

    def check_model(self, model: Any, device: torch.device, world_size: int = 1) -> None:
        """Everything about the model that can be checked before processes start."""
        from ..model_contract import ModelContractError, describe_model, moe_layers

        if getattr(model, "_compiler_ctx", None):  # Lightning's mark on a module it took from torch.compile
            raise ConfigError(
                "HeterMoEStrategy does not train a torch.compile'd LightningModule: the strategy swaps each MoE "
                "layer's dispatcher after compile has traced it, and zebra runs each (layer, micro-batch) as its own "
                "autograd task on several threads, which one compiled graph cannot follow. Pass the module itself; "
                "compile parts inside it that hold no MoE layer (an attention block: block.attn = "
                "torch.compile(block.attn)); the experts already run fused kernels")
        try:
            layers = moe_layers(model)
            if not layers and _builds_in_configure_model(model):
                return  # its layers come at set-up, on the meta device
            if not layers:
                self.check_dense(type(model).__name__)  # set-up says it trains as DDP
                return
            if self.mode in DISAGGREGATED and not getattr(model, "automatic_optimization", True):
                raise ConfigError(f"strategy mode={self.mode!r} runs each micro-batch's backward itself and "
                                  f"{type(model).__name__} sets automatic_optimization=False: use mode='ep' (or "
                                  f"'auto'), or automatic optimization")
            # what plans or times the run reads the model's shape (auto plans over several ranks)
            if self.emulated or self.batch_split == "speed" or self.mode in DISAGGREGATED or (
                    self.mode == "auto" and world_size > 1):
                describe_model(model)
        except ModelContractError as err:
            raise ConfigError(str(err)) from None
        from ..kernels import why_not

        for name, layer in layers:
            problem = why_not(layer.experts.backend, device)
            if problem:
                raise ConfigError(f"{problem} (layer {name})")


    def saves_sharded(self, params: int) -> bool:
        """Checkpoints of a model of ``params`` parameters are sharded directories:
        ``checkpoint_format`` says so, or ``auto`` finds the training state not small
        (:func:`~lightning_hetermoe.profile.memory.small_training_state`: the line
        ``init_on_meta: auto`` draws). Optimizer state is sharded over replicas only then."""
        if self.checkpoint_format == "auto":
            return not memory.small_training_state(params)
        return self.checkpoint_format == "sharded"

    def check_dense(self, name: str) -> None:
        """A model without MoE layers (``name``: its class) trains as plain DDP in the modes
        that can run it (:data:`DENSE_MODES`); the rest is refused in one sentence."""
        what = f"{name} holds no lightning_hetermoe.MoELayer"
        if self.mode in DISAGGREGATED:
            raise ConfigError(f"strategy mode={self.mode!r} splits each step at the MoE layers' experts and {what}: "
                              f"mode='auto', 'ep' or 'datacentric' trains it as plain DDP")
        if self.plan is not None:
            raise ConfigError(f"strategy plan places experts and {what}: drop the plan (mode='auto' trains it as "
                              f"plain DDP)")
        if self.emulated:
            raise ConfigError(f"strategy cluster emulate=true times the MoE layers' step and {what}: set the "
                              f"cluster's emulate=false (or no cluster) to train it as plain DDP")
        if self.batch_split == "speed":
            raise ConfigError(f"strategy batch_split='speed' weighs devices by the MoE layers' cost and {what}: set "
                              f"batch_split='equal' to train it as plain DDP")

    def check_memory(self, model: Any, world_size: int, weight_averages: int = 0) -> None:
        """``ep`` and ``datacentric`` on a cluster config: a rank that cannot hold its share
        of the training state is refused before any process starts, with what would fit.
        (Zebra's planner does the same at set-up, before anything is allocated.)
        ``weight_averages``: copies of the weights the trainer's weight averaging keeps on
        the device beside them."""
        if self.cluster is None or self.mode not in ("ep", "datacentric") or self.cluster.world_size != world_size:
            return
        from ..model_contract import ModelContractError, describe_model

        try:
            cfg = describe_model(model)
        except ModelContractError:
            return
        from ..profile.memory import format_bytes, spread_memory

        devices = self.cluster.specs()
        sharded = self.saves_sharded(sum(p.numel() for p in model.parameters()))
        zero = self.shard_optimizer_state and sharded  # ZeRO-1 runs with sharded checkpoints only
        optimizer_bytes, _ = memory.optimizer_pricing(optimizer_of(model))

        def need(mode: str, ep_size: int | None = None) -> list:
            return spread_memory(cfg, mode, devices, shard_optimizer_state=zero, optimizer_bytes=optimizer_bytes,
                                 weight_averages=weight_averages, ep_size=ep_size)

        def fits(ranks: list) -> bool:
            return all(m.total <= d.usable_bytes for m, d in zip(ranks, devices))

        mine = need(self.mode, self.fixed_ep_size)  # "auto" chooses among the sizes that fit: the world's, at least
        if fits(mine):
            return
        over = [(r, m, d) for r, (m, d) in enumerate(zip(mine, devices)) if m.total > d.usable_bytes]
        r, m, d = max(over, key=lambda x: x[1].total / x[2].usable_bytes)
        other = "datacentric" if self.mode == "ep" else "ep"
        fits_other = fits(need(other))
        # EP groups smaller than the world hold every expert over fewer ranks
        wider = self.mode == "ep" and (self.fixed_ep_size or world_size) < world_size and fits(need("ep"))
        state = sum(x.state for x in mine)
        more = math.ceil(state / min(dv.usable_bytes for dv in devices))
        raise ConfigError(
            f"strategy mode={self.mode!r} does not fit: rank {r} ({d.name}, {format_bytes(d.usable_bytes)} usable"
            f"{', memory_scale ' + format(self.cluster.memory_scale, 'g') if self.cluster.memory_scale else ''}) "
            f"would hold {format_bytes(m.state)} of weights, gradients, optimizer state"
            + (f" and weight averages ({format_bytes(m.averages)})" if m.averages else "") + " and "
            f"{format_bytes(max(m.working, m.step))} of "
            + ("temporaries at its optimizer step" if m.step > m.working else "transients before any activation")
            + ". What would fit: "
            + (f"expert_parallel_size={world_size} (one EP group: each rank a 1/{world_size} slice of the experts); "
               if wider else "")
            + (f"mode={other!r}; " if fits_other else "")
            + ("WeightAveraging(device='cpu') (the average in host memory); " if m.averages else "")
            + ("shard_optimizer_state=true; " if not self.shard_optimizer_state else "")
            + ("checkpoint_format='sharded' (optimizer state sharded over replicas needs it); " if not sharded else "")
            + f"mode='zebra' or 'auto' (the planner places experts by memory); at least {more} such devices; "
              f"a smaller model")


def check_passed_on(kwargs: dict[str, Any]) -> None:
    """HeterMoEStrategy passes keyword arguments it does not name on to Lightning's
    DDPStrategy and from there to DistributedDataParallel, which would reject a typo only
    once every process has started: one that neither takes is named here, with the closest
    valid name."""
    import difflib
    import inspect

    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    def named(fn: Any) -> list[str]:
        return [n for n, p in inspect.signature(fn).parameters.items()
                if n not in ("self", "module") and p.kind is not p.VAR_KEYWORD]

    passed_on = named(DDPStrategy.__init__) + named(DistributedDataParallel.__init__)
    for key in kwargs:
        if key not in passed_on:
            own = [f.name for f in fields(StrategyArguments)]
            close = difflib.get_close_matches(key, own + passed_on, n=1)
            raise ConfigError(f"HeterMoEStrategy got an unknown argument {key}={kwargs[key]!r}"
                              + (f" (did you mean {close[0]}?)" if close else "")
                              + f": it takes {own} and passes DDPStrategy's and DistributedDataParallel's arguments "
                                f"on")


def _builds_in_configure_model(model: Any) -> bool:
    import lightning as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return isinstance(model, L.LightningModule) and is_overridden("configure_model", model)


def check_waves(plan: Any, accumulate_grad_batches: int) -> None:
    """A plan of several waves runs each optimizer step as that many loader batches: the
    trainer must accumulate exactly that many (a plan of one wave leaves accumulation to the user)."""
    if plan.waves > 1 and plan.waves != accumulate_grad_batches:
        raise ConfigError(f"the plan runs each step as {plan.waves} waves of {plan.total_seqs} sequences: set "
                          f"trainer.accumulate_grad_batches={plan.waves} (it is {accumulate_grad_batches})")


def check_plan(plan: Any, model_cfg: Any, world_size: int) -> None:
    """A plan must fit the world and the model; one clear error per mismatch."""
    if plan.world_size != world_size:
        raise ConfigError(f"the plan is for {plan.world_size} ranks, the trainer runs {world_size}")
    if plan.num_layers != model_cfg.n_layers:
        raise ConfigError(f"the plan is for {plan.num_layers} MoE layers, the model has {model_cfg.n_layers}")
    if plan.num_experts != model_cfg.moe.num_experts:
        raise ConfigError(f"the plan is for {plan.num_experts} experts per layer, the model has "
                          f"{model_cfg.moe.num_experts}")


def optimizer_of(module: Any) -> OptimConfig | None:
    """The optimizer the memory checks made before set-up price: the pack's model's ``optim``
    config; ``None`` (unfused AdamW's bytes) for a model whose optimizer is its own, which
    exists only once set-up has planned."""
    optim = getattr(module, "optim_cfg", None)
    return optim if isinstance(optim, OptimConfig) else None
