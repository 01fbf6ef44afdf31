"""Callback metrics on every rank, where only some ranks log.

Under zebra and distep the user's steps run on the attention ranks only, so ``self.log``
fills ``trainer.callback_metrics`` there and nowhere else. The callbacks that read them
(``ModelCheckpoint(monitor=...)``, ``EarlyStopping``) run on every rank and take collective
decisions (a sharded save, ``should_stop``): an expert rank without the metric raises, or
decides otherwise and hangs the next collective. So before any other callback reads them,
every rank takes the first attention rank's callback metrics (already reduced over the
attention ranks where ``sync_dist`` asked for it), as DDP's ranks would each hold them.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

import lightning_hetermoe.comm as comm


class SharedCallbackMetrics(L.Callback):
    """Installed first by the strategy where the backend names a metrics source."""

    def __init__(self, source: int) -> None:
        self.source = source

    def _share(self, trainer: Any) -> None:
        mine = trainer.global_rank == self.source
        numbers = _host_numbers(trainer.callback_metrics) if mine else None
        theirs = comm.gather_objects(comm.world(), numbers, what="strategy.callback_metrics")[self.source]
        if not mine:
            # the connector's own store: its callback_metrics property adds this rank's (none) on top
            device = trainer.strategy.root_device  # where the attention ranks' metrics live
            trainer._logger_connector._callback_metrics.update({k: torch.tensor(v, device=device)
                                                                for k, v in theirs.items()})

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._share(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._share(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._share(trainer)


def _host_numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar metrics as numbers, read from the device in one copy (one host sync at the
    step boundary, not one per metric)."""
    names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
    values = torch.stack([metrics[k].detach().reshape(()).double() for k in names]).tolist() if names else []
    out = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    out.update(zip(names, values, strict=True))
    return out
