"""Faults to inject into real runs (used through Hydra's ``+callbacks.<name>._target_``)."""

import os
import signal

import lightning as L


class KillRankAt(L.Callback):
    """Rank ``rank`` kills itself with SIGKILL when batch ``step`` starts (a crashed GPU node)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RaiseAt(KillRankAt):
    """Rank ``rank`` raises when batch ``step`` starts (a bug in user code)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {trainer.global_step}")


class KillInExperts(KillRankAt):
    """Rank ``rank`` kills itself inside an expert computation of step ``step`` (mid-schedule)."""

    where = "experts"  # the MoE layer's part whose forward the fault strikes in

    def act(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def setup(self, trainer, pl_module, stage):
        from lightning_hetermoe import MoELayer

        def hook(module, args):
            if trainer.global_rank == self.rank and trainer.global_step >= self.step:
                self.act()

        for m in pl_module.modules():
            if isinstance(m, MoELayer):
                getattr(m, self.where).register_forward_pre_hook(hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass


class RaiseInRouter(KillInExperts):
    """Rank ``rank`` raises inside a router forward of step ``step`` (inside a zebra fiber)."""

    where = "router"

    def act(self) -> None:
        raise RuntimeError(f"injected failure in a router on rank {self.rank}")


class StopInExperts(KillInExperts):
    """Rank ``rank`` stops itself (SIGSTOP) inside an expert computation of step ``step``: a
    frozen host. No process dies and no socket closes; only a heartbeat can tell."""

    def act(self) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)


class SleepInExperts(KillInExperts):
    """Rank ``rank`` sleeps inside an expert computation of step ``step``: alive (its
    heartbeat beats on) but stuck, as behind a hung GPU or a deadlock in user code."""

    def act(self) -> None:
        import time

        time.sleep(600)


class ForwardOnOneRank(KillRankAt):
    """Rank ``rank`` runs the model on a few tokens after batch ``step`` and no other rank
    does: a sample generated under ``if trainer.is_global_zero:`` (or another rank's test)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import torch

        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model(batch[0][:1, :8])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass
