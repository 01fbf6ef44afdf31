"""Activation checkpointing (each decoder block recomputed inside its backward) under every
mode trains exactly like the same model without it: under zebra and distep the recompute
runs outside any micro-batch fiber, on autograd's thread, and must replay the block's
forward (the same experts' answer, the same global routing counts) without communicating."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from harness import run_ranks
from lightning_hetermoe import comm
from lightning_hetermoe import HeterMoEStrategy, OptimConfig
from reference import assert_same_params, data, make_model, reference_fit, trainer
from helpers_zebra import GLOBAL, STEPS, WINDOWS, make_test_plan, pieces
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes


class Recomputes:
    """Counts block forwards (with checkpointing each block runs again in its backward) and
    the experts' training forwards (so does every expert round, whichever rank runs it)."""

    def __init__(self, model) -> None:
        self.calls = self.expert_calls = self.trained = self.recomputed = 0
        for block in model.model.blocks:
            block.register_forward_pre_hook(self.count)
            block.moe.experts.register_forward_pre_hook(self.count_experts)

    def count(self, module, args) -> None:
        self.calls += 1
        if torch._C._current_graph_task_id() != -1:  # run again inside a backward
            self.recomputed += 1
        elif module.training and torch.is_grad_enabled():
            self.trained += 1

    def count_experts(self, module, args) -> None:
        if module.training and torch.is_grad_enabled() and args[0].shape[0]:
            self.expert_calls += 1


def fit_checkpointed(rank: int, world: int, cases: list[dict]) -> list:
    out = []
    for case in cases:
        model = make_model(4, seed=rank, optim=OptimConfig(), activation_checkpointing=case.get("checkpointing", True))
        calls = Recomputes(model)
        strategy = HeterMoEStrategy(mode=case["mode"], plan=case.get("plan"))
        t = trainer(strategy, world, max_steps=STEPS)
        with comm.record() as issued:
            t.fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        out.append({"state": {k: v.clone() for k, v in model.state_dict().items()}, "forwards": calls.calls,
                    "expert_forwards": calls.expert_calls, "trained": calls.trained,
                    "recomputed": calls.recomputed,
                    "collectives": Counter(c.what for c in issued if c.what in ("ep.rows", "ep.balance"))})
    return out


def test_checkpointed_blocks_train_like_stored_activations_in_every_mode():
    plan = make_test_plan(2, [0], R=2)
    cases = [dict(mode="ep"), dict(mode="zebra", plan=plan), dict(mode="distep", plan=plan)]
    stored = [dict(case, checkpointing=False) for case in cases]
    results = run_ranks(2, fit_checkpointed, 2, cases + stored)
    for i, case in enumerate(cases):
        # the experts' hidden activations are not kept either: every expert round (zebra's and
        # distep's run outside the blocks) runs its experts again in its backward, on every rank
        ckpt = [rank[i]["expert_forwards"] for rank in results]
        plain = [rank[len(cases) + i]["expert_forwards"] for rank in results]
        assert sum(plain) > 0 and ckpt == [2 * n for n in plain], (case["mode"], ckpt, plain)
        # and every block's forward once more, not twice: under zebra and distep the gradient
        # of the experts' answer is taken without recomputing the block (its backward does)
        ckpt = [(rank[i]["trained"], rank[i]["recomputed"]) for rank in results]
        plain = [(rank[len(cases) + i]["trained"], rank[len(cases) + i]["recomputed"]) for rank in results]
        assert ckpt[0][0] > 0 and all(t == r for t, r in ckpt), (case["mode"], ckpt)
        assert [t for t, _ in ckpt] == [t for t, _ in plain] and all(r == 0 for _, r in plain), (case["mode"], plain)
        # under ep the recompute runs the block's dispatch and combine again (the simulator
        # prices them), but not the balance loss's all-reduce: the forward's sum is reused
        ckpt, plain = results[0][i]["collectives"], results[0][len(cases) + i]["collectives"]
        if case["mode"] == "ep":
            assert plain["ep.rows"] > 0 and 2 * ckpt["ep.rows"] == 3 * plain["ep.rows"], (ckpt, plain)
            assert plain["ep.balance"] > 0 and ckpt["ep.balance"] == plain["ep.balance"], (ckpt, plain)
    results = [rank[:len(cases)] for rank in results]
    for case, got in zip(cases, results[0], strict=True):
        model = make_model(4, seed=0, optim=OptimConfig())  # the same model, activations stored
        initial = copy.deepcopy(model.state_dict())
        cut = pieces(plan, case["mode"]) if case["mode"] != "ep" else None
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[2], windows=WINDOWS[2], pieces=cut)
        assert_same_params(got["state"], expected, initial)
        # rank 0 ran every block of every micro-batch at least twice per step: the recompute happened
        per_step = 2 * (len(cut) if cut else 1)
        assert got["forwards"] >= 2 * per_step * STEPS, (case["mode"], got["forwards"])
