"""Build and run a training job from a Hydra/OmegaConf config (used by ``recipes/train.py``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from .callbacks import ExpertLoadMonitor, ExpertRebalancer, RunSummary
from .callbacks.preemption import SaveOnPreemption
from .callbacks.progress import ProgressLog
from .cluster import ClusterConfig
from .configs import ConfigError, ModelConfig, OptimConfig
from .emulate import FAITHFUL_SLIP
from .model import MoELanguageModel, build_datamodule
from .quiet import mute_dependency_noise
from .run_config import RunConfig, check_host_memory, read_run_config
from .strategy import HeterMoEStrategy

log = logging.getLogger(__name__)


def instantiate_group(cfg: DictConfig, group: str, what: str, **defaults: Any) -> list[Any]:
    """``cfg.<group>``: name -> ``{_target_: ..., **kwargs}`` (lightning-hydra-template), each
    built with ``hydra.utils.instantiate``; ``defaults`` fill keys the node leaves null."""
    from hydra.utils import instantiate

    out = []
    for name, node in (cfg.get(group) or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise ConfigError(f"{group}.{name} needs a _target_ ({what})")
        extra = {k: v for k, v in defaults.items() if node.get(k, None) is None}
        out.append(instantiate(node, **extra))
    return out


def build_loggers(cfg: DictConfig, output_dir: str | os.PathLike) -> list[Any]:
    """``save_dir: null`` is the run directory."""
    return instantiate_group(cfg, "logger", "a Lightning logger class path", save_dir=str(output_dir))


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    return instantiate_group(cfg, "callbacks", "the callback's class path")


def build_model(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> L.LightningModule:
    """The LightningModule ``model.architecture`` names, at ``model_cfg``'s shape."""
    if model_cfg.architecture == "pack":
        return MoELanguageModel(model_cfg, optim_cfg)
    try:
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError as err:  # not installed, or installed and broken: say which
        raise ConfigError(f"model.architecture=hf_mixtral needs transformers: pip install -e '.[hf]' (importing it "
                          f"failed: {err})") from None
    from .convert import HFMoELanguageModel, to_hetermoe
    from .convert.mixtral import mixtral_config_kwargs

    try:
        hf = MixtralForCausalLM(MixtralConfig(**mixtral_config_kwargs(model_cfg))).float()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    moe = model_cfg.moe
    if model_cfg.activation_checkpointing:
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    options = dict(capacity_factor=moe.capacity_factor, z_loss_coef=moe.z_loss_coef, expert_backend=moe.expert_backend,
                   recompute_activation=moe.recompute_activation, jitter_eps=moe.jitter_eps,
                   expert_bias=moe.expert_bias, bias_update_rate=moe.bias_update_rate)
    return HFMoELanguageModel(to_hetermoe(hf, **options), optim_cfg, loss_chunk_tokens=model_cfg.loss_chunk_tokens)


def resumed_routing(run: RunConfig) -> dict[str, Any]:
    """The strategy's arguments; where the fit resumes from a checkpoint a load monitor
    saved into, ``strategy.expert_load`` gives no routing and ``resume_routing`` is on, with
    the routing of the checkpoint's last recorded steps as ``expert_load``
    (:meth:`ExpertLoadMonitor.saved_routing`): the plan is made and every prediction priced
    at where the routing had got to. The set-up's warm-up would sample a fresh router's
    instead: the checkpoint's weights are loaded once the strategy has laid the model out,
    after it plans. Lightning's names for a checkpoint (``last``, ``hpc``, ...) are resolved
    only as the fit starts: those keep the warm-up."""
    kwargs = dict(run.strategy)
    path = run.ckpt_path
    if not run.resume_routing or kwargs.get("expert_load") is not None or path is None or not os.path.exists(path):
        return kwargs
    from .routing_record import check_shape

    record = ExpertLoadMonitor.saved_routing(path, run.model.name)
    try:
        kwargs["expert_load"] = check_shape(record, run.model, "ckpt_path") if record is not None else None
    except ConfigError:
        pass  # another model's checkpoint: loading it says so, naming what differs
    return kwargs


PREEMPTED_EXIT = 128 + 15  # rank 0's exit code after a SIGTERM stopped the fit (128 + SIGTERM)
AT_LOAD_STEPS = 64  # the most timed steps whose routing the at-load prediction averages over


