"""A training job's config read and checked whole before anything heavy loads.

``recipes/train.py`` reads every group here first: a wrong field is named in well under a
second, where building the run imports Lightning and torch (about 4 s) before it could say
so. Only what needs them is left to :func:`lightning_hetermoe.training.train`: whether an
expert backend runs on the device, the callbacks' and loggers' classes, Lightning's own
checks of the trainer's arguments.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .checkpoint_files import NOT_TORCH_SAVE, is_sharded_checkpoint, is_torch_save_file
from .cluster import ClusterConfig
from .configs import ConfigError, DataConfig, ModelConfig, OptimConfig, from_cfg
from .staging import unfinished_note
from .strategy.arguments import StrategyArguments

# the strategy group's fields: the strategy's own arguments (its cluster is the cluster group)
STRATEGY_FIELDS = tuple(f.name for f in fields(StrategyArguments) if f.name != "cluster")

# Trainer arguments that must be whole numbers (None and -1 keep Lightning's meaning).
INT_TRAINER_FIELDS = ("max_steps", "min_steps", "max_epochs", "min_epochs", "num_nodes", "log_every_n_steps",
                      "accumulate_grad_batches", "num_sanity_val_steps", "check_val_every_n_epoch")


@dataclass(frozen=True)
class RunConfig:
    """The job's config groups as checked dataclasses and keyword arguments."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    cluster: ClusterConfig
    strategy: dict[str, Any]  # HeterMoEStrategy's keyword arguments, paths absolute (its cluster apart)
    trainer: dict[str, Any]  # Lightning Trainer's keyword arguments
    init_on_meta: bool
    ckpt_path: str | None = None  # the checkpoint fit resumes from (a path made absolute, or Lightning's names)
    resume_routing: bool = True  # a resumed fit plans at the routing of the checkpoint's last steps


# ckpt_path values Lightning resolves itself, from the trainer's checkpoint callbacks or the cluster
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


def read_run_config(cfg: DictConfig) -> RunConfig:
    """Every config group checked (see the module): raises :class:`ConfigError` naming the
    first wrong field and what would be valid."""
    model_cfg = from_cfg(ModelConfig, cfg.model, "model")
    data_cfg = from_cfg(DataConfig, cfg.data, "data")
    optim_cfg = from_cfg(OptimConfig, cfg.optim, "optim")
    cluster = from_cfg(ClusterConfig, cfg.cluster, "cluster")
    data_cfg, model_cfg = fit_data_and_model(data_cfg, model_cfg)
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"data.seq_len={data_cfg.seq_len} is invalid: must be <= model.max_seq_len={model_cfg.max_seq_len}")
    strategy = strategy_kwargs(cfg)
    # every field's check; the strategy repeats them as it is built
    arguments = StrategyArguments(cluster=cluster, **strategy)
    trainer = build_trainer_kwargs(cfg, cluster)
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, int) and not isinstance(devices, bool) and isinstance(nodes, int):
        # the world against the cluster, the plan and the mode; the precision the strategy checks once
        # Lightning has resolved it (16-mixed is bf16 on a CPU)
        arguments.check_world(devices * nodes)
        arguments.check_nodes(nodes, devices)
    if trainer.get("accelerator") == "cpu":
        check_host_memory(model_cfg, optim_cfg, trainer)
    resume_routing = cfg.get("resume_routing", True)
    if not isinstance(resume_routing, bool):
        raise ConfigError(f"resume_routing={resume_routing!r} is invalid: must be true (a resumed fit plans at the "
                          f"routing of its checkpoint's last steps) or false (at a fresh router's warm-up)")
    return RunConfig(model=model_cfg, data=data_cfg, optim=optim_cfg, cluster=cluster, strategy=strategy,
                     trainer=trainer, init_on_meta=builds_on_meta(cfg, model_cfg), ckpt_path=resume_path(cfg),
                     resume_routing=resume_routing)


