"""Zebra and DistEP on real gloo processes equal single-process training on the global batch,
at the default loss coefficients, after 5 AdamW steps, for every mix of roles the executor
must handle (plans written by hand so each case is exactly the one named)."""

from __future__ import annotations

import copy
import weakref

import lightning as L
import pytest
import torch

from harness import run_ranks
import lightning_hetermoe.comm as comm
import lightning_hetermoe.strategy.backends.zebra.backend as zebra_backend
from lightning_hetermoe import HeterMoEStrategy, MoELayer, OptimConfig, Plan
from lightning_hetermoe.model_contract import find_blocks
from lightning_hetermoe.plan import ZPGroup
from lightning_hetermoe.apportion import split_microbatches
from reference import SEQ, assert_same_params, data, make_model, reference_fit, trainer, validation_loss

STEPS = 5
GLOBAL = {2: 8, 3: 12, 4: 8, 5: 10}  # sequences per step, a multiple of the world size
# An even number of batches per epoch: Lightning steps after an epoch's last batch even when
# gradient accumulation is incomplete, and the reference assumes full accumulation cycles.
WINDOWS = {2: 64, 3: 72, 4: 64, 5: 60}


def make_test_plan(world: int, attention: list[int], R: int, *, num_experts: int = 4, layers: int = 2,
                   groups: list[tuple[list[int], list[int]]] | None = None,
                   placement: list[list[int]] | None = None) -> Plan:
    """One ZP group (attention ranks, then expert ranks) unless ``groups`` says otherwise;
    experts spread evenly over the expert members unless ``placement`` says otherwise."""
    experts = [r for r in range(world) if r not in attention]
    groups = groups or [(attention, experts)]
    zp = [ZPGroup(attention_ranks=a, expert_ranks=e) for a, e in groups]
    M, N = len(zp[0].attention_ranks), len(zp[0].expert_ranks)
    if placement is None:
        per = split_microbatches(num_experts, N)
        row = [M + i for i, n in enumerate(per) for _ in range(n)]
        placement = [row[:] for _ in range(layers)]
    size = M + N
    counts = [[sum(1 for p in placement[l] if p == m) for l in range(layers)] for m in range(size)]
    att_all = [r for a, _ in groups for r in a]
    seqs = [0] * world
    for r, n in zip(att_all, split_microbatches(GLOBAL[world], len(att_all))):
        seqs[r] = n
    return Plan(model="test", cluster="test", seq_len=SEQ, devices=["cpu"] * world,
                roles=["attention" if r in att_all else "expert" for r in range(world)], zp_groups=zp,
                num_microbatches=R, seqs_per_rank=seqs, placement=placement, base_counts=counts,
                distep_microbatches=1)


def pieces(plan: Plan, mode: str) -> list[int]:
    """How the executor cuts the global batch: attention shares, then micro-batches."""
    R = plan.num_microbatches if mode == "zebra" else plan.distep_microbatches
    out = []
    for r in plan.attention_ranks:
        out += [n for n in split_microbatches(plan.seqs_per_rank[r], R) if n]
    return out


class Holdings(L.Callback):
    """What each rank holds while training runs (before teardown gathers the model back)."""

    def on_train_end(self, trainer, pl_module):
        experts = {id(p) for m in pl_module.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
        dense = [p for p in pl_module.parameters() if id(p) not in experts]
        opt = trainer.optimizers[0]
        self.dense_numel = sum(p.numel() for p in dense)
        # optimizer state of dense parameters (or of the ranges of them this rank owns, where
        # the state is sharded over the attention ranks)
        self.dense_state = sum(1 for p, s in opt.state.items() if id(p) not in experts and s)
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}


class SyncBuffers:
    """While inside: the bytes of the dense gradient sync's buffers (tensors it all-reduces
    that are not a parameter's gradient) alive at each of its all-reduces, at most."""

    def __init__(self, model) -> None:
        self.model, self.peak, self.calls, self._live = model, 0, 0, []

    def __enter__(self) -> "SyncBuffers":
        self._original = original = comm.all_reduce

        def watched(group, t, *, what, **kwargs):
            if what == "zebra.grads.dense":
                self.calls += 1
                grads = {p.grad.untyped_storage().data_ptr() for p in self.model.parameters() if p.grad is not None}
                self._live = [r for r in self._live if r() is not None] + [weakref.ref(t)]
                held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                        for x in (r() for r in self._live) if x is not None}
                self.peak = max(self.peak, sum(n for ptr, n in held.items() if ptr not in grads))
            return original(group, t, what=what, **kwargs)

        comm.all_reduce = watched
        return self

    def __exit__(self, *exc) -> None:
        comm.all_reduce = self._original


