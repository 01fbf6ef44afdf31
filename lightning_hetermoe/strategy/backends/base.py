"""What one parallelism owns, behind one small protocol.

:class:`~.hetermoe.HeterMoEStrategy` holds Lightning's hooks; it chooses a backend once,
at set-up (:mod:`.selection`), and every hook that differs between parallelisms delegates
to it. Four backends exist:

* :class:`~.single.SingleDeviceBackend`: one process, the model as written;
* :class:`~.expert_parallel.ExpertParallelBackend`: DDP for the dense part, experts sliced
  over an expert-parallel group (``ep``; ``ep_balanced`` with speed-proportional shares);
* :class:`~.zebra.backend.ZebraBackend`: attention and expert ranks from a plan, the
  zebra or DistEP schedule run by its own executor;
* :class:`~.datacentric.DataCentricBackend`: HEXA-MoE, experts sharded over every rank and
  gathered to the tokens.

Expert parallelism and data-centric share :class:`DenseDDPBackend` (dense weights under
Lightning's DDP, experts synced by the backend, batch shares weighted).

A backend owns: laying the model out on this rank and restoring it, the step and the
hand-over of gradients to Lightning, gradient sync and the clipping norm, gathering and
slicing expert tensors (for checkpoints and moves, see :mod:`.expert_state`), which rank
writes checkpoints, and its own busy time.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ...backward import inside_backward
from ...apportion import apportion
from ...ckpt.pieces import Pieces
from ...placement import Placement
from ..batch import flat_mask, gather_global_batch, ignore_index_of, local_tokens, split_sizes, take
from ..expert_state import expert_tensor_names, restore_local
from ..grad_norm import squared_norm
from ...materialize import Materializer

StepFn = Callable[..., Any]
Context = Callable[[], ContextManager]
STEP_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
                 "test_step": "test_step_context", "predict_step": "predict_step_context"}


def step_context(precision: Any, hook: str) -> Context:
    """The precision plugin's context for ``hook`` (autocast under mixed precision)."""
    return getattr(precision, STEP_CONTEXTS[hook])


@dataclass(frozen=True)
class TailShape:
    """What the step's tail (gradient sync and optimizer) of this rank covers."""

    experts_held: int
    has_attention: bool
    replicas: int
    attention_dp: int
    # the global ranks of the rings: this rank's experts' replicas, the dense replicas
    replica_ranks: tuple[int, ...] = ()
    dense_ranks: tuple[int, ...] = ()
    # the rank goes on into the next step while its device runs the tail (zebra and DistEP in
    # one wave: simulate.step.carries_tails); else the next step starts after it
    carried: bool = False


@dataclass(frozen=True)
class Simulated:
    """What the simulator needs to predict this run: a plan (zebra, distep) or an EP layout."""

    schedule: str  # one of lightning_hetermoe.simulate.SCHEDULES, or "single"
    plan: Any = None
    ep_size: int | None = None  # EP: ranks per EP group (None: every rank, one group)
    placement: Placement | None = None
    replica_dispatch: str = "local_first"  # EP: which copy of a replicated expert serves a token


# How long an MoE layer run outside any step waits for the other ranks to run it too, where
# the strategy sets no bound of its own (its progress bound: see HeterMoEStrategy)
OUTSIDE_STEP_TIMEOUT_S = 300.0


class OutsideStepError(RuntimeError):
    """The model ran outside the Trainer's steps on some ranks only (it would have hung)."""


