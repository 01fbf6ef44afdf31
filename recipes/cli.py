"""Train with Lightning's own command line (LightningCLI), beside the Hydra recipes:

    python recipes/cli.py fit --trainer.strategy=hetermoe --trainer.accelerator=cpu \
        --trainer.devices=2 --trainer.max_steps=20 --model.model.d_model=64
    python recipes/cli.py fit --print_config          # every option, as YAML (--config takes it back)

The model and data are the main job's (``MoELanguageModel``, ``ByteCorpusDataModule``),
their fields those of ``ModelConfig``, ``OptimConfig`` and ``DataConfig``; the strategy's
arguments go after ``--trainer.strategy=lightning_hetermoe.HeterMoEStrategy`` as
``--trainer.strategy.mode=zebra`` and so on (the string ``hetermoe`` takes the defaults).
"""

from lightning.pytorch.cli import LightningCLI

# importing the package registers strategy="hetermoe"
from lightning_hetermoe import ByteCorpusDataModule, MoELanguageModel
from lightning_hetermoe.process_exit import run_and_exit


def main(args=None) -> LightningCLI:
    cli = LightningCLI(MoELanguageModel, ByteCorpusDataModule, args=args, save_config_kwargs={"overwrite": True})
    # Every rank leaves the heartbeat and the process group together before the process
    # ends, as the Hydra recipes do (without it, the strategy's exit hook does it alone).
    shutdown = getattr(cli.trainer.strategy, "shutdown", None)
    if shutdown is not None:
        shutdown()
    return cli


if __name__ == "__main__":
    run_and_exit(main)  # the run is over (or failed) and its logs closed: no finalization to wait for
