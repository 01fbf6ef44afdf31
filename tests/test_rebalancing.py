"""Moving and copying experts while training runs changes no number; the monitor counts
what the routers route; a checkpoint taken after a move resumes anywhere."""

from __future__ import annotations

import copy
import itertools
from fractions import Fraction

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

from harness import run_ranks
from lightning_hetermoe import ExpertLoadMonitor, ExpertRebalancer, HeterMoEStrategy, OptimConfig
from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.placement import Placement
from lightning_hetermoe.model_contract import moe_layers
from lightning_hetermoe.training import timing_summary
from reference import MoveAt, assert_same_params, data, global_batches, make_model, reference_fit, trainer, whole_checkpoint
from helpers_zebra import make_test_plan
from helpers_bench import load_bench

pytestmark = pytest.mark.slow  # every test here starts processes
# the rebalancing benchmark's skewed router: a fixed offset on hot experts' logits
SKEW = load_bench("skew")

STEPS = 6
SGD = dict(name="sgd", lr=0.1, momentum=0.9, warmup_steps=0)


class PricedRebalancer(ExpertRebalancer):
    """The rebalancer as it is, recording at each decision what the simulator gives for the
    placement then at the recent steps' own routings and at the moving average."""

    @property
    def state_key(self) -> str:
        return ExpertRebalancer.__qualname__  # its checkpoints resume under the rebalancer's own key

    def decide(self, trainer):
        from lightning_hetermoe.callbacks.rebalancer import RECENT_STEPS

        decision = super().decide(trainer)  # a decision moves nothing: the placement is still the one it priced
        if decision is not None:
            monitor, strategy = self._monitor(trainer), trainer.strategy
            recent = monitor.step_shares(skip=0)[-min(self.every_n_steps, RECENT_STEPS):]  # every step, then the last
            placed = strategy.placement
            decision["priced"] = (strategy.predict(placed, None, recent)["device_step_time_s"],
                                  strategy.predict(placed, monitor.load_share())["device_step_time_s"], len(recent))
        return decision


def fit_moving(rank: int, world: int, cases: list[dict], ckpt_dir: str | None = None):
    out = []
    for case in cases:
        model = make_model(4, seed=rank, optim=OptimConfig(**case.get("optim", {})))
        strategy = HeterMoEStrategy(mode=case.get("mode", "ep"), plan=case.get("plan"), cluster=case.get("cluster"))
        move = MoveAt(2, case["placement"])
        callbacks = [move, ExpertLoadMonitor(log_every_n_steps=1, plots=False)]
        if case.get("rebalancer"):
            callbacks.append(PricedRebalancer(every_n_steps=2, warmup_steps=3, min_gain=0.0, **case["rebalancer"]))
        if case.get("hot"):
            callbacks.append(SKEW.SkewedRouter(hot=case["hot"], bias=2.0))
        where = case.get("ckpt_dir", ckpt_dir)
        if where:
            callbacks.append(ModelCheckpoint(dirpath=where, filename="{step}", every_n_train_steps=4,
                                             save_top_k=-1))
        t = trainer(strategy, world, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=bool(where))
        t.fit(model, datamodule=data(world, case.get("global", 8)))
        out.append({"state": model.state_dict(), "moved": move.moved, "after": move.after, "kept": move.kept,
                    "counts": callbacks[1].last_counts, "decisions": callbacks[2].decisions if case.get("rebalancer")
                    else None, "routes": move.final.routes})
        if case.get("cluster") is not None:
            # the summary's prediction at the timed steps' routing, beside the simulator's at
            # the placement the run ended with and at the plan's
            steps = callbacks[1].step_shares(skip=1)
            summary = timing_summary({"step_time_s": None, "timing_warmup_steps": 1}, strategy, case["cluster"],
                                     None, callbacks[1])
            out[-1]["at_load"] = (summary["predicted_step_time_at_measured_load_s"],
                                  strategy.predict(strategy.trained_placement, batch_loads=steps)["step_time_s"],
                                  strategy.predict(batch_loads=steps)["step_time_s"])
    return out if rank == 0 else None


