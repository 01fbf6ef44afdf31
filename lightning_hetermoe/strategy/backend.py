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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor, nn

from ..placement import Placement
from .expert_state import expert_tensor_names, restore_local

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


@dataclass(frozen=True)
class Simulated:
    """What the simulator needs to predict this run: a plan (zebra, distep) or an EP layout."""

    schedule: str  # one of lightning_hetermoe.simulate.SCHEDULES, or "single"
    plan: Any = None
    ep_size: int = 1
    placement: Placement | None = None


class ParallelBackend(ABC):
    schedule: str = ""  # the simulator's name for what this backend runs

    # -- set-up and restore -------------------------------------------------------------
    @abstractmethod
    def setup(self, module: nn.Module, fitting: bool) -> None:
        """Lay ``module`` out on this rank (on its device, before optimizers are built)."""

    def restore(self, module: nn.Module, succeeded: bool) -> None:
        """At teardown: remove what was installed; after a successful run every rank holds
        the whole model again (after a failure the layout stays: nothing can be gathered)."""

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
    def grad_sq_norm(self, module: nn.Module, params: list[nn.Parameter]) -> Tensor:
        """Squared global gradient norm, every parameter counted once over all ranks."""

    def metrics_group(self, group: Any) -> Any:
        """The group ``self.log(sync_dist=True)`` reduces over (``False``: nothing to reduce here)."""
        return group

    # -- experts ------------------------------------------------------------------------
    @property
    def spread(self) -> bool:
        """Experts are spread over ranks right now (between set-up and restore)."""
        return False

    def placement(self) -> Placement | None:
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

    def adopt_placement(self, placement: Placement) -> None:
        """The expert tensors were moved to ``placement``: route by it from now on."""
        raise NotImplementedError(f"{type(self).__name__} does not move experts")

    @property
    def holds_dense(self) -> bool:
        """This rank keeps the dense (non-expert) parameters and their optimizer state."""
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
    of the global batch: its mean loss counts by its size (``_loss_weight``), since DDP
    averages over ranks."""

    _layers: list
    _sharded: bool = False
    _emulation: Any = None
    _loss_weight: float = 1.0

    @property
    def wraps_ddp(self) -> bool:
        return True

    def ddp_ignored(self, module: nn.Module) -> list[str]:
        return expert_tensor_names(module)

    def restore(self, module: nn.Module, succeeded: bool) -> None:
        if self._sharded and succeeded:
            restore_local(self._layers, self.gather_experts)
            self._sharded = False
        if self._emulation is not None:
            self._emulation.remove()
            self._emulation = None

    def backward(self, closure_loss: Tensor, default: Callable[[Tensor], Tensor], precision: Any,
                 module: nn.Module) -> Tensor:
        return default(closure_loss * self._loss_weight)

    @property
    def spread(self) -> bool:
        return self._sharded


def zero_missing_grads(params: list[nn.Parameter]) -> None:
    """A parameter no token reached still takes part in every gradient collective."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
