"""Zebra and DistEP on real gloo processes equal single-process training on the global batch,
at the default loss coefficients, after 5 AdamW steps, for every mix of roles the executor
must handle (plans written by hand so each case is exactly the one named)."""

from __future__ import annotations

import time
from dataclasses import replace

import lightning as L
import pytest
import torch

from harness import run_ranks
import lightning_hetermoe.strategy.backends.zebra.backend as zebra_backend
from helpers_zebra import GLOBAL, STEPS, WINDOWS, check, make_test_plan
from lightning_hetermoe import HeterMoEStrategy, OptimConfig, Plan
from lightning_hetermoe.model_contract import find_blocks
from reference import SEQ, data, make_model, trainer


def test_dense_buckets_cover_the_dense_part_by_layer_last_first_within_the_cap():
    model = make_model(4, n_layers=3)
    blocks = [b for _, b, _ in find_blocks(model)]
    experts = {id(p) for _, _, moe in find_blocks(model) for p in moe.experts.parameters(recurse=False)}
    dense = [p for p in model.parameters() if id(p) not in experts]
    cap = 2048
    buckets = zebra_backend.dense_buckets(model, blocks, experts, cap)
    flat = [p for b in buckets for p in b]
    assert sorted(map(id, flat)) == sorted(map(id, dense)) and len(flat) == len(dense)
    for b in buckets:
        assert len(b) == 1 or sum(p.numel() * p.element_size() for p in b) <= cap, [p.shape for p in b]
    layer_of = {id(p): l for l, blk in enumerate(blocks) for p in blk.parameters()}
    order = [layer_of.get(id(b[0]), -1) for b in buckets]
    for b in buckets:  # a bucket never spans layers
        assert len({layer_of.get(id(p), -1) for p in b}) == 1
    assert order == sorted(order, key=lambda l: (l == -1, -l)), order  # L-1 .. 0, then the rest
    # the layout comes from the parameter order alone: a differently seeded copy agrees
    other = make_model(4, n_layers=3, seed=5)
    names = {id(p): n for n, p in model.named_parameters()}
    other_names = {id(p): n for n, p in other.named_parameters()}
    other_blocks = [b for _, b, _ in find_blocks(other)]
    other_experts = {id(p) for _, _, moe in find_blocks(other) for p in moe.experts.parameters(recurse=False)}
    assert [[names[id(p)] for p in b] for b in buckets] == \
        [[other_names[id(p)] for p in b] for b in zebra_backend.dense_buckets(other, other_blocks, other_experts, cap)]


@pytest.mark.slow
def test_dense_sync_in_several_buckets_equals_one_process_and_holds_one_bucket_at_most():
    """2+1 with buckets far smaller than the dense part: training still equals one process,
    and the sync's buffers alive at once never exceed one bucket."""
    cap = 2048
    cases = [dict(plan=make_test_plan(3, [0, 1], R=2), bucket_bytes=cap),
             dict(plan=make_test_plan(3, [0, 1], R=2), bucket_bytes=cap,
                  trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05))]
    per_rank = check(3, cases)
    dense_bytes = per_rank[0][0]["dense_numel"] * 4
    for c in range(len(cases)):
        for r in (0, 1):
            sync = per_rank[r][c]["sync"]
            assert sync["calls"] >= 3 * STEPS // (c + 1), sync  # several buckets per optimizer step
            assert 0 < sync["peak"] <= cap < dense_bytes, (sync, dense_bytes)
        assert per_rank[2][c]["sync"]["calls"] == 0  # the expert rank holds no dense part


@pytest.mark.slow
@pytest.mark.standin
def test_one_attention_one_expert_rank_zebra_distep_and_ep_agree():
    check(2, [
        dict(plan=make_test_plan(2, [0], R=2), validate=True, trainer=dict(limit_val_batches=1.0)),
        dict(plan=make_test_plan(2, [0], R=3)),  # 8 sequences in 3 micro-batches: 3+3+2
        dict(plan=make_test_plan(2, [0], R=1)),
        dict(plan=make_test_plan(2, [0], R=2), mode="distep"),
        dict(mode="ep"),
        # a dense decoder layer before the MoE ones (DeepSeek's first), recomputed in its
        # backward: it runs on the attention rank in the piece before the first block's cut
        dict(plan=make_test_plan(2, [0], R=2), model=dict(dense_layers=1, activation_checkpointing=True)),
        dict(mode="ep", model=dict(dense_layers=1)),
    ])


