"""Register the strategy names with Lightning (Lightning has no entry point for them)."""

from lightning.pytorch.strategies import StrategyRegistry

from .hetermoe import HeterMoEStrategy

STRATEGY_NAMES = {
    "hetermoe": ("popen", "HeterMoE strategy; child processes re-run the script (Hydra-multirun safe)"),
    "hetermoe_spawn": ("spawn", "HeterMoE strategy launched with multiprocessing spawn (notebooks, tests)"),
}


def register_strategies() -> None:
    for name, (start_method, description) in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:  # re-import must not raise
            StrategyRegistry.register(name, HeterMoEStrategy, description=description, start_method=start_method)