def resume_path(cfg: DictConfig) -> str | None:
    """``ckpt_path``: a checkpoint to resume from, made absolute (Hydra runs the job in its
    own directory), which must exist: a file, or a sharded checkpoint's directory. Lightning's
    own names pass as they are."""
    path = cfg.get("ckpt_path")
    if path is None:
        return None
    path = str(path)
    if path == "best":
        # Lightning knows a ModelCheckpoint's best only after a fit in its own process: a fit
        # named so in a new one fails at its start, a traceback from deep in Lightning
        raise ConfigError("ckpt_path='best' is invalid here: Lightning knows a ModelCheckpoint's best checkpoint "
                          "only after a fit in the same process, and this job is a new one; give the best "
                          "checkpoint's path (an earlier run's ModelCheckpoint wrote it in its dirpath), or "
                          "ckpt_path=last")
    if (path == "registry" or path.startswith("registry:")) and importlib.util.find_spec("litmodels") is None:
        raise ConfigError(f"ckpt_path={path!r} is invalid here: Lightning reads a model registry through the "
                          f"litmodels package, which is not installed (pip install litmodels); or give a "
                          f"checkpoint's path")
    if path in LIGHTNING_CKPT_NAMES or path.startswith("registry:") or "://" in path:
        return path  # Lightning's to resolve (a model registry's version, a remote file system's URL)
    if HydraConfig.initialized():
        from hydra.utils import to_absolute_path

        path = to_absolute_path(path)
    if not os.path.exists(path):
        # (the first save of that name killed before its end: its partial copy is beside it)
        raise ConfigError(f"ckpt_path={cfg.get('ckpt_path')!r} is invalid: no such file or directory ({path})"
                          f"{unfinished_note(path)}; "
                          f"give a checkpoint file, a sharded checkpoint's directory, or last (the run "
                          f"directory's save_checkpoint, else a checkpoint callback's last)")
    if os.path.isdir(path) and not is_sharded_checkpoint(path):
        raise ConfigError(f"ckpt_path={cfg.get('ckpt_path')!r} is invalid: {path} is a directory but not a sharded "
                          f"checkpoint (no .metadata in it); give the checkpoint file or directory a run saved")
    if os.path.isfile(path) and not is_torch_save_file(path):
        raise ConfigError(f"ckpt_path={cfg.get('ckpt_path')!r} is invalid: {path} is not a checkpoint "
                          f"({NOT_TORCH_SAVE}); give the checkpoint file or directory a run saved")
    return path


def check_host_memory(model_cfg: ModelConfig, optim_cfg: OptimConfig, trainer: dict[str, Any]) -> None:
    """On CPU processes the model's training state lives in the machines' memory, every
    parameter's weight, gradient and optimizer state at least once however the ranks share
    it: a model whose state cannot fit in what this machine has available would end in the
    kernel's out-of-memory kill of a rank, minutes in. Refused here, with the numbers (where
    the system says what is available: Linux's ``MemAvailable``)."""
    available = available_host_bytes()
    if available is None:
        return
    from .profile.memory import MemoryModel, optimizer_pricing

    # weights stored at 2 bytes (Lightning's "16" and "bf16" are its -mixed: fp32 weights)
    half = str(trainer.get("precision")) in ("bf16-true", "16-true")
    state_bytes = optimizer_pricing(optim_cfg)[0] / (2 if half else 1)
    per_param = (2 if half else 4) * 2 + state_bytes  # weight, gradient, optimizer state
    params = MemoryModel(model_cfg).model_params()
    need = params * per_param / max(int(trainer.get("num_nodes") or 1), 1)
    if need <= available:
        return
    accelerator = trainer.get("accelerator")
    where = "trainer.accelerator=cpu" if accelerator == "cpu" else f"trainer.accelerator={accelerator} without a GPU"
    raise ConfigError(
        f"model {model_cfg.name!r} does not fit this machine's memory: {where} keeps its training "
        f"state in host memory, and its {params / 1e9:.3g} B parameters need at least {need / 1e9:.3g} GB "
        f"(weight, gradient and {optim_cfg.name} state, {per_param:g} bytes a parameter, each held once over the "
        f"ranks) where {available / 1e9:.3g} GB is available. An emulated cluster times its workload's GPU tasks "
        f"but trains the model itself on the CPU: train a small model on it (model=tiny, the main job's), or this "
        f"one on GPUs (trainer.accelerator=gpu)")


