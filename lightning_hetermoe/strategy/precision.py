"""Precision across ranks: one loss-scaling verdict for every rank, and bf16 only where the
hardware has it.

* **16-mixed** (fp16 with dynamic loss scaling: what V100 and T4 run fast) goes through
  Lightning's own precision plugin and its ``GradScaler``. Expert ranks and expert-parallel
  ranks hold gradients no other rank sees, so an overflow can show on one rank only; the
  scaler here max-reduces the inf/nan flags over the world after unscaling, so every rank
  skips the same steps and moves the scale the same way.
* **Fused optimizers under mixed precision with clipping.** Lightning refuses to clip for
  an optimizer that unscales inside its own step (``fused=True``), under 16-mixed and
  bf16-mixed alike: the clip would read gradients still multiplied by the loss scale.
  torch's ``GradScaler`` also takes an explicit ``unscale_`` for such an optimizer (its step
  then skips its own unscaling and keeps the overflow check), so here the gradients are
  unscaled first, with every rank's verdict, and clipped as for any other optimizer (bf16
  has no scale: clipped as they are). Clipping by norm does better: the global norm of the
  still-scaled gradients, over every rank, is the clip's norm times the scale and says
  whether any rank overflowed, so ``AgreedGradScaler.unscale_in_step_`` records what
  ``unscale_`` would (that verdict, the stage) and hands the fused step ``scale / coef`` as
  its divisor: the unscaling (with its overflow check) and the clip's scaling, two passes
  over every gradient (16 bytes per fp32 parameter), are gone, for the step's write-back of
  the divided gradient (4): the clipped step moves 36 bytes per parameter instead of 48.
* **bf16** needs compute capability 8.0 (Ampere) or newer; on a V100 or T4 PyTorch only
  emulates it, far below the fp16 speed the planner assumes. A cluster with such a device
  and a bf16 precision is a config error before launch, unless the user asks for the
  emulation (``allow_emulated_bf16=True``): ``cluster.devices.check_bf16``, which the plan
  recipe asks too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
import torch.distributed as dist

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

import lightning_hetermoe.comm as comm

from .grad_norm import clip_coefficient, fold_into_step, step_takes_scale


def precision_name(plugin: Any) -> str:
    """Lightning's precision string of a plugin (``32-true``, ``16-mixed``, ``bf16-mixed`` ...)."""
    return str(getattr(plugin, "precision", "32-true"))


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/nan verdict is every rank's (see the module docstring)."""

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: str) -> "AgreedGradScaler":
        """The same scaler (settings and state), agreeing across ranks."""
        agreed = cls(device=device, enabled=scaler.is_enabled())
        state = scaler.state_dict()
        if state:
            agreed.load_state_dict(state)
        return agreed

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # noqa: D401 - torch's hook
        # torch's own extension point (FSDP's sharded scaler reduces here too): unscale as
        # usual, then one max over the world of this optimizer's flags, on every rank,
        # also one whose optimizer saw no gradient (a collective every rank must join).
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not (dist.is_available() and dist.is_initialized()):
            return per_device
        device = comm.compute_device()
        agreed = torch.zeros((), dtype=torch.float32, device=device)
        for flag in per_device.values():
            agreed = torch.maximum(agreed, flag.to(device))
        comm.all_reduce(comm.world(), agreed, op=dist.ReduceOp.MAX, what="amp.found_inf")
        if not per_device:
            per_device[device] = agreed
        for flag in per_device.values():
            flag.copy_(agreed.to(flag.device))
        return per_device

    def holds_scaled(self, optimizer) -> bool:
        """Whether ``optimizer``'s gradients still carry the loss scale (not unscaled yet this
        step)."""
        from torch.amp.grad_scaler import OptState

        return self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY

    def unscaled_norm(self, optimizer, total_norm: Tensor) -> Tensor:
        """``total_norm`` of ``optimizer``'s gradients as they are once unscaled: over the
        scale while they still carry it (a fused step unscales inside itself), else as it
        is. A device tensor: the scale is not read on the host."""
        if not self.holds_scaled(optimizer):
            return total_norm
        return (total_norm.to(self._scale.device, torch.float64) / self._scale.double()).to(total_norm.device)

    def unscale_in_step_(self, optimizer, total_norm: Tensor, clip_val: float) -> None:
        """``unscale_`` and the clip by the global norm, both left to ``optimizer``'s fused
        step (see the module docstring): ``total_norm`` is the norm of the still-scaled
        gradients over every rank, so it says whether any rank overflowed (the verdict
        every rank shares) and, over the scale, the norm the clip needs. Recorded as
        ``unscale_`` records it: ``step`` then hands the optimizer the divisor given here
        and the verdict, and skips the update on an overflow."""
        from torch.amp.grad_scaler import OptState

        self._check_scale_growth_tracker("unscale_in_step_")  # as unscale_: the loss was scaled first
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError("unscale_in_step_() after unscale_() or step() on this optimizer since the last update()")
        scale = self._scale.double()
        coef = clip_coefficient(total_norm.to(scale.device, torch.float64) / scale, clip_val)
        found_inf = (~torch.isfinite(total_norm)).to(device=self._scale.device, dtype=torch.float32)
        fold_into_step(optimizer, coef / scale)  # the step divides by scale / coef
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED


def agree_on_overflow(plugin: Any) -> None:
    """Make a mixed-precision plugin's scaler decide with every rank (once)."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, AgreedGradScaler):
        plugin.scaler = AgreedGradScaler.like(scaler, plugin.device)


def clip_fused_too(plugin: Any) -> None:
    """Let ``plugin`` (Lightning's mixed precision, 16-mixed or bf16-mixed: it refuses to
    clip for a fused optimizer even without a scaler) clip for one (once); it then says so
    in ``plugin.clips_fused``."""
    if not isinstance(plugin, MixedPrecision) or getattr(plugin, "clips_fused", False):
        return
    refusing = plugin.clip_gradients

    def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if not clip_val or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return refusing(optimizer, clip_val, gradient_clip_algorithm)
        # a step whose backward was skipped has no gradients and takes no scaler step: its
        # unscale_ would stand until the next step's and be refused there
        stepping = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        if plugin.scaler is not None and stepping:
            if (gradient_clip_algorithm == GradClipAlgorithmType.NORM and isinstance(plugin.scaler, AgreedGradScaler)
                    and step_takes_scale(optimizer)):
                # the norm reads the scaled gradients; the step unscales and clips (clip_grad_by_norm
                # sees them still scaled: the strategy's hands them to unscale_in_step_)
                return plugin.clip_grad_by_norm(optimizer, clip_val)
            plugin.scaler.unscale_(optimizer)
        return Precision.clip_gradients(plugin, optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients
    # read by optim.fused=auto (model/lm.py): such a plugin can clip for a fused optimizer
    plugin.clips_fused = True


def clip_synced_grads(plugin: Any, sync: Callable[[], None]) -> None:
    """Let ``plugin`` sum the gradients over the ranks (``sync``) before it clips them (once
    per plugin). Lightning's own loop clips after the optimizer step's closure, where the
    strategy has summed them; a manual ``self.clip_gradients`` comes before ``opt.step()``."""
    if getattr(plugin, "clips_synced", False):
        return
    clipping = plugin.clip_gradients

    def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if clip_val:
            sync()
        return clipping(optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients
    plugin.clips_synced = True
