"""A sharded checkpoint (torch.distributed.checkpoint, the format large models save) written
from the device and read back: one-rank EP training saved after its second step, then a
fresh model resumed from the directory and one loaded by ``load_from_checkpoint``, each
holding every tensor as saved (weights and the optimizer's state)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .report import Context, Failed, joined
from .runs import data, one_run, tiny_model

STEPS = 2


def _differences(saved: dict[str, Any], got: dict[str, Any], what: str) -> list[str]:
    """The keys of ``saved`` (copies on the CPU) that ``got`` lacks or holds other values under."""
    out = [f"{what}: {k} missing" for k in saved if k not in got]
    out += [f"{what}: {k} differs" for k, v in saved.items()
            if k in got and isinstance(v, torch.Tensor) and not torch.equal(v, got[k].cpu())]
    return out


def _optimizer_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    state = trainer.optimizers[0].state_dict()["state"]
    return {f"{i}.{k}": v.detach().clone().cpu() for i, s in state.items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def check_sharded_checkpoint(ctx: Context) -> str:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from .. import MoELanguageModel

    folder = os.path.join(ctx.workdir, "ckpt-sharded")
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=STEPS, save_top_k=-1)
    sharded = {"checkpoint_format": "sharded"}
    with one_run(ctx, "sharded-save", "ep", strategy_args=sharded, max_steps=STEPS, enable_checkpointing=True,
                 callbacks=[ckpt]) as (_, trainer):
        model = tiny_model()
        trainer.fit(model, datamodule=data())
        saved = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        saved_optim = _optimizer_tensors(trainer)
    path = ckpt.best_model_path or ckpt.last_model_path
    if not path or not os.path.isdir(path):
        raise Failed(f"no sharded checkpoint directory was written (got {path!r})")
    problems = []
    again = ModelCheckpoint(dirpath=folder, every_n_train_steps=STEPS, save_top_k=-1)  # as saved, Lightning asks
    with one_run(ctx, "sharded-resume", "ep", strategy_args=sharded, max_steps=STEPS, enable_checkpointing=True,
                 callbacks=[again]) as (_, trainer):
        torch.manual_seed(1)  # another initialisation: only the checkpoint can make it equal
        resumed = tiny_model()
        trainer.fit(resumed, datamodule=data(), ckpt_path=path)
        problems += _differences(saved, resumed.state_dict(), "resumed weights")
        problems += _differences(saved_optim, _optimizer_tensors(trainer), "resumed optimizer state")
    loaded = MoELanguageModel.load_from_checkpoint(path, map_location=ctx.device)
    problems += _differences(saved, loaded.state_dict(), "load_from_checkpoint")
    if problems:
        raise Failed(joined(problems))
    files = sorted(os.listdir(path))
    return f"{len(saved)} tensors and {len(saved_optim)} optimizer tensors through {path!r} ({len(files)} files)"