def timing_summary(summary: dict[str, Any], strategy: HeterMoEStrategy, cluster: ClusterConfig,
                   emulation: dict[str, Any] | None, monitor: ExpertLoadMonitor | None = None) -> dict[str, Any]:
    """Measured beside predicted, and the emulated clock's honesty."""
    out: dict[str, Any] = {}
    pred = strategy.prediction
    measured = summary.get("step_time_s")
    if pred is not None:
        out["predicted_schedule"] = pred["schedule"]
        out["predicted_step_time_s"] = pred["step_time_s"]
        # the routing the prediction assumed, measured on sampled batches at set-up: the
        # busiest expert's share over the mean, batch by batch (averaged)
        out["predicted_expert_load_max_over_mean"] = pred["expert_load_max_over_mean"]
        out["predicted_at_routing"] = pred["routing"]  # the warm-up's sample, a record's (a resumed fit's), even
        # one step's spread around that mean from its batch's routing alone (sd / mean over the
        # held-out batches): a mean over n timed steps strays about this / sqrt(n) by chance
        out["predicted_step_time_batch_spread"] = pred["step_time_batch_spread"]
        out["bound_tokens_per_s"] = pred["bound_tokens_per_s"]
        out["predicted_fraction_of_bound"] = pred["fraction_of_bound"]
        if measured:
            out["step_time_rel_error"] = (measured - pred["step_time_s"]) / pred["step_time_s"]
        # the timed steps are the history's last: a resumed fit's monitor holds the steps before
        # it too (a summary that does not say how many: every step after the warm-up)
        timed = summary.get("timed_steps")
        steps = monitor.step_shares(skip=summary.get("timing_warmup_steps", 1), last=timed) \
            if monitor is not None and timed != 0 else None
        if steps is not None:
            # a simulation per step: a long run's steps, evenly thinned to AT_LOAD_STEPS
            steps = steps[::-(-len(steps) // AT_LOAD_STEPS)]
            # the same prediction with the routing this run's timed steps really had, step by
            # step, and the experts where the run left them: after a rebalancer's moves the
            # plan's placement is not the run's (a step timed before a move is priced after it)
            seen = strategy.predict(strategy.trained_placement, batch_loads=steps)
            at_load = out["predicted_step_time_at_measured_load_s"] = seen["step_time_s"]
            # step by step: a routing that drifts as the model trains shows as a trend
            out["predicted_step_time_at_measured_load_by_step_s"] = seen["step_times_s"]
            out["expert_load_max_over_mean"] = seen["expert_load_max_over_mean"]
            if measured and at_load:
                out["step_time_rel_error_at_measured_load"] = (measured - at_load) / at_load
    if strategy.schedule in ("zebra", "distep"):
        out["plan"] = "plan.json"
        out["num_microbatches"] = strategy.num_microbatches
    if emulation is not None:
        frac, slip = emulation["overrun_fraction"], emulation["slip_fraction"]
        out["emulation"] = {"padded_tasks": emulation["padded_tasks"], "overruns": emulation["overruns"],
                            "overrun_fraction": frac, "slip_fraction": slip, "faithful": slip <= FAITHFUL_SLIP,
                            "needed_time_scale": max((r or {}).get("needed_time_scale", 0.0)
                                                     for r in emulation["ranks"]),
                            # where the clock slipped: rank -> task kind -> overrun count
                            "overruns_by_rank": {str(i): {k: t["overruns"] for k, t in r["tasks"].items()
                                                          if t["overruns"]}
                                                 for i, r in enumerate(emulation["ranks"]) if r},
                            # and by how much: rank -> task kind -> seconds over the modelled times
                            "slip_s_by_rank": {str(i): {k: t["slip_s"] for k, t in r["tasks"].items() if t["slip_s"]}
                                               for i, r in enumerate(emulation["ranks"]) if r}}
        if slip > FAITHFUL_SLIP:
            out["emulation"]["warning"] = (f"a rank's emulated tasks ran {slip:.1%} past their modelled time "
                                           f"({frac:.0%} of all tasks overran): the clock is not faithful; raise "
                                           f"cluster.time_scale")
        if pred is not None and measured:
            # the workload's tokens per second on the cluster the run emulates (its clock / time_scale)
            out["workload_tokens_per_s"] = pred["workload_tokens_per_step"] / (measured / cluster.time_scale)
            out["workload"] = cluster.emulate_workload or {"model": summary.get("model")}
    return out


VERDICT_TOLERANCE = 0.05  # a step within this of its prediction is said to be on it


def prediction_verdict(summary: dict[str, Any], output_dir: str | os.PathLike) -> str | None:
    """One line for the user: the measured step against the set-up's prediction and, where
    the run measured its routing, against the same prediction at that routing, and what
    the difference points to (``None`` where nothing was predicted or measured)."""
    measured, predicted = summary.get("step_time_s"), summary.get("predicted_step_time_s")
    if not measured or not predicted:
        return None
    line = (f"[hetermoe] prediction: step {measured:.4g} s measured, {predicted:.4g} s predicted at set-up "
            f"({(measured - predicted) / predicted:+.1%})")
    at_load = summary.get("predicted_step_time_at_measured_load_s")
    off = abs(measured - predicted) / predicted > VERDICT_TOLERANCE
    if not at_load:
        return line + (f": more than {VERDICT_TOLERANCE:.0%} off; the load monitor (callbacks.load_monitor) records "
                       f"the routing that would say why" if off else ": on the prediction")
    off_at_load = abs(measured - at_load) / at_load > VERDICT_TOLERANCE
    line += f"; at the routing the timed steps had, {at_load:.4g} s ({(measured - at_load) / at_load:+.1%})"
    if off and not off_at_load:
        record = Path(output_dir) / "expert_load.json"
        again = f"; strategy.expert_load={record} plans the next run at it" if record.is_file() else ""
        return line + f": the routing moved from the one the set-up planned at{again}"
    if off_at_load:
        emulation = summary.get("emulation")
        priced = {d: (summary.get("devices") or []).count(d) for d in summary.get("devices") or [] if d != "cpu"}
        if emulation is None and summary.get("ran_on") == "cpu" and priced:
            kinds = ", ".join(f"{n} {d}" for d, n in priced.items())
            why = (f"the ranks ran on the CPU and the prediction is for the cluster's devices ({kinds}): "
                   f"cluster.emulate=true plays their clock on CPU processes (the emu_* clusters do)")
        elif emulation is None:
            why = ("the clock prices these devices off: a measured profile (recipes/profile_devices.py, then "
                   "strategy.profile=<its JSON>) prices them as they run")
        elif not emulation.get("faithful", True):
            why = "the emulated clock was not faithful (summary.json's emulation.warning)"
        else:
            why = "the simulator misses this run at its steps' own routing"
        return line + f": {why}"
    return line + ": on the prediction"


def run_identity(strategy: HeterMoEStrategy, run: RunConfig) -> dict[str, Any]:
    """What ran, on what, for summary.json."""
    return {"strategy": f"hetermoe:{strategy.schedule}", "mode": strategy.mode, "cluster": run.cluster.name,
            "devices": run.cluster.devices,
            "ran_on": strategy.root_device.type,  # what the ranks ran on (the devices above are what was priced)
            "model": run.model.name, "corpus": run.data.path or run.data.corpus, "init_on_meta": run.init_on_meta}


def ended_by(trainer: L.Trainer, err: BaseException) -> str:
    """How a job that raised ended (in its fit, or in the save and validation after it), for
    its summary's ``status``."""
    step = trainer.global_step
    if isinstance(err, SIGTERMException):  # a preemption, not a fault
        if trainer.state.fn == TrainerFn.VALIDATING:
            return f"stopped in the final validation, after step {step}: the job got SIGTERM"
        return f"stopped at step {step}: the job got SIGTERM"
    if isinstance(err, (KeyboardInterrupt, SystemExit)) and trainer.state.status == TrainerStatus.INTERRUPTED:
        return f"interrupted at step {step}"  # Lightning turns a Ctrl-C into SystemExit(1)
    from .strategy.launchers import failed_for_a_dead_rank

    dead = failed_for_a_dead_rank(err)  # (rank 0's own error is losing it)
    return f"failed at step {step}: {dead or f'{type(err).__name__}: {err}'}"


def _write_summary(output_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    path = Path(output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    return path


def _save_path(cfg: DictConfig, output_dir: str | os.PathLike) -> Path:
    """Where ``save_checkpoint`` saves: its path in the run directory, ``last.ckpt`` for true
    (and where it is unset: the name ``ckpt_path=last`` looks for)."""
    where = cfg.get("save_checkpoint")
    return Path(output_dir) / ("last.ckpt" if where in (None, True, False) else str(where))


def resolve_ckpt_name(run: RunConfig, cfg: DictConfig, output_dir: str | os.PathLike) -> RunConfig:
    """Lightning's checkpoint names as the main job takes them, before the strategy plans.
    ``ckpt_path=last`` is first this run directory's own save (what
    ``save_checkpoint`` wrote there, ``last.ckpt`` where it is unset): a job started again
    in the same ``hydra.run.dir`` (a requeued one) goes on from where it saved, planned at
    that checkpoint's routing like any path given. Where there is none, Lightning resolves
    the name as ever (a ModelCheckpoint's or OnExceptionCheckpoint's last, or nothing: a
    fresh start, which the job then says). ``hpc`` is refused where the run directory holds no
    HPC checkpoint, here rather than in a traceback from the fit's start."""
    if run.ckpt_path == "hpc" and not any(Path(output_dir).glob("hpc_ckpt_*.ckpt")):
        # (Lightning's SLURM requeue saves them in the run directory on its signal; none: its traceback)
        raise ConfigError(f"ckpt_path='hpc' is invalid here: no hpc_ckpt_*.ckpt in the run directory {output_dir} "
                          f"(Lightning saves them there when SLURM requeues the job); give a checkpoint's path, or "
                          f"ckpt_path=last")
    if run.ckpt_path != "last":
        return run
    path = _save_path(cfg, output_dir)
    return dataclasses.replace(run, ckpt_path=str(path)) if path.exists() else run


def resumed_from(asked: str | None, loaded: Any, own: Path) -> dict[str, Any]:
    """summary.json's record of the resume: the checkpoint the fit really loaded (Lightning's
    names resolved; ``None`` where one named nothing and the fit started afresh, which rank 0
    also says: Lightning leaves ``last`` finding nothing at a warning, by design, so that a
    script can name it from its first run on). ``own``: the main job's save it looked for."""
    if asked is None:
        return {}
    if loaded:
        return {"resumed_from": str(loaded)}
    where = f"no {own} (save_checkpoint's), and no " if asked == "last" else "no "
    print(f"[hetermoe] ckpt_path={asked!r} named no checkpoint ({where}checkpoint callback's): trained from the "
          f"start", flush=True)
    return {"resumed_from": None, "resume": f"ckpt_path={asked!r} named no checkpoint: trained from the start"}


def train(cfg: DictConfig, output_dir: str | os.PathLike, start_method: str = "popen",
          run: RunConfig | None = None) -> dict[str, Any] | None:
    """Check every config group (``run``: already checked, :func:`read_run_config`), train,
    validate, and (rank 0) write ``summary.json``.

    Returns the summary on global rank 0 and ``None`` on other ranks."""
    mute_dependency_noise()
    if run is None:
        run = read_run_config(cfg)
    model_cfg, data_cfg, optim_cfg, cluster = run.model, run.data, run.optim, run.cluster
    from .kernels import why_not

    accelerator = run.trainer.get("accelerator")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available() and not (
            accelerator == "gpu" and torch.backends.mps.is_available()):
        raise ConfigError(f"trainer.accelerator={accelerator!r} is invalid here: torch sees no GPU "
                          f"(torch.cuda.is_available() is False, torch {torch.__version__}); use "
                          f"trainer.accelerator=cpu (or auto: the GPUs where there are some)")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and accelerator != "cpu":
        check_host_memory(model_cfg, optim_cfg, run.trainer)  # (accelerator=cpu: checked with the config)
    device = torch.device("cpu" if on_cpu else "cuda")
    problem = why_not(model_cfg.moe.expert_backend, device)
    if problem:
        raise ConfigError(problem)
    asked = run.ckpt_path
    run = resolve_ckpt_name(run, cfg, output_dir)  # (Lightning's log names the checkpoint it restores)
    # save_checkpoint's file (true: last.ckpt), saved after the fit and where a SIGTERM stops it
    own_save = _save_path(cfg, output_dir)
    saving = cfg.get("save_checkpoint") not in (None, False)
    strategy = HeterMoEStrategy(cluster=cluster, start_method=start_method, **resumed_routing(run))
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    summary_cb = RunSummary(warmup_steps=int(cfg.get("timing_warmup_steps", 1)))
    callbacks = [summary_cb, *build_callbacks(cfg)]
    preempted = SaveOnPreemption(str(own_save)) if saving else None  # what a requeued run goes on from
    if preempted is not None:
        callbacks.append(preempted)
    trainer_kwargs = dict(run.trainer)
    if trainer_kwargs.get("enable_checkpointing") is None:
        # a checkpoint callback asked for on the command line is taken; none: no default one
        trainer_kwargs["enable_checkpointing"] = any(isinstance(cb, Checkpoint) for cb in callbacks)
    if trainer_kwargs.get("enable_progress_bar") is None:
        # A bar on a terminal; a line every few steps in a log file, where a bar floods.
        trainer_kwargs["enable_progress_bar"] = sys.stderr.isatty()
        if not trainer_kwargs["enable_progress_bar"]:
            callbacks.append(ProgressLog(every_n_steps=int(trainer_kwargs.get("log_every_n_steps") or 10)))
    loggers = build_loggers(cfg, output_dir)
    try:
        trainer = L.Trainer(strategy=strategy, callbacks=callbacks, logger=loggers or False,
                            default_root_dir=str(output_dir), **trainer_kwargs)
    except ConfigError:
        raise
    except (MisconfigurationException, ValueError) as err:
        # what Lightning's constructor raises for arguments it cannot take (an unknown precision
        # is a ValueError there): the trainer group's to fix, before any process starts
        raise ConfigError(f"trainer: {err}") from None
    on_meta = run.init_on_meta
    with trainer.init_module(empty_init=True) if on_meta else nullcontext():
        model = build_model(model_cfg, optim_cfg)
    data = build_datamodule(data_cfg)
    started = time.perf_counter()
    ckpt_path = run.ckpt_path
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        loaded = trainer.ckpt_path  # Lightning's name resolved (the final validation sets its own)
        saved = str(own_save) if saving else None
        if saved is not None:
            trainer.save_checkpoint(saved)
        emulation = strategy.emulation_report()  # a collective: before the ranks part ways
        if cfg.get("final_validation", True):
            trainer.validate(model, datamodule=data, verbose=False)
    except BaseException as err:
        if trainer.is_global_zero:
            # what the steps so far measured stays (the sweep's row says how the job ended)
            kept = {"checkpoint": preempted.saved} if preempted is not None and preempted.saved else {}
            _write_summary(output_dir, {**summary_cb.summary(trainer), **run_identity(strategy, run),
                                        "wall_s": time.perf_counter() - started, "status": ended_by(trainer, err),
                                        **kept})
            if isinstance(err, SIGTERMException) and err.code is None:
                # Lightning's carries no code: the job would exit 0, and a scheduler or torchrun
                # that reads it would take a preempted run for a finished one. Rank 0's says it
                # was ended by the signal, as a process the signal ends does (the other ranks
                # exit 0: rank 0's launcher would take their code for a failure)
                err.code = PREEMPTED_EXIT
        raise
    memory = strategy.memory_report()  # a collective too
    if not trainer.is_global_zero:
        strategy.shutdown()
        return None
    summary = summary_cb.summary(trainer)
    summary.update({**run_identity(strategy, run), "wall_s": time.perf_counter() - started})
    if strategy.expert_parallel_size is not None:
        summary["expert_parallel_size"] = strategy.expert_parallel_size
    if saved is not None:
        summary["checkpoint"] = saved
    summary.update(resumed_from(asked, loaded, own_save))
    if memory is not None:
        summary["memory"] = {"ranks": memory, "peak_gb_max": max(r["peak_gb"] for r in memory)}
    monitor = next((c for c in trainer.callbacks if isinstance(c, ExpertLoadMonitor)), None)
    summary["timing_warmup_steps"] = summary_cb.warmup_steps
    summary.update(timing_summary(summary, strategy, cluster, emulation, monitor))
    if monitor is not None and monitor.history:
        # each layer's two busiest experts: their share of the layer's tokens (a top-k choice each)
        k = model_cfg.moe.top_k
        top2 = [sorted(row, reverse=True)[:2] for row in (monitor.mean_share() or [])]
        summary["expert_token_share_top2_min"] = min(min(r) * k for r in top2) if top2 else None
    rebalancer = next((c for c in trainer.callbacks if isinstance(c, ExpertRebalancer)), None)
    if rebalancer is not None:
        summary["rebalance"] = rebalancer.decisions
    path = _write_summary(output_dir, summary)
    log.info(f"summary: {json.dumps(summary)}")
    shown = ", ".join(f"{k}={summary[k]:.4g}" for k in ("first_loss", "final_loss", "val_loss", "tokens_per_s")
                      if isinstance(summary.get(k), (int, float)))
    if summary.get("tokens_per_s") is None:
        shown += f"; no step timed past the warm-up (timing_warmup_steps={summary_cb.warmup_steps})"
    print(f"[hetermoe] wrote {path}: {shown}", flush=True)
    verdict = prediction_verdict(summary, output_dir)
    if verdict:
        print(verdict, flush=True)
    strategy.shutdown()
    return summary
