"""Callback metrics on every rank, where only some ranks log.

Under zebra and distep the user's steps run on the attention ranks only, so ``self.log``
fills ``trainer.callback_metrics`` there and nowhere else. The callbacks that read them
(``ModelCheckpoint(monitor=...)``, ``EarlyStopping``) run on every rank and take collective
decisions (a sharded save, ``should_stop``): an expert rank without the metric raises, or
decides otherwise and hangs the next collective. So before any other callback reads them,
every rank takes the first attention rank's callback metrics (already reduced over the
attention ranks where ``sync_dist`` asked for it), as DDP's ranks would each hold them.

Only where a callback reads them: reading ``trainer.callback_metrics`` makes Lightning turn
every progress-bar metric into a Python number (an ``.item()``, a host sync on a GPU), and
sharing reads the values on the host once more, so a training batch after which no
checkpoint checks shares nothing. They are shared at the end of validation (the monitored
``val_loss``), at the end of training (what a script reads after ``fit``), at the end of a
training epoch where a checkpoint or early stopping callback runs, and after a training
batch only where a ``ModelCheckpoint`` checks at that step (``every_n_train_steps``;
``train_time_interval`` checks the time after every batch); and after every training batch
(or epoch) where a ``ReduceLROnPlateau`` steps per step (or epoch): Lightning steps it on
every rank from the monitored metric. A
callback of the user's own that reads metrics after every training batch sees those of
the last share on the ranks that do not log.

**What the loggers write and the progress bar shows.** Lightning's loggers write, and its
progress bar draws, on global rank 0 only. Where rank 0 logs nothing (a plan that makes it an
expert rank: the cluster lists an older GPU first), the training curves never reached
TensorBoard or the CSV file (only the values every rank logs: validation, the callbacks'), and
the bar showed no loss. :func:`mirror_logged_metrics` makes every rank's write go through one
gather of the first attention rank's logged and progress-bar metrics, which rank 0 writes and
draws beside its own (and a callback of rank 0 reads: the recipes' progress line): one host
collective per logging step (Lightning calls the write on every rank at the same steps, with
or without loggers), none where rank 0 logs itself. The bar's values on rank 0 are those of
the last logging step (``log_every_n_steps``), not of every batch: a gather per batch would
be a host sync per step.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

import lightning_hetermoe.comm as comm


class SharedCallbackMetrics(L.Callback):
    """Installed first by the strategy where the backend names a metrics source.
    ``local_names``: what evaluation steps logged on the attention ranks only (the backend's
    :meth:`local_evaluation_names`), shared at the evaluation epoch's end."""

    def __init__(self, source: int, local_names: Any = None) -> None:
        self.source = source
        self.local_names = local_names or (lambda: [])

    def _share(self, trainer: Any) -> None:
        mine = trainer.global_rank == self.source
        # Read on every rank: the first read of an epoch's metrics logged with sync_dist runs
        # their reduce over the attention ranks, which every attention rank must join (read
        # on the source alone, it waited there for peers already in the gather below)
        metrics = trainer.callback_metrics
        described = _host_numbers(metrics) if mine else None
        numbers, dtypes = comm.gather_objects(comm.world(), described, what="strategy.callback_metrics")[self.source]
        if not mine and numbers:
            # the connector's own store: its callback_metrics property adds this rank's (none) on top
            trainer._logger_connector._callback_metrics.update(
                _on_device(numbers, dtypes, trainer.strategy.root_device))

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if _plateau(trainer, "step") or any(_checks_after_batch(c, trainer) for c in trainer.callbacks):
            self._share(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if _plateau(trainer, "epoch") or any(isinstance(c, (ModelCheckpoint, EarlyStopping)) for c in trainer.callbacks):
            self._share(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._share(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # what a script reads after fit (an objective for a sweep) is the run's last, everywhere
        self._share(trainer)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._share_evaluation(trainer, pl_module)

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._share_evaluation(trainer, pl_module)

    def _share_evaluation(self, trainer: Any, pl_module: Any) -> None:
        """The epoch's value of each name the evaluation steps logged on the attention ranks
        only (a torchmetrics object computes itself there, over them), logged on the ranks
        that lack it, so that what ``trainer.validate``/``test`` return and print is the same
        on every rank, as under DDP. Before Lightning gathers the epoch's results: every
        rank's callbacks run this hook, first."""
        names = self.local_names()
        if not names:  # alike on every rank
            return
        metrics = trainer.callback_metrics  # on the attention ranks: each object's compute, over them
        mine = trainer.global_rank == self.source
        # keys as Lightning shows them: with several loaders, suffixed by the loader's index
        ours = {k: v for k, v in metrics.items() for n in names if k == n or k.startswith(f"{n}/dataloader_idx_")} \
            if mine else None
        numbers, dtypes = comm.gather_objects(comm.world(), _host_numbers(ours) if mine else None,
                                              what="strategy.evaluation_metrics")[self.source]
        missing = {k: v for k, v in numbers.items() if k not in metrics}
        for key, value in _on_device(missing, dtypes, pl_module.device).items():
            pl_module.log(key, value, on_step=False, on_epoch=True, add_dataloader_idx=False)


def _plateau(trainer: Any, interval: str) -> bool:
    """Whether a scheduler that reads a monitored metric (``ReduceLROnPlateau``) steps per
    ``interval``: Lightning steps it after the training batch's (or epoch's) callbacks, on
    every rank, from the callback metrics."""
    return any(c.reduce_on_plateau and c.interval == interval for c in trainer.lr_scheduler_configs)


def _checks_after_batch(callback: Any, trainer: Any) -> bool:
    """Whether ``callback`` reads the callback metrics at the end of this training batch: a
    ``ModelCheckpoint`` whose ``every_n_train_steps`` falls on this step, or one that checks
    the time (Lightning's own conditions; it keeps them in private attributes)."""
    if not isinstance(callback, ModelCheckpoint):
        return False
    if getattr(callback, "_train_time_interval", None) is not None:
        return True
    every = getattr(callback, "_every_n_train_steps", 0) or 0
    return every >= 1 and trainer.global_step % every == 0


def _host_numbers(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, torch.dtype]]:
    """The scalar metrics as numbers, read from the device in one copy (one host sync where
    metrics are shared, not one per metric), and the dtype of each tensor among them."""
    names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
    values = torch.stack([metrics[k].detach().reshape(()).double() for k in names]).tolist() if names else []
    out = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    out.update(zip(names, values, strict=True))
    return out, {k: metrics[k].dtype for k in names}


def _on_device(numbers: dict[str, float], dtypes: dict[str, torch.dtype], device: torch.device
               ) -> dict[str, torch.Tensor]:
    """Host numbers as tensors on ``device``, where the attention ranks' metrics live: in one
    copy from pinned memory (no host sync), each in the dtype it was logged in."""
    if not numbers:
        return {}
    values = comm.to_device(torch.tensor(list(numbers.values()), dtype=torch.float64, device="cpu"), device)
    return {k: values[i].to(dtypes.get(k, torch.float32)) for i, k in enumerate(numbers)}


def mirror_logged_metrics(trainer: Any, source: int | None) -> None:
    """Where global rank 0 logs nothing (``source``, the first attention rank, is another),
    what the loggers write on rank 0 includes ``source``'s metrics (see the module docstring).
    Idempotent; undone where rank 0 logs (a later run on the same trainer)."""
    connector = trainer._logger_connector  # Lightning's: its log_metrics is what every rank calls
    original = getattr(connector, "_hetermoe_original_log_metrics", None)
    if original is not None:
        connector.log_metrics = original
        del connector._hetermoe_original_log_metrics
    if source is None or source == 0 or trainer.world_size < 2:
        return
    original = connector.log_metrics
    rank = trainer.global_rank

    def log_metrics(metrics: dict, step: int | None = None) -> None:
        written = bool(trainer.loggers)  # alike on every rank
        mine = None
        if rank == source:
            # the bar's metrics as Lightning keeps them: already reduced where they were logged
            # (a step's at its log call, an epoch's when this write's caller read them)
            mine = {"log": _host_numbers(metrics)[0] if written else {},
                    "pbar": _host_numbers(connector.progress_bar_metrics)[0]}
        theirs = comm.gather_objects(comm.world(), mine, what="strategy.logged_metrics")[source] or {}
        if rank == 0 and theirs:
            # rank 0's own values win (what it logged itself: the callbacks'; the bar's
            # property lays what rank 0 logged over this store at each read); the step is
            # Lightning's count, the same on every rank
            connector._progress_bar_metrics.update(theirs["pbar"])
            metrics = {**{k: torch.tensor(v, dtype=torch.float64, device="cpu") for k, v in theirs["log"].items()},
                       **metrics}
        return original(metrics, step)

    connector._hetermoe_original_log_metrics = original
    connector.log_metrics = log_metrics
