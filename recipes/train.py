"""Train the MoE LM with the hetermoe strategy.

    python recipes/train.py                                  # tiny model, 2 CPU processes
    python recipes/train.py trainer.max_steps=20 hydra.run.dir=/tmp/run
    python recipes/train.py -m cluster=cpu1,cpu2              # sweep over clusters

Writes ``summary.json`` into the Hydra run directory.
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.process_exit import run_and_exit
from lightning_hetermoe.run_config import read_run_config


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        # every group checked before Lightning and torch load: a wrong field answers at once
        run = read_run_config(cfg)
        from lightning_hetermoe.training import train

        train(cfg, HydraConfig.get().runtime.output_dir, run=run)
    except ConfigError as err:
        # A bad value is the user's to fix: one line naming the field, no stack trace.
        raise SystemExit(f"[hetermoe] config error: {err}") from None


if __name__ == "__main__":
    # every job's summary is written, or a job failed: either way no finalization to wait for
    run_and_exit(main)
