"""A progress line every few steps, for output that is not a terminal (a log file, CI):
Lightning's bar redraws itself there, one line per refresh, and floods the log."""

from __future__ import annotations

import sys
import time

import lightning as L


class ProgressLog(L.Callback):
    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = every_n_steps
        self._t0: float | None = None
        self._last = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0, self._last = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if trainer.global_rank != 0 or step == self._last or step % self.every_n_steps:
            return
        elapsed = time.perf_counter() - self._t0
        done = step - self._last
        rate = elapsed / max(done, 1)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        # a rank 0 that runs no steps (an expert rank) has the loss of the last logging step
        # (the strategy mirrors the attention rank's bar metrics there, loggers or not)
        loss = trainer.callback_metrics.get("train_loss", trainer.progress_bar_metrics.get("train_loss"))
        parts = [f"step {step}" + (f"/{total}" if total else ""), f"{rate:.2f} s/step"]
        if loss is not None:
            parts.insert(1, f"train_loss {float(loss):.3f}")
        if total:
            parts.append(f"eta {rate * (total - step):.0f} s")
        print("[hetermoe] " + ", ".join(parts), file=sys.stderr, flush=True)
