"""summary.json's step time is per optimizer step, also under gradient accumulation."""

import time

import lightning as L
import pytest
import torch

from harness import run_ranks
from lightning_hetermoe import RunSummary
from reference import data, make_model


def test_step_time_and_losses_are_per_optimizer_step_under_accumulation():
    summary = RunSummary(warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[summary])
    trainer.fit(make_model(4), datamodule=data(1))
    out = summary.summary(trainer)
    assert out["steps"] == 4
    assert len(summary.losses) == 4, "one loss per optimizer step (the mean of its 2 batches)"
    assert len(summary.step_times) == 3, "one time per optimizer step, the first left out"
    # two batches of 8 sequences x 16 tokens per optimizer step
    assert abs(out["tokens_per_s"] * out["step_time_s"] - 2 * 8 * 16) < 1e-6 * 256


def test_a_run_with_no_step_past_its_warm_up_has_no_throughput_and_its_summary_is_json():
    """One step, the warm-up: nothing timed. Its tokens/s is null, not NaN, which is no JSON:
    strict readers (JavaScript's JSON.parse, jq) refuse the whole summary.json over it."""
    import json

    summary = RunSummary(warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[summary])
    trainer.fit(make_model(4), datamodule=data(1))
    out = summary.summary(trainer)
    assert out["steps"] == 1 and out["first_loss"] is not None
    assert out["tokens_per_s"] is None and out["step_time_s"] is None
    json.dumps(out, allow_nan=False)  # raises on a NaN or an infinity


SLOW_S = 0.6  # rank 1's extra time in each optimizer step, after the backward's collectives


class _SlowOptimizerStep(L.Callback):
    """Rank 1 spends longer in its optimizer step; then every rank meets at a barrier after
    the step (as ExpertLoadMonitor's all-reduce does), where rank 0 waits outside its step."""

    def __init__(self, summary: RunSummary) -> None:
        self.summary, self.own = summary, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 1:
            time.sleep(SLOW_S)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.summary.step_times) > len(self.own):
            self.own.append(self.summary.step_times[-1])  # this rank's own clock, before the gather
        torch.distributed.barrier()


def _fit_with_a_slow_rank(rank: int):
    summary = RunSummary(warmup_steps=1)
    slow = _SlowOptimizerStep(summary)
    trainer = L.Trainer(strategy="hetermoe", accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[summary, slow])
    trainer.fit(make_model(4), datamodule=data(2))
    return slow.own, summary.step_times, summary.summary(trainer)["step_time_s"]


@pytest.mark.slow
def test_a_step_lasts_until_its_slowest_rank_is_done():
    (own0, times0, step0), (own1, times1, step1) = run_ranks(2, _fit_with_a_slow_rank)
    assert len(own0) == len(own1) == 2, "two timed steps on each rank"
    # rank 0 finished its steps early and waited for rank 1 at the barrier, outside its clock
    assert max(own0) < SLOW_S <= min(own1)
    assert times0 == times1 == [max(a, b) for a, b in zip(own0, own1, strict=True)]
    assert step0 == step1 == sum(times0) / 2 >= SLOW_S
