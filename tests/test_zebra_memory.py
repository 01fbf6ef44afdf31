"""What the zebra executor holds between tasks in a forward-only step (validation) is
bounded by the tasks in flight (R micro-batches of one layer), not by the model's depth:
each (layer, micro-batch) record and each round's buffers are dropped once consumed."""

from __future__ import annotations

from harness import run_ranks
from lightning_hetermoe import HeterMoEStrategy
from reference import data, make_model, trainer
from helpers_zebra import GLOBAL, WINDOWS, make_test_plan
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes


def held_after_each_task(rank: int, world: int, depths: list[int]) -> dict[int, list[int]]:
    out = {}
    for layers in depths:
        model = make_model(4, n_layers=layers, seed=rank)
        strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2, layers=layers))
        t = trainer(strategy, world, max_steps=1, limit_val_batches=1)
        dm = data(world, GLOBAL[world], windows=WINDOWS[world])
        t.fit(model, datamodule=dm)
        strategy.backend.account_memory = True
        t.validate(model, datamodule=dm, verbose=False)
        out[layers] = strategy.backend.last_eval.held_bytes
    return out


R = 2


def test_forward_only_memory_does_not_grow_with_depth():
    per_rank = run_ranks(2, held_after_each_task, 2, [2, 6])
    # one micro-batch's rows of one layer: sequences x tokens x top-k x d_model x fp32
    rows = GLOBAL[2] // R * 16 * 2 * 16 * 4
    for rank, held in enumerate(per_rank):
        assert len(held[6]) > len(held[2]) > 0, "every task was accounted"
        for layers in (2, 6):
            # what the tasks in flight need: R micro-batches' rows out and answers back, and
            # one round more on an expert rank (its next receive, its last answer)
            assert max(held[layers]) <= 2 * (R + 1) * rows, (rank, layers, max(held[layers]), rows)
        # kept records would add (layers - 1) x R rounds: 10 rounds more at depth 6
        assert max(held[6]) <= max(held[2]) + 2 * rows, (rank, max(held[2]), max(held[6]))
        assert held[6][-1] == 0, f"rank {rank} still holds {held[6][-1]} bytes at the end of the step"
    assert max(per_rank[0][2]) >= R * rows, "the attention rank held its rows in flight: the accounting saw them"
