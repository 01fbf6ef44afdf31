"""``import lightning_hetermoe`` registers the strategy names whichever of it and Lightning is
imported first, and planning loads neither Lightning nor torch (``registration.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lightning_hetermoe
from lightning_hetermoe.registration import STRATEGY_NAMES

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_the_names_build_the_strategy_with_their_start_method():
    # this process imported Lightning long before: the names went in at the package's import
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (start_method, _) in STRATEGY_NAMES.items():
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is lightning_hetermoe.HeterMoEStrategy and strategy._start_method == start_method
    assert set(lightning_hetermoe.__all__) <= set(dir(lightning_hetermoe))


@pytest.mark.slow
def test_planning_and_preparing_data_load_neither_lightning_nor_torch():
    """The plan, paper and prepare-data recipes' imports, the package's planning names, and
    the corpus on disk's reader (the config check of ``data.path`` runs it before the run
    loads torch), read. (Preparing data loaded both, 5 CPU-s, through the model package.)"""
    code = ("import runpy, sys\n"
            "for recipe in ('recipes/plan.py', 'recipes/paper.py', 'recipes/prepare_data.py'):\n"
            "    runpy.run_path(recipe, run_name='imported')\n"
            "import lightning_hetermoe as lh\n"
            "from lightning_hetermoe.corpus.format import read_meta\n"
            "names = [lh.ClusterConfig, lh.CostModel, lh.Plan, lh.make_plan, lh.simulate_plan, lh.RoutingRecord]\n"
            "print(sorted(m for m in ('lightning', 'torch') if m in sys.modules))\n")
    proc = _python(code)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "[]", out


@pytest.mark.slow
def test_the_names_register_when_lightning_loads_after_the_package():
    """The package first and Lightning after (through a subpackage: ``lightning`` loads
    first all the same; asked for by ``find_spec`` before that), and the strategy class read
    first, whose own import loads Lightning: a Trainer builds the strategy by name either
    way, and the finder is gone."""
    check = ("from lightning.pytorch import Trainer\n"
             "trainer = Trainer(strategy='{name}', logger=False, enable_progress_bar=False)\n"
             "finders = [type(f).__name__ for f in sys.meta_path]\n"
             "print(type(trainer.strategy).__name__, trainer.strategy._start_method, '_OnceLightningLoads' in finders)\n")
    # a library asking whether Lightning is installed, before it loads, is answered and forgotten
    package_first = _python("import importlib.util, sys, lightning_hetermoe\n"
                            "assert importlib.util.find_spec('lightning') and 'lightning' not in sys.modules\n"
                            + check.format(name="hetermoe"))
    class_first = _python("import sys\nfrom lightning_hetermoe import HeterMoEStrategy\n"
                          + check.format(name="hetermoe_spawn"))
    for proc, expected in ((package_first, "HeterMoEStrategy popen False"),
                           (class_first, "HeterMoEStrategy spawn False")):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == expected, out