CASES = [
    # EP on 2 ranks: swap experts between the ranks, AdamW
    dict(placement=[[[2, 3], [0, 1]], [[0, 2], [1, 3]]]),
    # EP: copies of experts 0 and 1 on both ranks (replication), SGD with momentum; then
    # the real rebalancer runs every 2 steps with copies allowed, on an emulated A40 and T4
    # timed as D1 at 4K (at the tiny model's own size copies never pay) with experts 2 and 3
    # hot: it copies them onto the A40 and routes part of the T4's share there
    dict(placement=[[[0, 1, 2], [0, 1, 3]], [[0, 1], [1, 2, 3]]], optim=SGD,
         rebalancer=dict(redundant_experts=2), cluster=ClusterConfig(devices=["a40", "t4"], emulate=True, time_scale=0.05,
                                                     emulate_workload={"model": "d1", "seq_len": 4096}), hot=(2, 3)),
]


@pytest.fixture(scope="module")
def routed_ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("routed")


@pytest.fixture(scope="module")
def moved(routed_ckpt):
    """Both cases, one start of the ranks (the monitor test reads the first case too; the
    second saves a checkpoint at step 4, after its first rebalance)."""
    return run_ranks(2, fit_moving, 2, [CASES[0], dict(CASES[1], ckpt_dir=str(routed_ckpt))])[0]


def test_moves_and_copies_in_the_middle_of_training_change_no_number(moved):
    for case, got in zip(CASES, moved, strict=True):
        model = make_model(4, seed=0, optim=OptimConfig(**case.get("optim", {})))
        if case.get("hot"):
            SKEW.skew(model, case["hot"], bias=2.0)
        initial = copy.deepcopy(model.state_dict())
        expected = reference_fit(model, STEPS)
        assert got["moved"] > 0 and got["after"] == case["placement"], (got["moved"], got["after"])
        assert got["kept"]
        assert_same_params(got["state"], expected, initial)
        if case.get("rebalancer"):
            applied = [d for d in got["decisions"] if d["apply"]]
            assert applied and applied[-1]["routed"] and got["routes"] is not None, got["decisions"]
            # whether a move pays is priced at the recent steps' own routings, not at the
            # moving average the search explores with
            for d in got["decisions"]:
                at_steps, at_average, n = d["priced"]
                assert d["predicted_before_s"] == at_steps and n == 2, d
                assert at_steps != pytest.approx(at_average, rel=1e-6), d
            # the summary prices the timed steps with the experts where the moves left them
            summary, at_end, at_plan = got["at_load"]
            assert summary == at_end and at_end != pytest.approx(at_plan, rel=1e-3), (got["at_load"], got["decisions"])


def test_zebra_moves_between_expert_ranks_and_onto_the_attention_rank():
    plan = make_test_plan(3, [0], R=2)  # members: attention 0, experts 1 and 2
    # layer 0: expert 3 goes to the attention rank, 0 and 2 swap expert ranks; layer 1 reshuffles
    cases = [dict(mode="zebra", plan=plan, global_=12, placement=[[[3], [0, 1], [2]], [[], [0, 3], [1, 2]]]),
             dict(mode="zebra", plan=plan, global_=12, placement=[[[0], [1, 2], [3]], [[1], [0], [2, 3]]],
                  optim=SGD, rebalancer={})]
    for case in cases:
        case["global"] = case.pop("global_")
    results = run_ranks(3, fit_moving, 3, cases)[0]
    for case, got in zip(cases, results, strict=True):
        model = make_model(4, seed=0, optim=OptimConfig(**case.get("optim", {})))
        initial = copy.deepcopy(model.state_dict())
        from helpers_zebra import pieces

        expected = reference_fit(model, STEPS, global_batch=12, pieces=pieces(plan, "zebra"))
        assert got["moved"] > 0 and got["after"] == case["placement"]
        assert_same_params(got["state"], expected, initial)


def fit_moving_averaged(rank: int, world: int, cases: list[dict]):
    out = []
    for case in cases:
        model = make_model(4, seed=0, optim=OptimConfig())
        move = MoveAt(2, case["placement"])
        t = trainer(HeterMoEStrategy(mode=case["mode"], plan=case.get("plan")), world, max_steps=STEPS,
                    callbacks=[move, EMAWeightAveraging(decay=0.7, device=case.get("average_device"))])
        t.fit(model, datamodule=data(world, 8))
        out.append({"state": model.state_dict(), "after": move.after})
    return out if rank == 0 else None