def fit_cases(rank: int, world: int, cases: list[dict]) -> list | None:
    out = []
    default_bucket = zebra_backend.BUCKET_BYTES
    for case in cases:
        model = make_model(case.get("num_experts", 4), seed=rank, optim=OptimConfig(), **case.get("moe", {}))
        zebra_backend.BUCKET_BYTES = case.get("bucket_bytes", default_bucket)
        strategy = HeterMoEStrategy(mode=case.get("mode", "zebra"), plan=case.get("plan"))
        held = Holdings()
        t = trainer(strategy, world, max_steps=STEPS, callbacks=[held], **case.get("trainer", {}))
        dm = data(world, GLOBAL[world], windows=WINDOWS[world])
        with SyncBuffers(model) as buffers:
            t.fit(model, datamodule=dm)
        zebra_backend.BUCKET_BYTES = default_bucket
        result = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "dense_numel": held.dense_numel,
                  "dense_state": held.dense_state, "train_metrics": held.metrics,
                  "sync": {"peak": buffers.peak, "calls": buffers.calls}}
        if case.get("validate"):
            result["val"] = t.validate(model, datamodule=dm, verbose=False)
        out.append(result)
    return out


def check(world: int, cases: list[dict]) -> list:
    per_rank = run_ranks(world, fit_cases, world, cases)
    for c, case in enumerate(cases):
        actual = per_rank[0][c]
        model = make_model(case.get("num_experts", 4), seed=0, optim=OptimConfig(), **case.get("moe", {}))
        initial = copy.deepcopy(model.state_dict())
        plan = case.get("plan")
        mode = case.get("mode", "zebra")
        cut = pieces(plan, mode) if plan is not None else None
        # train_loss is logged without sync_dist: rank 0 shows its own share, as under DDP
        stats: dict = {"ce_rows": plan.seqs_per_rank[plan.attention_ranks[0]] if plan is not None else None}
        tk = case.get("trainer", {})
        expected = reference_fit(model, STEPS, global_batch=GLOBAL[world], windows=WINDOWS[world], pieces=cut,
                                 stats=stats,
                                 accumulate=tk.get("accumulate_grad_batches", 1), clip=tk.get("gradient_clip_val"),
                                 clip_algorithm=tk.get("gradient_clip_algorithm", "norm"))
        for key in case.get("exercises", ()):
            assert stats.get(key, 0) > 0, f"the case never exercised {key}: {stats}"
        assert_same_params(actual["state"], expected, initial)
        if plan is not None and mode != "ep":
            for r in plan.expert_ranks:  # expert ranks hold no dense weights, no dense optimizer state
                assert per_rank[r][c]["dense_numel"] == 0 and per_rank[r][c]["dense_state"] == 0, r
            for r in plan.attention_ranks:
                assert per_rank[r][c]["dense_numel"] > 0 and per_rank[r][c]["dense_state"] > 0, r
        if case.get("validate"):
            # self.log in the user's steps, once per step, reduced over the attention ranks
            want = validation_loss(stats["model"], GLOBAL[world])
            assert abs(actual["val"][0]["val_loss"] - want) < 1e-4, (actual["val"], want)
            assert abs(actual["train_metrics"]["train_loss"] - stats["last_ce"]) < 1e-4, stats["last_ce"]
    return per_rank


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
def test_one_attention_one_expert_rank_zebra_distep_and_ep_agree():
    check(2, [
        dict(plan=make_test_plan(2, [0], R=2), validate=True, trainer=dict(limit_val_batches=1.0)),
        dict(plan=make_test_plan(2, [0], R=3)),  # 8 sequences in 3 micro-batches: 3+3+2
        dict(plan=make_test_plan(2, [0], R=1)),
        dict(plan=make_test_plan(2, [0], R=2), mode="distep"),
        dict(mode="ep"),
    ])


@pytest.mark.slow
def test_three_ranks_two_attention_and_asym_ea_experts_on_the_attention_rank():
    # 1+2 with Asym-EA: layer 0 puts expert 3 on the attention rank, layer 1 experts 2 and 3.
    asym = [[1, 1, 2, 0], [1, 2, 0, 0]]
    check(3, [
        # 2+1: val_loss reduced over 2 attention ranks
        dict(plan=make_test_plan(3, [0, 1], R=2), validate=True, trainer=dict(limit_val_batches=1.0)),
        # Lightning's gradient accumulation and global-norm clipping, through the zebra executor
        dict(plan=make_test_plan(3, [0, 1], R=2), trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
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
        simulated = [t.name for t, s in sorted(((t, s) for t, s in zip(res.timeline.tasks, res.timeline.start)
                                                if t.resource == lane), key=lambda x: x[1])]
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
    from lightning_hetermoe.strategy.arguments import check_plan

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


def test_logged_numbers_are_replayed_on_the_modules_device():
    """A Python float logged with sync_dist inside a zebra step is reduced over the metrics
    group (NCCL on GPUs, which refuses CPU tensors): the replay puts it on the module's device."""
    from lightning_hetermoe.strategy.backends.zebra.logs import _reduce

    calls = [(0.5, (), {"sync_dist": True}, 0), (1.5, (), {"sync_dist": True}, 1)]
    item = _reduce("lr_scale", calls, [2, 6], None, torch.device("meta"))
    assert item.value.device.type == "meta" and item.numeric
    cpu = _reduce("lr_scale", calls, [2, 6], None, torch.device("cpu"))
    assert float(cpu.value) == (0.5 * 2 + 1.5 * 6) / 8  # micro-batches weighted by their rows
