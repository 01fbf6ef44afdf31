"""The main job's ``train`` on real gloo ranks that the harness starts (as torchrun starts
them), for tests whose subject is what the job does on a cluster, not its command line.
Each rank is a fork of a server that imported torch, Lightning and the pack once; the
command itself, as a user types it, is run by tests/test_recipes_train.py."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def compose(*overrides: str, config_name: str = "config"):
    """A recipe's config (``config``: the main job's) with ``overrides``, as the recipe
    would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def _train_rank(rank: int, overrides: tuple[str, ...], output_dir: str) -> tuple[dict, str] | None:
    from lightning_hetermoe.training import train

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train(compose(*overrides), output_dir)
    return (summary, printed.getvalue()) if rank == 0 else None


def train_in_ranks(world: int, output_dir: Path, *overrides: str, timeout: float = 240.0) -> tuple[dict, str]:
    """``train`` on ``world`` ranks writing into ``output_dir``: rank 0's summary and what
    it printed."""
    return run_ranks(world, _train_rank, tuple(overrides), str(output_dir), timeout=timeout)[0]