@pytest.mark.slow
@pytest.mark.standin
def test_three_ranks_two_attention_and_asym_ea_experts_on_the_attention_rank():
    # 1+2 with Asym-EA: layer 0 puts expert 3 on the attention rank, layer 1 experts 2 and 3.
    asym = [[1, 1, 2, 0], [1, 2, 0, 0]]
    check(3, [
        # 2+1: val_loss reduced over 2 attention ranks
        dict(plan=make_test_plan(3, [0, 1], R=2), validate=True, trainer=dict(limit_val_batches=1.0)),
        # a plan of two waves: Lightning's gradient accumulation (two loader batches per
        # optimizer step) and global-norm clipping, through the zebra executor
        dict(plan=replace(make_test_plan(3, [0, 1], R=2), waves=2),
             trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
        dict(plan=make_test_plan(3, [0], R=2, placement=asym)),
        dict(plan=make_test_plan(3, [0], R=3, placement=asym), moe=dict(top_k=1), exercises=["idle_experts"]),
        # capacity drops: each expert takes ceil(1.0 * tokens * k / E) choices per micro-batch
        dict(plan=make_test_plan(3, [0, 1], R=2), moe=dict(capacity_factor=1.0), exercises=["dropped"]),
        # an expert rank holding no expert of a layer still takes part in that layer's rounds
        dict(plan=make_test_plan(3, [0], R=2, num_experts=3, placement=[[1, 1, 0], [0, 2, 2]]), num_experts=3),
    ])


@pytest.mark.slow
def test_two_plus_three_ranks_neither_count_divides_the_other():
    check(5, [dict(plan=make_test_plan(5, [0, 1], R=2, num_experts=6), num_experts=6)])


@pytest.mark.slow
def test_two_zp_groups_sum_expert_gradients_over_replicas():
    groups = [([0], [2]), ([1], [3])]
    check(4, [dict(plan=make_test_plan(4, [0, 1], R=2, groups=groups))])


def recorded_orders(rank: int, world: int, plan: Plan, swap: tuple[str, str]) -> list[dict]:
    """What each rank's work reported (block, expert and gradient hooks), and the loop's trace:
    once as the executor runs, once with two of rank 0's tasks in the wrong order (``swap``:
    a broken executor)."""
    from lightning_hetermoe.task_order import Schedule

    original = Schedule.member_tasks

    def swapped(self, has_attention, holds):
        tasks = original(self, has_attention, holds)
        names = [str(t) for t in tasks]
        if self.kind == "zebra" and has_attention and rank == 0:
            a, b = names.index(swap[0]), names.index(swap[1])
            tasks[a], tasks[b] = tasks[b], tasks[a]
        return tasks

    out = []
    for broken in (False, True):
        Schedule.member_tasks = swapped if broken else original
        model = make_model(4, seed=rank, optim=OptimConfig())
        strategy = HeterMoEStrategy(mode="zebra", plan=plan)
        trainer(strategy, world, max_steps=1).fit(model, datamodule=data(world, GLOBAL[world], windows=WINDOWS[world]))
        last = strategy.backend.last_step
        out.append({"work": [str(t) for t in last.work], "trace": [str(t) for t, _, _ in last.trace]})
    Schedule.member_tasks = original
    return out


@pytest.mark.slow
def test_each_rank_runs_theorem_one_order_and_the_simulator_runs_the_same_lists():
    from lightning_hetermoe.cluster import LinkConfig, get_device
    from lightning_hetermoe.task_order import Task, check_theorem1
    from lightning_hetermoe.simulate import plan_setup, simulate_step
    from lightning_hetermoe.profile import make_timer

    plan = make_test_plan(3, [0], R=3, placement=[[1, 1, 2, 0], [1, 2, 0, 0]])  # Asym-EA on rank 0
    both = run_ranks(3, recorded_orders, 3, plan, ("Ab0.0", "Ab0.1"))
    got = [b[0] for b in both]
    orders = [g["work"] for g in got]
    for g in got:  # every task of the list did its work, in the list's order
        assert g["work"] == g["trace"], g

    attention = orders[0]
    tasks = [Task(*_parse(t)) for t in attention]
    assert check_theorem1(tasks, 2, 3) == [], attention
    assert {"Xf0.0", "Xb1.2"} <= set(attention), "the attention rank must run its Asym-EA experts in its list"
    assert all(t[0] == "X" for t in orders[1] + orders[2]), "expert ranks run expert tasks only"

    model = make_model(4).model_cfg
    devs = [get_device("cpu")] * 3
    res = simulate_step(plan_setup(plan, devs, model, LinkConfig()), make_timer(model, SEQ))
    for rank in range(3):
        lane = next(t.resource for t in res.timeline.tasks if t.resource.endswith(f"[{rank}]"))
        on_lane = [t for t, s in sorted(((t, s) for t, s in zip(res.timeline.tasks, res.timeline.start, strict=True)
                                         if t.resource == lane), key=lambda x: (x[1], x[0].kind != "tail"))]
        # the step before's tail first (carried into this step), then the executor's list
        assert on_lane[0].kind == "tail", on_lane[0]
        simulated = [t.name for t in on_lane[1:]]
        assert simulated == orders[rank], f"rank {rank}: executor {orders[rank]} vs simulator {simulated}"

    # a broken executor (two backward tasks of the first layer swapped, which the exchange
    # tolerates) is caught by what its work reports
    broken = both[0][1]["work"]
    problems = check_theorem1([Task(*_parse(t)) for t in broken], 2, 3)
    assert problems == ["backward is not layer by layer downwards with micro-batches 1..R inside each layer"], broken


def _parse(name: str) -> tuple[str, int, int]:
    kinds = {"Af": "attn_fwd", "Ab": "attn_bwd", "Xf": "expert_fwd", "Xb": "expert_bwd"}
    if name.startswith("H."):
        return "head", 1, int(name[2:])
    layer, mb = name[2:].split(".")
    return kinds[name[:2]], int(layer), int(mb)


def test_a_plan_that_does_not_fit_is_rejected_with_one_error_per_mismatch():
    from lightning_hetermoe.configs import ConfigError
    from lightning_hetermoe.strategy.arguments import check_plan, check_waves

    cfg = make_model(4).model_cfg
    plan = make_test_plan(2, [0], R=2)
    with pytest.raises(ConfigError, match="the plan is for 2 ranks, the trainer runs 3"):
        check_plan(plan, cfg, 3)
    with pytest.raises(ConfigError, match="the plan is for 2 MoE layers, the model has 3"):
        check_plan(plan, make_model(4, n_layers=3).model_cfg, 2)
    with pytest.raises(ConfigError, match="the plan is for 4 experts per layer, the model has 6"):
        check_plan(plan, make_model(6).model_cfg, 2)
    with pytest.raises(ConfigError, match="the plan is for 2 ranks, the trainer runs 4"):
        L.Trainer(strategy=HeterMoEStrategy(mode="zebra", plan=plan), accelerator="cpu", devices=4, logger=False)
    waves = replace(plan, waves=2)
    for accumulate in (1, 3):
        with pytest.raises(ConfigError, match=rf"2 waves of 8 sequences: set trainer.accumulate_grad_batches=2 "
                                              rf"\(it is {accumulate}\)"):
            check_waves(waves, accumulate)
    check_waves(waves, 2)
    check_waves(plan, 3)  # one wave: accumulation is the user's own


def test_logged_numbers_are_replayed_on_the_modules_device():
    """A Python float logged with sync_dist inside a zebra step is reduced over the metrics
    group (NCCL on GPUs, which refuses CPU tensors): the replay puts it on the module's device."""
    from lightning_hetermoe.strategy.backends.zebra.logs import _reduce

    calls = [(0.5, (), {"sync_dist": True}, 0), (1.5, (), {"sync_dist": True}, 1)]
    item = _reduce("lr_scale", calls, [2, 6], None, torch.device("meta"))
    assert item.value.device.type == "meta" and item.numeric
    cpu = _reduce("lr_scale", calls, [2, 6], None, torch.device("cpu"))
    assert float(cpu.value) == (0.5 * 2 + 1.5 * 6) / 8  # micro-batches weighted by their rows


LATE_S = 0.4  # rank 1's attention forward, every micro-batch: far past rank 0's


def fit_with_a_late_attention(rank: int, world: int) -> list[tuple[str, float]]:
    from lightning_hetermoe.model.transformer import CausalSelfAttention

    model = make_model(4)
    if rank == 1:
        for m in model.modules():
            if isinstance(m, CausalSelfAttention):
                m.register_forward_pre_hook(lambda *_: time.sleep(LATE_S) if torch.is_grad_enabled() else None)
    strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0, 1], R=2,
                                                                  placement=[[0, 1, 0, 1], [0, 1, 0, 1]]))
    trainer(strategy, world, max_steps=2).fit(model, datamodule=data(world))
    tasks, _ = strategy.backend.last_step.stamps.read()
    return [(str(task), end - start) for task, start, end in tasks]


