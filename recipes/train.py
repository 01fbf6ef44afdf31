"""Train the MoE LM with the hetermoe strategy.

    python recipes/train.py                                  # tiny model, 2 CPU processes
    python recipes/train.py trainer.max_steps=20 hydra.run.dir=/tmp/run
    python recipes/train.py -m cluster=cpu1,cpu2              # sweep over clusters

Writes ``summary.json`` into the Hydra run directory.
"""

import json
import os
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.process_exit import exit_saying, run_and_exit
from lightning_hetermoe.run_config import RunConfig, read_run_config
from lightning_hetermoe.strategy import early_ranks


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    out = HydraConfig.get().runtime.output_dir
    try:
        # every group checked before Lightning and torch load: a wrong field answers at once
        run = read_run_config(cfg)
    except ConfigError as err:
        return refused(cfg, out, f"config error: {err}")
    try:
        # the other local ranks start now, each to wait for this one's launch to join
        # (lightning_hetermoe/strategy/early_ranks.py): forked once torch, Lightning and the
        # pack are loaded, to run the job below as this process does
        early_ranks.start(run.trainer, job=lambda: train_job(cfg, out, run), load=["lightning_hetermoe.training"])
        train_job(cfg, out, run)
    finally:
        early_ranks.release()  # any nobody launched (this job failed before its launch)


def train_job(cfg: DictConfig, out: str, run: RunConfig) -> None:
    """The job past its config check: every local rank runs it (rank 0, and each child
    forked from it)."""
    try:
        from lightning_hetermoe.training import train

        train(cfg, out, run=run)
    except ConfigError as err:
        early_ranks.leave_quietly_unless_launched()  # (a rank started early: rank 0 says it)
        if early_ranks.runs_a_sweep():  # found by the strategy or Lightning, not the config check: a row all the same
            from lightning_hetermoe.comm import first_to_say

            error = f"config error: {err}"
            return refused(cfg, out, error, say=first_to_say(f"[hetermoe] {error}"))  # (its ranks say it too)
        # A bad value is the user's to fix: one line naming the field, no stack trace; said by
        # the first rank to meet it (every rank meets one found inside the fit)
        raise exit_saying(f"[hetermoe] config error: {err}") from None
    except BaseException as err:
        early_ranks.leave_quietly_unless_launched()
        from lightning_hetermoe.strategy.launchers import failed_for_a_dead_rank

        dead = failed_for_a_dead_rank(err)  # named already, its own error printed by it
        if isinstance(err, Exception) and early_ranks.runs_a_sweep():
            # A failed job is a row saying why (rank 0 wrote its summary.json's status), and
            # the sweep goes on to the next job (its table written), exiting 1 at its end
            if dead is None:
                traceback.print_exc()
            print(f"[hetermoe] job {out} failed: {dead or f'{type(err).__name__}: {err}'}; the sweep goes on",
                  file=sys.stderr, flush=True)
            _failed_jobs.append(out)
            return
        if dead is None:
            raise
        raise SystemExit(1) from None


_failed_jobs: list[str] = []  # this sweep's jobs that failed mid-run


def refused(cfg: DictConfig, out: str, error: str, say: bool = True) -> None:
    """A job whose config is refused: alone, it exits 1 on one line; in a sweep, that line
    is printed (where ``say``: no other rank of the job said it), the job's summary.json
    says it (its row in the sweep's table) and the sweep goes on to the next job."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        raise SystemExit(f"[hetermoe] {error}")
    if say:
        print(f"[hetermoe] {error}", file=sys.stderr, flush=True)
    cluster = cfg.get("cluster") or {}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"error": error, "cluster": cluster.get("name"), "devices": list(cluster.get("devices") or [])}, f,
                  indent=2)


if __name__ == "__main__":
    # every job's summary is written, or a job failed: either way no finalization to wait for
    run_and_exit(lambda: main() or (1 if _failed_jobs else 0))
