"""summary.json's step time is per optimizer step, also under gradient accumulation."""

import lightning as L

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