@pytest.mark.slow
def test_a_rank_that_holds_experts_does_not_wait_in_its_attention_for_a_late_member():
    """Every member attends and holds experts: a round's rows need every member's header for
    their receive sizes. Rank 1's attention is late by 0.4 s each micro-batch; rank 0 emits
    and goes on to its next micro-batch's attention (the rows go once the headers are in),
    so none of its forward attention tasks holds that wait (it did: each lasted until rank 1
    had emitted the same round)."""
    per_rank = run_ranks(2, fit_with_a_late_attention, 2)
    fast = [d for name, d in per_rank[0] if name.startswith("Af")]
    late = [d for name, d in per_rank[1] if name.startswith("Af")]
    assert len(fast) == len(late) == 4, per_rank  # 2 layers x 2 micro-batches
    assert min(late) >= LATE_S, late
    assert max(fast) < LATE_S / 2, fast  # a loaded host may delay a task; never by a whole late emit


@pytest.mark.slow
def test_every_rank_attends_and_answers_a_layers_micro_batches_back_to_back():
    """The EP layout under zebra (every member attends and holds experts): the layered order,
    where a rank emits all of a layer's micro-batches before it answers them. Rank 1 holds
    no expert of layer 1 (it takes part in the rounds with empty shares and posts their
    combines itself); still equal to one process, training and validation."""
    per_rank = check(2, [
        dict(plan=make_test_plan(2, [0, 1], R=2, placement=[[0, 1, 0, 1], [0, 0, 0, 0]])),
        dict(plan=make_test_plan(2, [0, 1], R=3, placement=[[0, 0, 1, 1], [1, 0, 1, 0]]), validate=True,
             trainer=dict(limit_val_batches=1.0)),
        # DistEP's own placement (the ids chosen at a routing: base_placement), not id order
        dict(plan=replace(make_test_plan(2, [0, 1], R=2, placement=[[0, 0, 1, 1], [1, 1, 0, 0]]),
                          base_placement=[[0, 0, 1, 1], [1, 1, 0, 0]]), mode="distep"),
    ])
    assert per_rank[0][2]["placement"] == [[[0, 1], [2, 3]], [[2, 3], [0, 1]]]
    # what ran: a layer's micro-batches emitted, then answered back to back (rank 1 holds
    # nothing of layer 1, so answers nothing there); DistEP answers each round at once
    assert per_rank[0][0]["work"][:6] == ["Af0.0", "Af0.1", "Xf0.0", "Xf0.1", "Af1.0", "Af1.1"]
    assert per_rank[0][1]["work"][:9] == ["Af0.0", "Af0.1", "Af0.2", "Xf0.0", "Xf0.1", "Xf0.2",
                                          "Af1.0", "Af1.1", "Af1.2"]
    assert per_rank[1][0]["work"][:6] == ["Af0.0", "Af0.1", "Xf0.0", "Xf0.1", "Af1.0", "Af1.1"]
    assert "Xf1.0" not in per_rank[1][0]["work"]
    assert per_rank[0][2]["work"][:4] == ["Af0.0", "Xf0.0", "Af1.0", "Xf1.0"]