def test_a_weight_average_moves_with_its_experts():
    """Lightning's EMA weight averaging keeps an average of each rank's share: when experts
    move (mid-run, at step 2), each expert's average moves with it, so the module after fit
    (the average copied in) equals one process's average. Under ep two ranks swap experts;
    under zebra an expert goes onto the attention rank and one comes off it."""
    cases = [dict(mode="ep", placement=[[[2, 3], [0, 1]], [[0, 2], [1, 3]]]),
             dict(mode="zebra", plan=make_test_plan(2, [0], R=2), placement=[[[3], [0, 1, 2]], [[0], [1, 2, 3]]])]
    _assert_averages_move(cases)


@pytest.mark.standin
def test_a_weight_average_kept_in_host_memory_moves_and_comes_back_whole_beside_a_device():
    """``EMAWeightAveraging(device="cpu")`` (what a rank past its memory budget is told to
    use) beside a compute device that is not host memory, as on a GPU: the average's experts
    are gathered for the move and at the end of the fit, and its dense tensors sent from the
    attention rank, each on the compute device (a host tensor on a device collective failed
    there: ``experts.gather: a device collective ... got a tensor on cpu``)."""
    _assert_averages_move([dict(mode="zebra", plan=make_test_plan(2, [0], R=2), average_device="cpu",
                                placement=[[[3], [0, 1, 2]], [[0], [1, 2, 3]]])])


def _assert_averages_move(cases: list[dict]) -> None:
    """Each case's module after fit (the average copied in) equals one process's average."""
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    t = trainer("auto", 1, max_steps=STEPS, callbacks=[EMAWeightAveraging(decay=0.7)])
    t.fit(model, datamodule=data(1, 8))
    expected = model.state_dict()
    for case, got in zip(cases, run_ranks(2, fit_moving_averaged, 2, cases)[0], strict=True):
        assert got["after"] == case["placement"]
        assert_same_params(got["state"], expected, initial)


def test_monitor_counts_equal_the_routers_counts_summed_by_hand(moved):
    got = moved[0]
    # the last step's global batch, routed by the model as it was before the last update
    model = make_model(4, seed=0, optim=OptimConfig())
    before_last = reference_fit(model, STEPS - 1)
    model.load_state_dict(before_last)
    batch = next(itertools.islice(global_batches(), STEPS - 1, None))
    with torch.no_grad():
        auxes = model.model(batch[0])[1]
    by_hand = torch.zeros(2, 4, dtype=torch.long)
    for l, aux in enumerate(auxes):
        for e in range(4):
            by_hand[l, e] = int(aux.tokens_per_expert[e])
    assert torch.equal(got["counts"], by_hand), (got["counts"], by_hand)
    assert int(by_hand.sum()) == 2 * 8 * 16 * 2  # layers x sequences x tokens x top_k: every choice counted


def resume(rank: int, world: int, ckpt: str):
    model = make_model(4, seed=50 + rank, optim=OptimConfig())
    t = trainer(HeterMoEStrategy(mode="ep"), world, max_steps=STEPS,
                callbacks=[ExpertLoadMonitor(plots=False), ExpertRebalancer(every_n_steps=100)])
    t.fit(model, datamodule=data(world), ckpt_path=ckpt)
    return model.state_dict() if rank == 0 else None


def test_a_checkpoint_after_a_move_resumes_on_another_world_size(tmp_path):
    got = run_ranks(2, fit_moving, 2, [dict(CASES[0], rebalancer=dict(redundant_experts=0))], str(tmp_path))[0][0]
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    expected = reference_fit(model, STEPS)
    assert_same_params(got["state"], expected, initial)
    ckpt = whole_checkpoint(tmp_path / "step=4.ckpt")
    w_up = ckpt["state_dict"]["model.blocks.0.moe.experts.w_up"]
    assert w_up.shape[0] == 4, "placement-independent: every expert, once"
    saved = next(v for k, v in ckpt["callbacks"].items() if "ExpertRebalancer" in k)["saved"]
    assert saved["placement"] == CASES[0]["placement"], "the placement is part of the checkpoint"
    assert_same_params(run_ranks(4, resume, 4, str(tmp_path / "step=4.ckpt"))[0], expected, initial)


