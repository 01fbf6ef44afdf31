"""``GradNormMonitor``: the global gradient norm, logged as one process would see it.

Lightning's ``grad_norm(module)`` (the idiom in its docs, called in
``on_before_optimizer_step``) reads the gradients this rank holds. Under DDP every rank holds
all of them, reduced; under this strategy a rank holds its experts' gradients only, and under
zebra an expert rank no dense ones: the norm it gives is a share's, different on every rank.
This callback logs ``grad_norm``, the L2 norm of every gradient the optimizer steps, over all
ranks, before clipping and without the loss scale: what a single process training on the
global batch would log (:meth:`HeterMoEStrategy.gradient_norm`, one all-reduce of a scalar).
Under another strategy it is the rank's own gradients' norm, which there is the whole one.

Every ``log_every_n_steps`` optimizer steps (the trainer's ``log_every_n_steps`` where not
given; never where that is 0, logging off), on every rank alike: the norm is a collective.
It stays on the device; the logger reads it when it writes.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from ..configs import ConfigError


class GradNormMonitor(L.Callback):
    """Logs ``name`` (default ``grad_norm``): the L2 norm of every gradient over all ranks,
    before clipping and the loss scale, as one process on the global batch would see it,
    every ``log_every_n_steps`` optimizer steps (the trainer's where ``None``)."""

    def __init__(self, log_every_n_steps: int | None = None, name: str = "grad_norm") -> None:
        if log_every_n_steps is not None and (isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int)
                                              or log_every_n_steps < 1):
            raise ConfigError(f"GradNormMonitor log_every_n_steps={log_every_n_steps!r} is invalid: must be an integer "
                              f">= 1, or None for the trainer's log_every_n_steps")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"GradNormMonitor name={name!r} is invalid: must be a non-empty string")
        self.log_every_n_steps, self.name = log_every_n_steps, name

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        every = self.log_every_n_steps or int(trainer.log_every_n_steps)
        # the step about to be taken is global_step + 1 (the same on every rank: all join);
        # a trainer that logs nothing (log_every_n_steps=0) is not asked for the norm
        if every < 1 or (trainer.global_step + 1) % every:
            return
        norm = gradient_norm(trainer.strategy, optimizer)
        pl_module.log(self.name, norm, on_step=True, on_epoch=False, prog_bar=False, logger=True)


def gradient_norm(strategy: Any, optimizer: Any) -> torch.Tensor:
    """The strategy's global norm where it has one (this pack's); else the norm of the
    gradients this rank holds (single device, DDP: all of them)."""
    if hasattr(strategy, "gradient_norm"):
        return strategy.gradient_norm(optimizer)
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return torch.zeros((), device=strategy.root_device)
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch 2.6 on
    if total_norm is None:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return total_norm(grads)