@pytest.mark.parametrize("counts", [[[3, 0, 2], [1, 4, 0]], [[0, 0]], [[5]], [[0, 2], [3, 0], [1, 1]]])
def test_received_rows_are_put_in_expert_order_by_senders_then_arrival(counts):
    """The rows a round brings, by sender and within each by local expert, are taken in
    expert order, senders in order within an expert (the naive loop), built on the device
    from the counts alone."""
    from lightning_hetermoe.strategy.backends.zebra.expert_tasks import expert_order

    c = torch.tensor(counts)
    starts, at = {}, 0
    for g, row in enumerate(counts):
        for e, n in enumerate(row):
            starts[(g, e)] = at
            at += n
    naive = [starts[(g, e)] + i for e in range(c.shape[1]) for g in range(c.shape[0]) for i in range(counts[g][e])]
    got = expert_order(c, int(c.sum()), torch.device("cpu"))
    assert got.tolist() == naive and got.dtype == torch.long


@pytest.mark.parametrize("counts, one_sender", [([[0, 0, 0], [1, 4, 2]], True), ([[5]], True), ([[0, 0]], True),
                                                ([[3, 0, 2], [1, 4, 0]], False), ([[0, 2], [0, 0], [1, 0]], False)])
def test_rows_from_one_sender_are_taken_as_they_came(counts, one_sender):
    """Where at most one member sent rows (a ZP group of one attention rank), the experts
    run on them as they came, with no sort and no scatter back: the naive order is the
    identity there (and the sort stays wherever two members sent rows)."""
    from lightning_hetermoe.strategy.backends.zebra.expert_tasks import arrived_in_expert_order, expert_order

    c = torch.tensor(counts)
    rows = int(c.sum())
    assert arrived_in_expert_order(c) == one_sender
    identity = expert_order(c, rows, torch.device("cpu")).tolist() == list(range(rows))
    assert identity or not one_sender