class PlacementAtStart(L.Callback):
    """Where the experts are when training starts (after a resumed rebalancer moved them)."""

    def on_train_start(self, trainer, pl_module):
        self.placement = trainer.strategy.placement


def resume_routed(rank: int, world: int, ckpt: str):
    case = CASES[1]
    model = make_model(4, seed=50 + rank, optim=OptimConfig(**case["optim"]))
    start = PlacementAtStart()
    t = trainer(HeterMoEStrategy(mode="ep", cluster=case["cluster"]), world, max_steps=STEPS,
                callbacks=[ExpertLoadMonitor(plots=False), ExpertRebalancer(every_n_steps=100, **case["rebalancer"]),
                           start, SKEW.SkewedRouter(hot=case["hot"], bias=2.0)])
    t.fit(model, datamodule=data(world), ckpt_path=ckpt)
    return {"state": model.state_dict(), "start": start.placement}


def test_routes_are_checkpointed_and_a_resumed_run_routes_by_them(moved, routed_ckpt):
    ckpt = whole_checkpoint(routed_ckpt / "step=4.ckpt")
    saved = next(v for k, v in ckpt["callbacks"].items() if "ExpertRebalancer" in k)["saved"]
    assert saved["routes"] is not None, "the step-3 rebalance routed copies; the checkpoint keeps the routes"
    got = run_ranks(2, resume_routed, 2, str(routed_ckpt / "step=4.ckpt"))[0]
    assert got["start"] == Placement(saved["placement"], saved["routes"])
    model = make_model(4, seed=0, optim=OptimConfig(**CASES[1]["optim"]))
    SKEW.skew(model, CASES[1]["hot"], bias=2.0)
    initial = copy.deepcopy(model.state_dict())
    assert_same_params(got["state"], reference_fit(model, STEPS), initial)


class ServedLog(L.Callback):
    """Adopt ``placement`` as training starts (the rebalancer's resume path), then record
    per forward of every MoE layer this rank's routed choices per expert (the layer's own
    count) and what each of its local experts served."""

    def __init__(self, placement, routes=None) -> None:
        self.placement, self.routes, self.calls = placement, routes, []

    def on_train_start(self, trainer, pl_module):
        trainer.strategy.move_experts(Placement(self.placement, self.routes))
        assert trainer.strategy.placement == Placement(self.placement, self.routes)
        for l, (_, layer) in enumerate(moe_layers(pl_module)):
            def routed(mod, args, output, l=l):
                self.calls.append({"layer": l, "routed": output[1].tokens_per_expert.tolist(),
                                   "served": self._served.pop(), "held": list(mod.dispatcher.placement)})

            def served(mod, args):
                if torch.is_grad_enabled():
                    self._served = [args[2].tolist()]

            layer.register_forward_hook(routed)
            layer.experts.register_forward_pre_hook(served)


def fit_served(rank: int, world: int, placement, routes=None, ep_size=None):
    model = make_model(4, seed=rank)
    log = ServedLog(placement, routes)
    t = trainer(HeterMoEStrategy(mode="ep", expert_parallel_size=ep_size), world, max_steps=STEPS, callbacks=[log])
    t.fit(model, datamodule=data(world, 12))
    return {"state": model.state_dict(), "calls": log.calls, "copy_routing": t.strategy.copy_routing()}


def local_first_by_hand(routed: list[list[int]], held: list[list[int]], routes=None) -> list[list[int]]:
    """Naive reference of the dispatch rule: per source rank and expert, its own copy if it
    holds one, else every copy (one node) in even runs of its choices in token order; an
    expert with a route cut in runs of the route's shares (choice ``i`` of ``n`` to the last
    copy whose run starts at or before ``i / n``)."""
    served = [[0] * len(h) for h in held]
    for src, counts in enumerate(routed):
        for e, n in enumerate(counts):
            have = [h for h in range(len(held)) if e in held[h]]
            route = routes[e] if routes is not None else None
            if route is not None:
                shares = [Fraction(f).limit_denominator(1000) for f in route[src]]
            else:
                copies = [src] if e in held[src] else have
                shares = [Fraction(1, len(copies)) if h in copies else Fraction(0) for h in have]
            for i in range(n):
                start, pick = Fraction(0), None
                for h, f in zip(have, shares):
                    if f > 0 and Fraction(i, n) >= start:
                        pick = h
                    start += f
                served[pick][held[pick].index(e)] += 1
    return served


