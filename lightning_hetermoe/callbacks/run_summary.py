"""Loss trajectory and throughput of a run, for ``summary.json`` and sweep tables."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch


class RunSummary(L.Callback):
    """Records the training loss of every step and global tokens/s.

    Throughput skips the first ``warmup_steps`` steps (process start-up, allocator
    warm-up) and counts the tokens of every rank: per-rank batch tokens x world size.
    """

    def __init__(self, warmup_steps: int = 1) -> None:
        self.warmup_steps = warmup_steps
        self.losses: list[float] = []
        self._tokens = 0
        self._t0: float | None = None
        self._elapsed = 0.0
        self.step_times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if len(self.losses) >= self.warmup_steps:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is None and isinstance(outputs, dict):
            loss = outputs.get("loss")
        if loss is not None:
            self.losses.append(float(loss))
        if self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self._elapsed += dt
            self.step_times.append(dt)
            self._tokens += batch[0].numel() * trainer.world_size
            self._t0 = None

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self._elapsed if self._elapsed > 0 else float("nan")

    def summary(self, trainer: L.Trainer) -> dict[str, Any]:
        tail = self.losses[-5:]
        val = trainer.callback_metrics.get("val_loss")
        return {
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "val_loss": float(val) if isinstance(val, torch.Tensor) else val,
            "tokens_per_s": self.tokens_per_s,
            # Wall seconds per training step after warm-up (forward, backward, optimizer).
            "step_time_s": self._elapsed / len(self.step_times) if self.step_times else None,
            "step_time_median_s": sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else None,
            "steps": trainer.global_step,
            "world_size": trainer.world_size,
        }
