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
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.process_exit import run_and_exit


def main(args=None) -> LightningCLI:
    try:
        cli = LightningCLI(MoELanguageModel, ByteCorpusDataModule, args=args, save_config_kwargs={"overwrite": True})
    except ValueError as err:
        # jsonargparse wraps a config's refusal in its own ("Does not validate against any of the
        # Union subtypes") under a traceback of its internals: the pack's sentence alone, as the
        # Hydra recipes print it
        refusal = config_error_in(err)
        if refusal is None:
            raise
        raise SystemExit(f"[hetermoe] config error: {refusal}") from None
    # Every rank leaves the heartbeat and the process group together before the process
    # ends, as the Hydra recipes do (without it, the strategy's exit hook does it alone).
    shutdown = getattr(cli.trainer.strategy, "shutdown", None)
    if shutdown is not None:
        shutdown()
    return cli


def config_error_in(err: BaseException) -> ConfigError | None:
    """The pack's ConfigError among ``err`` and the exceptions it was raised from (``None``: none)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, ConfigError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    run_and_exit(main)  # the run is over (or failed) and its logs closed: no finalization to wait for
