"""The load monitor's per-step routing counts: every step recorded, summed over the ranks,
and a checkpoint taken mid-run holds every step up to it (the counts reach the host a step
late, so that reading them makes no host sync; see test_host_syncs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness import run_ranks
from lightning_hetermoe import ExpertLoadMonitor, HeterMoEStrategy
from reference import SEQ, data, make_model, trainer

GLOBAL_BATCH = 8


def fit_with_a_checkpoint(rank: int, world: int, root: str) -> list:
    monitor = ExpertLoadMonitor(plots=False)
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    t = trainer(HeterMoEStrategy(mode="ep"), world, max_steps=3, callbacks=[monitor, ckpt], enable_checkpointing=True)
    t.fit(make_model(4), datamodule=data(world, global_batch=GLOBAL_BATCH))
    return monitor.history


@pytest.mark.slow
def test_every_step_is_recorded_summed_over_ranks_and_a_checkpoint_holds_the_step_it_follows(tmp_path):
    per_rank = run_ranks(2, fit_with_a_checkpoint, 2, str(tmp_path))
    history = per_rank[0]
    assert per_rank[1] == history, "every rank holds the same sums"
    assert len(history) == 3, "the last step too, recorded at the end of training"
    top_k = make_model(4).model_cfg.moe.top_k
    for step in history:
        for layer in step:  # every routed choice of the global batch, no rank's left out
            assert sum(layer) == GLOBAL_BATCH * SEQ * top_k
    saved = torch.load(Path(tmp_path) / "step=2.ckpt", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("ExpertLoadMonitor"))
    assert state["history"] == history[:2]