# layer 0: expert 0 on ranks 0 and 2, expert 1 on 0 and 1, expert 3 on 1 and 2 (rank 1's
# choices for expert 0 split over ranks 0 and 2); layer 1: rank 2 holds every expert.
# Expert 1 of layer 0 has a route, per source [share to rank 0's copy, to rank 1's]: rank 0
# splits its choices evenly, rank 1 sends three quarters away, rank 2 (no copy) all to rank 0.
SERVED_PLACEMENT = [[[0, 1, 2], [1, 3], [0, 3]], [[0, 1], [2, 3], [0, 1, 2, 3]]]
SERVED_ROUTES = [[None, [[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]], None, None], None]


def test_local_first_and_routed_dispatch_serve_by_the_rule_and_change_no_number():
    ranks = run_ranks(3, fit_served, 3, SERVED_PLACEMENT, SERVED_ROUTES)
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    assert_same_params(ranks[0]["state"], reference_fit(model, STEPS, global_batch=12), initial)
    calls = [r["calls"] for r in ranks]
    assert len(calls[0]) == 2 * STEPS and all(len(c) == len(calls[0]) for c in calls)
    split_somewhere = routed_away = False
    for i in range(len(calls[0])):
        routed = [c[i]["routed"] for c in calls]
        layer = calls[0][i]["layer"]
        held = calls[0][i]["held"]
        assert held == SERVED_PLACEMENT[layer]
        assert [c[i]["served"] for c in calls] == local_first_by_hand(routed, held, SERVED_ROUTES[layer]), i
        split_somewhere |= layer == 0 and routed[1][0] > 1
        routed_away |= layer == 0 and routed[1][1] > 3  # rank 1 sends 3/4 of its expert-1 choices away
    assert split_somewhere, "a rank without a copy sent choices to two copies"
    assert routed_away, "a rank with a copy sent part of its choices to another copy by the route"


# Two EP groups of two ranks (ranks 0-1 and 2-3), one placement and its routes for both:
# layer 0 keeps expert 1 on both EP ranks, EP rank 0 sends half its expert-1 choices to
# the other copy, EP rank 1 three quarters to EP rank 0's; layer 1 has no copies.
GROUPS_PLACEMENT = [[[0, 1, 2], [1, 3]], [[0, 1], [2, 3]]]
GROUPS_ROUTES = [[None, [[0.5, 0.5], [0.75, 0.25]], None, None], None]


def test_routes_serve_in_every_ep_group_of_alike_ones_and_change_no_number():
    """expert_parallel_size=2 on 4 ranks: each group's dispatch serves by the route, its
    sources being its own ranks (the same rule by hand, group by group), the weights are
    single-process training's, and the strategy offers routes (the groups are alike: one
    device kind, even shares)."""
    ranks = run_ranks(4, fit_served, 4, GROUPS_PLACEMENT, GROUPS_ROUTES, 2)
    model = make_model(4, seed=0, optim=OptimConfig())
    initial = copy.deepcopy(model.state_dict())
    assert_same_params(ranks[0]["state"], reference_fit(model, STEPS, global_batch=12), initial)
    assert all(r["copy_routing"] == ("local_first", [1.0, 1.0], None) for r in ranks)
    calls = [r["calls"] for r in ranks]
    assert len(calls[0]) == 2 * STEPS and all(len(c) == len(calls[0]) for c in calls)
    routed_away = False
    for group in ((0, 1), (2, 3)):
        for i in range(len(calls[0])):
            layer = calls[group[0]][i]["layer"]
            routed = [calls[r][i]["routed"] for r in group]
            held = calls[group[0]][i]["held"]
            assert held == GROUPS_PLACEMENT[layer]
            served = [calls[r][i]["served"] for r in group]
            assert served == local_first_by_hand(routed, held, GROUPS_ROUTES[layer]), (group, i)
            routed_away |= layer == 0 and served[0][1] > routed[0][1]  # EP rank 0's copy took EP rank 1's
    assert routed_away, "EP rank 1 sent part of its expert-1 choices to EP rank 0's copy by the route"
