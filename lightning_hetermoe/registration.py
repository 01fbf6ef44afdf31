"""``Trainer(strategy="hetermoe")``: the strategy's names in Lightning's registry, without
importing Lightning to put them there.

Lightning has no entry point for strategies: a package registers its names when it is
imported. Importing Lightning takes seconds (torch, dynamo, torchmetrics), which a script
that only plans (cluster -> profile -> plan -> simulate: no torch at all) should not pay.
So the names go in as soon as Lightning is there: at once if it already is, else the moment
its top-level package has finished importing (a one-shot finder on ``sys.meta_path`` runs
the registration after ``lightning/__init__.py``, when every part of Lightning is loaded).
The registry holds a factory that imports the strategy class when a Trainer asks for it:
registering never imports this package's strategy, so it cannot meet that import half done
(as it would where the strategy's own ``import lightning`` is what loads Lightning).
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from typing import Any

STRATEGY_NAMES = {
    "hetermoe": ("popen", "HeterMoE strategy; child processes re-run the script (Hydra-multirun safe)"),
    "hetermoe_spawn": ("spawn", "HeterMoE strategy launched with multiprocessing spawn (notebooks, tests)"),
}


def _strategy(**init_params: Any) -> Any:
    from .strategy import HeterMoEStrategy

    return HeterMoEStrategy(**init_params)


def register_strategies() -> None:
    """Put the names in Lightning's registry (imports Lightning; a name already there stays)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (start_method, description) in STRATEGY_NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _strategy, description=description, start_method=start_method)


class _OnceLightningLoads(MetaPathFinder):
    """Finds nothing itself: hands back the spec the other finders give ``lightning`` with
    the registration run after its module executes. It leaves ``sys.meta_path`` only then: a
    probe (``importlib.util.find_spec("lightning")``, as libraries ask whether a package is
    installed) asks finders too, and throws the spec away without loading it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "lightning":
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            execute = spec.loader.exec_module

            def execute_then_register(module: Any) -> None:
                execute(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                register_strategies()

            spec.loader.exec_module = execute_then_register
        return spec


def register_with_lightning() -> None:
    """Register now if Lightning is loaded, else once it is (see the module docstring)."""
    if "lightning" in sys.modules:
        register_strategies()
    elif not any(isinstance(f, _OnceLightningLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnceLightningLoads())
