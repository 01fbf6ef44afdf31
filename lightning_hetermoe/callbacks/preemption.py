"""``SaveOnPreemption``: the main job's ``save_checkpoint`` also taken when a SIGTERM stops
the fit, so a preempted job started again in its run directory (``ckpt_path=last``) goes on
from the step it stopped at, not from its last finished run.

A SIGTERM stops every rank before the same batch (:mod:`..strategy.sigterm`), all of them
alive, so the save, a collective, is taken by every rank as at any other point. A fault is
not a preemption: where a rank failed or died its peers could not save with it, so only a
SIGTERM saves here (Lightning's ``OnExceptionCheckpoint`` saves on every exception). A
SIGTERM in the validation after the fit saves nothing: the job saved when the fit ended;
nor does one before the fit's first step (in its sanity check, or fresh or just resumed:
nothing new to keep; a resumed fit's sanity check would write the checkpoint it loaded
again), and a save that fails is said, the job still ending as a preempted one.
"""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException


class SaveOnPreemption(L.Callback):
    """Saves the fit's state to ``path`` (the strategy's checkpoint format) when a SIGTERM
    stops the fit; ``saved`` is the path once it did."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.saved: str | None = None
        self._resumed_at: int | None = None  # None until this fit's training starts

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._resumed_at is None or trainer.global_step == self._resumed_at:
            return  # no step of this fit yet (its sanity check, or before its first step): nothing new to keep
        try:
            trainer.save_checkpoint(self.path)
        except Exception as err:  # the preemption still ends the job as one, with its exit code
            print(f"[hetermoe] rank {trainer.global_rank}: the preempted fit's checkpoint was not saved to "
                  f"{self.path}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return
        self.saved = self.path

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resumed_at = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resumed_at = trainer.global_step  # where this fit's steps start (a resume's restored step)
