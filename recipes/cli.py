"""Train with Lightning's own command line (LightningCLI), beside the Hydra recipes:

    python recipes/cli.py fit --trainer.strategy=hetermoe --trainer.accelerator=cpu \
        --trainer.devices=2 --trainer.max_steps=20 --model.model.d_model=64
    python recipes/cli.py fit --print_config          # every option, as YAML (--config takes it back)

The model and data are the main job's (``MoELanguageModel``, ``ByteCorpusDataModule``),
their fields those of ``ModelConfig``, ``OptimConfig`` and ``DataConfig``; the strategy's
arguments go after ``--trainer.strategy=hetermoe`` as ``--trainer.strategy.mode=zebra`` and
so on (jsonargparse takes arguments only after a class path: with any, the registered name
is given to it as ``lightning_hetermoe.HeterMoEStrategy``).
"""

import sys

from lightning.pytorch.cli import LightningCLI

# importing the package registers strategy="hetermoe"
from lightning_hetermoe import ByteCorpusDataModule, MoELanguageModel
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.process_exit import exit_saying, run_and_exit


STRATEGY_CLASS = "lightning_hetermoe.HeterMoEStrategy"


def with_strategy_class(args: list[str]) -> list[str]:
    """``args`` with ``--trainer.strategy=hetermoe`` (or ``... hetermoe``) as the class path
    where strategy arguments follow (``--trainer.strategy.mode=zebra``): jsonargparse reads
    those only after a class path, and refused the registered name with a wall of usage."""
    if not any(a.startswith("--trainer.strategy.") for a in args):
        return args
    out = list(args)
    for i, a in enumerate(out):
        if a == "--trainer.strategy=hetermoe":
            out[i] = f"--trainer.strategy={STRATEGY_CLASS}"
        elif a == "hetermoe" and i > 0 and out[i - 1] == "--trainer.strategy":
            out[i] = STRATEGY_CLASS
    return out


def strategy_refusal(args: list[str]) -> ConfigError | None:
    """The pack's refusal of the strategy arguments in ``args`` (``--trainer.strategy.mode=zebar``,
    a misspelt name), found by building the strategy from them before LightningCLI parses:
    jsonargparse reports it inside a wall of usage and every Union subtype it tried. ``None``
    where they are fine, or nested (``--trainer.strategy.cluster.devices=...``: jsonargparse's)."""
    import yaml

    named = [b for a, b in zip(args, args[1:] + [""]) if a == "--trainer.strategy"] + \
        [a.partition("=")[2] for a in args if a.startswith("--trainer.strategy=")]
    if STRATEGY_CLASS not in named:  # another strategy's arguments are its own
        return None
    kwargs = {}
    for i, a in enumerate(args):
        if not a.startswith("--trainer.strategy."):
            continue
        key, eq, value = a.removeprefix("--trainer.strategy.").partition("=")
        if not eq:  # --trainer.strategy.mode zebra
            value = args[i + 1] if i + 1 < len(args) else ""
        if "." in key:
            return None
        kwargs[key] = yaml.safe_load(value)  # as jsonargparse reads a value: 2, null, true, [a, b]
    if not kwargs:
        return None
    from lightning_hetermoe import HeterMoEStrategy

    try:
        HeterMoEStrategy(**kwargs)
    except ConfigError as err:
        return err
    return None


def main(args=None) -> LightningCLI:
    args = with_strategy_class(list(sys.argv[1:] if args is None else args))
    refusal = strategy_refusal(args)
    if refusal is not None:
        raise SystemExit(f"[hetermoe] config error: {refusal}")
    try:
        cli = LightningCLI(MoELanguageModel, ByteCorpusDataModule, args=args, save_config_kwargs={"overwrite": True})
    except ValueError as err:
        # jsonargparse wraps a config's refusal in its own ("Does not validate against any of the
        # Union subtypes") under a traceback of its internals: the pack's sentence alone, as the
        # Hydra recipes print it
        refusal = config_error_in(err)
        if refusal is None:
            raise
        raise exit_saying(f"[hetermoe] config error: {refusal}") from None
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
