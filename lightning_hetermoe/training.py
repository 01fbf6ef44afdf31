"""Build and run a training job from a Hydra/OmegaConf config (used by ``recipes/train.py``)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from .callbacks import RunSummary
from .cluster import ClusterConfig
from .config import DataConfig, ModelConfig, OptimConfig, from_cfg
from .model import ByteCorpusDataModule, MoELanguageModel
from .strategy import HeterMoEStrategy

log = logging.getLogger(__name__)

STRATEGY_FIELDS = ("mode", "expert_parallel_size")


def build_trainer_kwargs(cfg: DictConfig, cluster: ClusterConfig) -> dict[str, Any]:
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kwargs.get("devices") is None:
        kwargs["devices"] = cluster.world_size // int(kwargs.get("num_nodes") or 1)
    return kwargs


def build_strategy(cfg: DictConfig, cluster: ClusterConfig, start_method: str = "popen") -> HeterMoEStrategy:
    scfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    unknown = sorted(set(scfg) - set(STRATEGY_FIELDS))
    if unknown:
        raise ValueError(f"strategy: unknown field(s) {unknown}; valid fields are {list(STRATEGY_FIELDS)}")
    return HeterMoEStrategy(cluster=cluster, start_method=start_method, **scfg)


def train(cfg: DictConfig, output_dir: str | os.PathLike, start_method: str = "popen") -> dict[str, Any] | None:
    """Validate every config group, train, validate, and (rank 0) write ``summary.json``.

    Returns the summary on global rank 0 and ``None`` on other ranks."""
    model_cfg = from_cfg(ModelConfig, cfg.model)
    data_cfg = from_cfg(DataConfig, cfg.data)
    optim_cfg = from_cfg(OptimConfig, cfg.optim)
    cluster = from_cfg(ClusterConfig, cfg.cluster)
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"data.seq_len={data_cfg.seq_len} is invalid: must be <= model.max_seq_len={model_cfg.max_seq_len}")
    strategy = build_strategy(cfg, cluster, start_method)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    summary_cb = RunSummary()
    trainer = L.Trainer(strategy=strategy, callbacks=[summary_cb], logger=False,
                        default_root_dir=str(output_dir), **build_trainer_kwargs(cfg, cluster))
    model = MoELanguageModel(model_cfg, optim_cfg)
    data = ByteCorpusDataModule(data_cfg)
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    if cfg.get("final_validation", True):
        trainer.validate(model, datamodule=data, verbose=False)
    if not trainer.is_global_zero:
        return None
    summary = summary_cb.summary(trainer)
    summary.update({
        "strategy": f"hetermoe:{strategy.mode}",
        "cluster": cluster.name,
        "devices": cluster.devices,
        "model": model_cfg.name,
        "wall_s": time.perf_counter() - started,
    })
    path = Path(output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    log.info(f"summary: {json.dumps(summary)}")
    shown = ", ".join(f"{k}={summary[k]:.4g}" for k in ("first_loss", "final_loss", "val_loss", "tokens_per_s")
                      if isinstance(summary.get(k), (int, float)))
    print(f"[hetermoe] wrote {path}: {shown}", flush=True)
    return summary