class ParallelBackend(ABC):
    schedule: str = ""  # the simulator's name for what this backend runs
    # the seconds guard_outside_step waits (the strategy sets it from its progress bound)
    outside_step_timeout_s: Callable[[], float] = staticmethod(lambda: OUTSIDE_STEP_TIMEOUT_S)
    _stepping = 0  # steps (and their backwards) under way on this rank
    # whether a step takes its batch on the host (it gathers the global batch there and moves
    # the rows it computes to the device): see HeterMoEStrategy.batch_to_device
    batch_on_host: bool = False
    # whether the module runs as a plain forward outside the step (Lightning's model summary
    # forwards example_input_array on every rank); zebra's layers run only in its executor
    runs_bare_forward: bool = True

    # -- set-up and restore -------------------------------------------------------------
    @abstractmethod
    def setup(self, module: nn.Module, fitting: bool, materialize: Materializer | None = None) -> None:
        """Lay ``module`` out on this rank (on its device, before optimizers are built), once:
        a later stage (validate after fit) finds it laid out. ``materialize``: the model was
        built on the meta device and this rank allocates and fills only what it holds;
        ``None``: the model was built whole in every process, and rank 0's values go
        everywhere before each rank keeps its part."""

    def restore(self, module: nn.Module, gather: bool) -> None:
        """At teardown: remove what the stage installed; ``gather``: every rank holds the
        whole model again, as the user built it (a model built whole, after a successful
        run). Otherwise the layout stays, for the next stage and for sharded checkpoints."""

    @property
    def wraps_ddp(self) -> bool:
        """Lightning's DDP wrapper syncs the dense gradients (else the backend does)."""
        return False

    def ddp_ignored(self, module: nn.Module) -> list[str]:
        return []

    # -- the step -----------------------------------------------------------------------
    def step(self, module: nn.Module, hook: str, default: StepFn, precision: Any, args: tuple,
             kwargs: dict) -> Any:
        """One ``training_step``/``validation_step``/... of the LightningModule ``module``;
        ``default`` is Lightning's own; ``precision`` the precision plugin (its step
        contexts, its loss scaler)."""
        return default(*args, **kwargs)

    def backward(self, closure_loss: Tensor, default: Callable[[Tensor], Tensor], precision: Any,
                 module: nn.Module) -> Tensor:
        return default(closure_loss)

    def sync_grads(self, module: nn.Module) -> None:
        """After the closure, before clipping and the optimizer: gradients of the global batch."""

    @abstractmethod
    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter], dense_sq: Tensor | None = None) -> Tensor:
        """Squared global gradient norm, every parameter counted once over all ranks, over
        ``params`` (the optimizers'). ``dense_sq``: where the dense parameters' optimizer
        state is sharded (:mod:`..zero`), ``params`` holds none of them and this is their
        part, the same on every rank that holds them."""

    def dense_replicas(self) -> Any:
        """The :class:`~lightning_hetermoe.comm.Group` of the ranks holding this rank's
        dense weights alike (``None``: this rank holds none, or holds them alone)."""
        return None

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around each of Lightning's steps and backwards (the strategy's): what runs inside
        runs on every rank in step."""
        self._stepping += 1
        try:
            yield
        finally:
            self._stepping -= 1

    def guard_outside_step(self, group: Any, layer: int) -> None:
        """Before MoE layer ``layer``'s first collective on ``group``: inside a step, nothing.
        Outside one (a callback, a hook, the user's own code), the model may have been run on
        some ranks only, an ``if trainer.is_global_zero:`` around a sample generation: its
        exchange would wait forever for ranks that never come, or pair with their next
        step's and train on rows that belong to nothing. So every member first says it got
        here, through the job's store, within :attr:`outside_step_timeout_s`; a member that
        did not is named in an :class:`OutsideStepError` (and the job ends, as for any rank
        that raises)."""
        if self._stepping or inside_backward():
            return
        timeout = self.outside_step_timeout_s()
        missing = comm.arrive_together(group, timeout)
        if missing:
            raise OutsideStepError(
                f"rank {comm.world().rank} ran MoE layer {layer} outside the Trainer's steps (a callback or hook, "
                f"not training_step/validation_step/test_step/predict_step), and rank(s) "
                f"{', '.join(map(str, missing))} did not run it within {timeout:.0f} s. Each rank holds other "
                f"experts, so outside a step the model runs only where every rank runs it at once: call it on every "
                f"rank (drop an `if trainer.is_global_zero:` around it; print or log on rank 0 only), or after fit, "
                f"when a model built whole is whole again on every rank")

    def check_user_collective(self, what: str) -> None:
        """Before a collective the user's code issues (``self.all_gather``): raises where it
        was issued from code that only some ranks run, which would hang."""

    def metrics_group(self, group: Any) -> Any:
        """The group ``self.log(sync_dist=True)`` reduces over (``False``: nothing to reduce here)."""
        return group

    def metrics_source(self) -> int | None:
        """The rank whose logged metrics every rank's callbacks should read, where some ranks
        log nothing (``None``: every rank logs its own, as under DDP)."""
        return None

    def local_evaluation_names(self) -> list[str]:
        """Names evaluation steps logged on some ranks only (what cannot be combined over
        ranks, as a torchmetrics object); the same list on every rank."""
        return []

    # -- experts ------------------------------------------------------------------------
    @property
    def spread(self) -> bool:
        """Experts are spread over ranks right now (between set-up and restore)."""
        return False

    def placement(self) -> Placement | None:
        return None

    def copy_routing(self) -> tuple[str, list[float], list[int] | None] | None:
        """Where a placement may carry routes for copied experts (expert parallelism): the
        replica dispatch rule, each holder's share of the batch, each holder's node (``None``:
        one node). ``None``: it may not."""
        return None

    def holder_index(self) -> int:
        return 0

    def holder_devices(self) -> list[str]:
        return []

    def gather_experts(self, layer: int, local: Tensor, name: str = "") -> Tensor:
        """The full ``[E, ...]`` tensor of MoE layer ``layer``'s expert parameter ``name``
        (or a per-parameter optimizer tensor of its shape) from every holder's part."""
        return local

    def local_part(self, layer: int, name: str, full: Tensor, local: Tensor) -> Tensor | None:
        """This rank's part of ``full`` (a checkpoint's ``[E, ...]`` tensor for the expert
        parameter ``name``, held here as ``local``), or ``None`` if ``full`` is not such a
        tensor. Default: the rows of the experts this rank holds in :meth:`placement`."""
        num_experts = len({e for held in self.placement().held[layer] for e in held})
        if full.dim() != local.dim() or full.shape[1:] != local.shape[1:] or full.shape[0] != num_experts:
            return None
        mine = torch.tensor(self.placement().experts_of(self.holder_index(), layer), dtype=torch.long, device="cpu")
        return full[mine.to(full.device)]

    def expert_pieces(self, layer: int, name: str, local: Tensor) -> Pieces:
        """How this rank holds expert tensor ``name`` of MoE layer ``layer`` (or a
        per-element optimizer tensor of its shape), as flat pieces of the whole ``[E, ...]``
        tensor. Default: the rows of the experts this rank holds in :meth:`placement`, one
        piece per run of consecutive experts (per expert where a layer keeps copies, so that
        equal pieces on several ranks are written once)."""
        if not self.spread:
            return Pieces.whole(local)
        held = self.placement().held[layer]
        ids = [e for experts in held for e in experts]
        copies = len(ids) != len(set(ids))
        return Pieces.of_rows(local, self.placement().experts_of(self.holder_index(), layer),
                              (len(set(ids)),) + tuple(local.shape[1:]), merge=not copies)

    def stripped_shapes(self) -> dict[str, tuple[int, ...]]:
        """Whole shapes of the module's tensors this rank keeps empty (a zebra expert rank's dense part)."""
        return {}

    def piece_shapes(self) -> dict[str, tuple[int, ...]]:
        """Whole shapes of the module's parameters this rank holds as a piece of another shape
        (data-centric: a flat range of each expert tensor), by parameter name."""
        return {}

    def adopt_placement(self, placement: Placement) -> None:
        """The expert tensors were moved to ``placement``: route by it from now on."""
        raise NotImplementedError(f"{type(self).__name__} does not move experts")

    @property
    def holds_dense(self) -> bool:
        """This rank keeps the dense (non-expert) parameters and their optimizer state."""
        return True

    @property
    def dense_on_every_rank(self) -> bool:
        """Every rank keeps the dense parameters, alike: none needs another's."""
        return True

    def writes_checkpoints(self, rank: int) -> bool:
        return rank == 0

    # -- timing -------------------------------------------------------------------------
    def busy(self, step_s: float) -> dict[str, float] | None:
        """This rank's last training step by kind, if the backend times its own tasks."""
        return None

    def tail_shape(self) -> TailShape:
        return TailShape(experts_held=0, has_attention=True, replicas=1, attention_dp=1)

    def simulated(self, placement: Placement | None = None) -> Simulated:
        return Simulated(self.schedule, placement=placement)

    def describe_rank(self, rank: int) -> str:
        return f"{self.schedule} rank"

    @property
    def num_microbatches(self) -> int | None:
        return None


class DenseDDPBackend(ParallelBackend):
    """A backend whose dense weights Lightning's DDP syncs and whose experts it spreads and
    syncs itself (expert parallelism, data-centric). A rank may train on an unequal share
    of the global batch (speed shares, ragged batches, an uneven last batch): its mean loss
    counts by its size in tokens (``loss_weight``), since DDP averages over ranks."""

    _layers: list
    _sharded: bool = False
    _emulation: Any = None
    _loss_weight: float = 1.0
    _shares: list[int] | None = None
    _real: Tensor | None = None  # the real tokens of this step's share, where it holds padded rows
    clock: Any
    rank: int
    world_size: int
    device: torch.device

    @property
    def wraps_ddp(self) -> bool:
        return True

    def ddp_ignored(self, module: nn.Module) -> list[str]:
        return expert_tensor_names(module)

    def restore(self, module: nn.Module, gather: bool) -> None:
        self._real = None
        if self._sharded and gather:
            restore_local(self._layers, self.gather_experts)
            self._sharded = False
        if self._emulation is not None:
            self._emulation.remove()
            self._emulation = None

    def backward(self, closure_loss: Tensor, default: Callable[[Tensor], Tensor], precision: Any,
                 module: nn.Module) -> Tensor:
        # Each rank backpropagates its share of the global mean loss (n_r / N of it), not its
        # own mean, and the gradients are summed over the ranks (:meth:`sum_dense_grads`, the
        # experts' own sync). Every value of a rank's backward is then the one one process
        # computes for those rows: under fp16 the loss-scaled gradients overflow where one
        # process's do, not at 1 / world of its threshold (which skipped steps one process
        # takes), and round alike.
        try:
            return default(closure_loss * self._loss_weight / self.world_size)
        finally:
            self._real = None  # kept through the backward: checkpointed blocks recompute in it

    def sum_dense_grads(self, module: nn.Module) -> None:
        """DDP averaged the dense gradients of the ranks' shares: their sum."""
        if self.world_size > 1:
            experts = {id(p) for layer in self._layers for p in layer.experts.parameters()}
            dense = [p.grad for p in module.parameters() if p.grad is not None and id(p) not in experts]
            if dense:
                torch._foreach_mul_(dense, float(self.world_size))

    @property
    def spread(self) -> bool:
        return self._sharded

    @property
    def loss_weight(self) -> float:
        """What this rank's mean loss of the last training step counts for in DDP's average:
        ``world * its tokens / the global batch's tokens`` (1 where every rank holds as many)."""
        return self._loss_weight

    def real_tokens(self, num_tokens: int) -> Tensor | None:
        """``MoELayer.real_tokens`` of this backend's layers: the step's padding, if any."""
        return flat_mask(self._real, num_tokens)

    # -- the batch ------------------------------------------------------------------------
    def step_args(self, module: nn.Module, hook: str, args: tuple, speed: bool) -> tuple:
        """The user's step arguments: in training, this rank's speed share of the global batch
        (``speed``) or its own batch, its loss weight set either way."""
        self._real = None
        if hook != "training_step" or not args:
            return args
        if speed:
            return (self.speed_share(args[0], ignore_index_of(module)),) + tuple(args[1:])
        self._loss_weight = self.token_weight(args[0])
        return args

    def token_weight(self, batch: Any) -> float:
        """This rank's weight where it trains its own batch: DDP averages the ranks' mean
        losses, so where ranks hold different numbers of tokens (ragged batches, an uneven
        last batch) each counts by its tokens (exactly 1 where all hold as many)."""
        if self.world_size == 1:
            return 1.0
        mine = local_tokens(batch)
        # host metadata: one int64 summed on the world's gloo group (the batch's shape needs no sync)
        total = torch.tensor([mine], dtype=torch.int64, device="cpu")
        comm.host_all_reduce(comm.world(), total, what="batch.tokens")
        return mine * self.world_size / int(total) if int(total) else 1.0

    def speed_share(self, batch: Any, ignore_index: int) -> Any:
        """This rank's share of the global batch in proportion to its device's speed (the
        clock's cost model; equal shares where the clock knows no devices), its loss
        weighted by its size (its real tokens, where ragged batches were padded)."""
        full = gather_global_batch(batch, ignore_index)
        total = full.size
        if self._shares is None or sum(self._shares) != total:
            self._shares = self.clock.speed_shares(total) if len(self.clock.devices) == self.world_size \
                else apportion(total, [1.0] * self.world_size)
        start, count = split_sizes(total, self._shares)[self.rank]
        self._loss_weight = full.fraction(start, count, scale=self.world_size)
        self._real = full.mask(start, count, self.device)
        return take(full.batch, start, count)

    @property
    def shares(self) -> list[int] | None:
        """Sequences per rank of the last step, where ranks take speed shares."""
        return None if self._shares is None else list(self._shares)

    # -- gradients --------------------------------------------------------------------------
    def dense_grad_sq_norm(self, params: list[nn.Parameter], dense_sq: Tensor | None = None) -> Tensor:
        """The dense half of the global norm: DDP left every rank the same dense gradients
        (``dense_sq``: already summed over the ranges of sharded optimizer state)."""
        expert_ids = {id(p) for layer in self._layers for p in layer.experts.parameters()}
        own = squared_norm((p.grad for p in params if id(p) not in expert_ids), self.device)
        return own if dense_sq is None else own + dense_sq

    def dense_replicas(self) -> Any:
        import lightning_hetermoe.comm as comm

        return comm.world() if self.world_size > 1 else None

    def describe_rank(self, rank: int) -> str:
        names = [d.name for d in self.clock.devices]
        return f"{self.schedule} rank, device {names[rank] if rank < len(names) else '?'}"


class GlobalBalanceCounts:
    """One layer's routing counts summed over every data-parallel rank: the global ``f`` of
    the balance loss (see :mod:`lightning_hetermoe.moe.balance`); on the device, where the
    loss uses them.

    A checkpointed block runs its forward again inside its backward, where the same routing
    gives the same sum: the forward's is reused there, so no collective runs in a backward
    (under ``ep`` and ``datacentric`` each forward's backward runs before the next forward;
    one on a rank behind the others waited for them in every layer's backward)."""

    def __init__(self) -> None:
        self.last: Tensor | None = None

    def __call__(self, counts: Tensor) -> Tensor:
        if self.last is not None and inside_backward():
            return self.last
        counts = counts.clone()
        comm.all_reduce(comm.world(), counts, what="ep.balance")
        self.last = counts if torch.is_grad_enabled() else None
        return counts


def broadcast_whole(module: nn.Module, what: str) -> None:
    """Rank 0's values of every tensor everywhere (a model built whole in each process:
    differently seeded processes start equal)."""
    for t in list(module.parameters()) + list(module.buffers()):
        comm.broadcast(comm.world(), t.data, 0, what=what)


def zero_missing_grads(params: list[nn.Parameter]) -> None:
    """A parameter no token reached still takes part in every gradient collective. A frozen
    one takes part in none and keeps no gradient: the optimizer skips it, as in one process
    (a zero gradient would count Adam's steps on it and decay it)."""
    for p in params:
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