def available_host_bytes() -> float | None:
    """This machine's memory available to new work (Linux's ``MemAvailable``); ``None``
    where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def strategy_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The strategy group's fields, unknown ones named; paths made absolute (Hydra runs the
    job in its own directory, the user named them from where they started it)."""
    scfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    unknown = sorted(set(scfg) - set(STRATEGY_FIELDS))
    if unknown:
        raise ConfigError(f"strategy: unknown field(s) {unknown}; valid fields are {list(STRATEGY_FIELDS)}")
    from hydra.utils import to_absolute_path

    for key in ("plan", "profile", "expert_load"):
        if isinstance(scfg.get(key), str) and HydraConfig.initialized():
            scfg[key] = to_absolute_path(scfg[key])
    return scfg


def build_trainer_kwargs(cfg: DictConfig, cluster: ClusterConfig) -> dict[str, Any]:
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    for key in INT_TRAINER_FIELDS:
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"trainer.{key}={value!r} is invalid: must be an integer")
    if "logger" in kwargs:
        raise ConfigError("trainer.logger is set by the logger config group: use logger=csv, logger=tensorboard or "
                          "logger=none (files land in the run directory)")
    for key in ("accumulate_grad_batches", "log_every_n_steps"):
        if kwargs.get(key) is not None and kwargs[key] < 1:
            raise ConfigError(f"trainer.{key}={kwargs[key]!r} is invalid: must be >= 1")
    if cluster.nodes and not cluster.emulate and kwargs.get("num_nodes") is None:
        kwargs["num_nodes"] = cluster.num_nodes  # a cluster of nodes runs one Lightning node per node
    if kwargs.get("devices") is None:
        kwargs["devices"] = cluster.world_size // int(kwargs.get("num_nodes") or 1)
    return kwargs


# Above SMALL_STATE_BYTES of training state (profile/memory.py), the recipe builds the model
# on the meta device by default: each process then allocates only its share at set-up. Below
# it, the model is built whole: small, and the planner gets the routing of warm-up batches
# through it (a model on the meta device plans with even routing). The strategy's
# checkpoint_format: auto draws the same line.


def builds_on_meta(cfg: DictConfig, model_cfg: ModelConfig) -> bool:
    """``init_on_meta``: true, false or auto (by the model's training state)."""
    choice = cfg.get("init_on_meta", "auto")
    if choice in (True, False):
        return choice
    if choice != "auto":
        raise ConfigError(f"init_on_meta={choice!r} is invalid: must be true, false or auto")
    from .profile.memory import MemoryModel, small_training_state

    return not small_training_state(MemoryModel(model_cfg).model_params())


def fit_data_and_model(data_cfg: DataConfig, model_cfg: ModelConfig) -> tuple[DataConfig, ModelConfig]:
    """A tokenised corpus: ``data.path`` made absolute (Hydra keeps the launch directory)
    and read, the model's vocabulary raised to the corpus's when smaller (printed); a
    larger one is kept (rows no id reaches, as padded vocabularies have). The tokenizer
    decides which ids exist: an embedding smaller than them could not run, so it is never
    right to keep, and ``model.vocab_size`` need not repeat what ``meta.json`` records."""
    if data_cfg.corpus != "tokenized":
        return data_cfg, model_cfg
    from .corpus.format import read_meta

    path = data_cfg.path
    if HydraConfig.initialized():
        from hydra.utils import to_absolute_path

        path = to_absolute_path(path)
    data_cfg = replace(data_cfg, path=str(path))
    meta = read_meta(path)
    if model_cfg.vocab_size < meta.vocab_size:
        if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
            print(f"[hetermoe] model.vocab_size={model_cfg.vocab_size} -> {meta.vocab_size}: the corpus's tokenizer "
                  f"({Path(path) / 'meta.json'})", flush=True)
        model_cfg = replace(model_cfg, vocab_size=meta.vocab_size)
    if data_cfg.document_mask and model_cfg.architecture != "pack":
        raise ConfigError(f"data.document_mask=true is invalid with model.architecture={model_cfg.architecture!r}: "
                          f"only the pack's model takes segment ids (packed documents); set data.document_mask=false")
    return data_cfg, model_cfg
