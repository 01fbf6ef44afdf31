"""The step simulator against hand-computed timelines, and the schedules' basic laws."""

import dataclasses
import os

import numpy as np
import pytest

from lightning_hetermoe.cluster import LinkConfig, get_device
from lightning_hetermoe.configs import ModelConfig, MoEConfig
from lightning_hetermoe.profile import make_timer
from lightning_hetermoe.task_order import build_schedule
from lightning_hetermoe.simulate import (
    Lane,
    StepSetup,
    Task,
    draw_gantt,
    ep_setup,
    run_dag,
    simulate_ep,
    simulate_ep_ideal,
    simulate_step,
)


class FakeTimer:
    """Fixed durations per device name, independent of token counts (0 for no tokens)."""

    def __init__(self, attn=None, expert=None):
        self.attn = attn or {}
        self.exp = expert or {}

    def attention(self, dev, tokens, backward=False):
        f = self.attn.get(dev.name, 1.0)
        return 0.0 if tokens <= 0 else (2 * f if backward else f)

    def expert(self, dev, tokens, backward=False):
        f = self.exp.get(dev.name, 1.0)
        return 0.0 if tokens <= 0 else (2 * f if backward else f)

    def head(self, dev, tokens, forward_only=False):
        return 0.0

    def optimizer(self, dev, n):
        return 0.0

    def comm(self, nbytes, link):
        return 0.0

    def transfer(self, rows, link):
        return self.comm(rows, link)

    def allreduce(self, nbytes, n, link):
        return 0.0

    def grad_sync(self, n_params, n, link):
        return 0.0


def tiny_model(experts=1, top_k=1):
    return ModelConfig(
        name="t",
        vocab_size=16,
        d_model=8,
        n_layers=2,
        n_heads=2,
        max_seq_len=16,
        moe=MoEConfig(num_experts=experts, top_k=top_k, d_ff=16),
    )


A40, V100 = get_device("a40"), get_device("v100")


def zebra_setup(kind="zebra"):
    # one attention rank (1 sequence per micro-batch), one expert rank holding the only expert
    lanes = [Lane(A40, [0], seqs=[1, 1], experts=[0, 0]), Lane(V100, [1], seqs=[], experts=[1, 1], role="expert")]
    return StepSetup(lanes=lanes, model=tiny_model(), seq_len=4, num_microbatches=2, link=LinkConfig(),
                     schedule=build_schedule(kind, 2, 2))


def test_zebra_two_layers_two_microbatches_by_hand():
    # attention fwd 1, bwd 2; expert fwd 1, bwd 2; head and transfers free.
    # A: Af(0,0)[0,1] Af(0,1)[1,2] Af(1,0)[2,3] Af(1,1)[3,4]   X: Xf(0,0)[1,2] Xf(0,1)[2,3] Xf(1,0)[3,4]
    # X: Xf(1,1)[4,5] Xb(1,0)[5,7] Xb(1,1)[7,9] Xb(0,0)[9,11] Xb(0,1)[11,13]
    # A: Ab(1,0)[7,9] Ab(1,1)[9,11] Ab(0,0)[11,13] Ab(0,1)[13,15]  -> step 15
    res = simulate_step(zebra_setup(), FakeTimer())
    assert res.step_time == pytest.approx(15.0)
    assert res.busy[0] == pytest.approx(4 * 1 + 4 * 2)  # 4 forward + 4 backward attention tasks
    assert res.busy[1] == pytest.approx(4 * 1 + 4 * 2)
    assert res.idle[0] == pytest.approx(3.0)
    assert sum(e - s for s, e in res.bubbles[res.lanes[1]]) == pytest.approx(3.0)
    tl = res.timeline
    start = {(t.name, t.resource[0]): s for t, s in zip(tl.tasks, tl.start, strict=True)}
    assert start[("Xb1.0", "1")] == pytest.approx(5.0) and start[("Ab0.1", "0")] == pytest.approx(13.0)


def test_distep_serialises_microbatches_by_hand():
    # one micro-batch: Af Xf Af Xf (4) + H (0) + Xb Ab Xb Ab (8) = 12; two in a row = 24
    res = simulate_step(zebra_setup("distep"), FakeTimer(), "distep")
    assert res.step_time == pytest.approx(24.0)
    assert simulate_step(zebra_setup(), FakeTimer()).step_time < res.step_time


def test_ep_slowest_rank_sets_the_pace_by_hand():
    # two EP ranks, one expert each (E=2, top-1), one micro-batch; V100 attention takes 2 (bwd 4)
    # per layer fwd: max(1, 2) + 1 = 3 -> 6; bwd: 2 + max(2, 4) = 6 -> 12; step 18
    lanes = [Lane(A40, [0], seqs=[1], experts=[1, 1], role="ep"), Lane(V100, [1], seqs=[1], experts=[1, 1], role="ep")]
    setup = StepSetup(
        lanes=lanes, model=tiny_model(experts=2), seq_len=4, num_microbatches=1, link=LinkConfig()
    )
    res = simulate_step(setup, FakeTimer(attn={"v100": 2.0}), "ep")
    assert res.step_time == pytest.approx(18.0)
    assert res.busy[0] == pytest.approx(2 * 1 + 2 * 1 + 2 * 2 + 2 * 2)
    assert res.idle[0] == pytest.approx(6.0) and res.idle[1] == pytest.approx(0.0)
    assert res.tokens == 8 and res.tokens_per_s == pytest.approx(8 / 18.0)


def test_checkpointed_ep_blocks_run_their_forward_and_both_exchanges_again_by_hand():
    """An EP block's experts are inside it: checkpointed, its backward first recomputes the
    attention, dispatch, experts and combine (the real exchanges again), then runs the
    backward's own exchanges; the backward tasks are their recomputing price less a forward."""
    from types import SimpleNamespace

    class Checkpointed(FakeTimer):  # backward = 3 x forward (a forward recomputed), transfers 0.5
        cost = SimpleNamespace(activation_checkpointing=True)

        def attention(self, dev, tokens, backward=False):
            return 1.5 * super().attention(dev, tokens, backward) if backward else super().attention(dev, tokens)

        def expert(self, dev, tokens, backward=False):
            return 1.5 * super().expert(dev, tokens, backward) if backward else super().expert(dev, tokens)

        def comm(self, nbytes, link):
            return 0.5 if nbytes > 0 else 0.0

    lanes = [Lane(A40, [0], seqs=[1], experts=[1, 1], role="ep"), Lane(V100, [1], seqs=[1], experts=[1, 1], role="ep")]
    setup = StepSetup(lanes=lanes, model=tiny_model(experts=2), seq_len=4, num_microbatches=1, link=LinkConfig())
    # forward per layer: Af max(1, 2), Df .5, Xf 1, Cf .5 = 4 -> 8. Backward per layer: the
    # recompute Ar max(1, 2), Dr .5, Xr 1, Cr .5, then Db .5, Xb 3 - 1, Cb .5, Ab 6 - 2 on the
    # V100 = 11 -> 22: step 30 (priced without the recompute's exchanges it would be 28)
    res = simulate_step(setup, Checkpointed(attn={"v100": 2.0}), "ep", keep_timeline=True)
    assert res.step_time == pytest.approx(30.0)
    start = starts(res)
    assert start[("Dr1.0", "a")] == pytest.approx(10.0) and start[("Db1.0", "a")] == pytest.approx(12.0)
    assert start[("Af0.0r", "1")] == pytest.approx(19.0)  # the V100's recompute of layer 0
    assert res.busy[1] == pytest.approx(2 * (2 + 1) + 2 * (2 + 1 + 2 + 4))  # every forward once more, no more


def test_transfers_and_tails_add_time():
    class Slow(FakeTimer):
        def comm(self, nbytes, link):
            return 0.5 if nbytes > 0 else 0.0

    # every forward/backward expert round trip pays two transfers on the critical path at least
    assert simulate_step(zebra_setup(), Slow()).step_time > simulate_step(zebra_setup(), FakeTimer()).step_time


class Transfers(FakeTimer):
    def comm(self, nbytes, link):
        return 0.5 if nbytes > 0 else 0.0


def starts(res):
    tl = res.timeline
    return {(t.name, t.resource[0]): s for t, s in zip(tl.tasks, tl.start, strict=True)}


def test_a_round_emitted_after_the_experts_started_moves_after_them():
    # Af(0,0)[0,1] -> Df0.0[1,1.5] -> Xf(0,0)[1.5,2.5]. Round (0,1) is emitted at 2, after
    # Xf(0,0) started: the expert rank issues its part after Xf(0,0)'s kernels (the
    # communication stream waits for them): Df0.1[2.5,3], Xf(0,1)[3,4]
    start = starts(simulate_step(zebra_setup(), Transfers()))
    assert start[("Df0.1", "a")] == pytest.approx(2.5)
    assert start[("Xf0.1", "1")] == pytest.approx(3.0)


def test_a_round_emitted_before_the_experts_start_moves_while_they_run():
    # attention 0.25: Af(0,0)[0,.25] Df0.0[.25,.75] Xf(0,0)[.75,1.75]; round (0,1) is emitted
    # at .5, before Xf(0,0) starts, so its receive goes first: Df0.1[.75,1.25] under Xf(0,0),
    # and Xf(0,1) starts as Xf(0,0) ends (1.75, not 2.25)
    start = starts(simulate_step(zebra_setup(), Transfers(attn={"a40": 0.25})))
    assert start[("Df0.1", "a")] == pytest.approx(0.75)
    assert start[("Xf0.1", "1")] == pytest.approx(1.75)


def test_every_tail_starts_after_the_last_task_of_any_rank():
    class SlowOptimizer(FakeTimer):
        def optimizer(self, dev, n):
            return 10.0 if dev.name == "v100" else 0.0

    # the by-hand step above: the expert rank's last task ends at 13, the attention rank's at
    # 15; the step's loss is agreed on every rank first, so the expert rank's optimizer runs
    # from 15, not from 13. In several waves it ends the step: 2 x 15 + 10
    waves = zebra_setup()
    waves.waves = 2
    two = simulate_step(waves, SlowOptimizer(), keep_timeline=True)
    assert two.step_time == pytest.approx(40.0)
    # a rank's idle in the step: its bubbles in both waves, then the wait after them for the tails
    after_waves = two.step_time - 2 * two.timeline.makespan
    summary = two.summary()
    assert summary["waves"] == 2
    for lane, rank in zip(two.lanes, (0, 1)):
        assert summary["bubble_s"][lane] + after_waves == pytest.approx(summary["idle_s"][str(rank)])
    # In one wave each rank goes on into the next step when its own tail ends: the attention
    # rank at once, the expert rank 10 later. A: Af(0,0)[0,1] Af(0,1)[1,2]  X: Xf(0,0)[10,11]
    # Xf(0,1)[11,12]  A: Af(1,0)[11,12] Af(1,1)[12,13]  X: Xf(1,0)[12,13] Xf(1,1)[13,14]
    # Xb(1,0)[14,16] Xb(1,1)[16,18]  A: Ab(1,0)[16,18] Ab(1,1)[18,20]  X: Xb(0,0)[18,20]
    # Xb(0,1)[20,22]  A: Ab(0,0)[20,22] Ab(0,1)[22,24]: 24 after the last step's end, not 25
    res = simulate_step(zebra_setup(), SlowOptimizer(), keep_timeline=True)
    assert res.step_time == pytest.approx(24.0)
    start = starts(res)
    assert start[("Af0.0", "0")] == pytest.approx(0.0) and start[("Xf0.0", "1")] == pytest.approx(10.0)
    # its tail is its work, not a bubble: it waits only from 22 to 24
    assert res.summary()["bubble_s"]["e:v100[1]"] == pytest.approx(24.0 - 10.0 - 12.0)
    assert simulate_step(zebra_setup(), FakeTimer()).step_time == pytest.approx(15.0)  # no tail: as before


def test_an_ep_ranks_optimizer_waits_for_the_slowest_ranks_backward():
    class SlowA40Optimizer(FakeTimer):
        def optimizer(self, dev, n):
            return 10.0 if dev.name == "a40" else 0.0

    # the EP step by hand above: the V100's last task (its first layer's attention backward)
    # ends at 18, the A40's at 16. Every rank holds the dense weights and their gradient
    # all-reduce (DDP's) ends only once the V100 joins: the A40's optimizer runs from 18
    # (28), not from its own 16 (26)
    lanes = [Lane(A40, [0], seqs=[1], experts=[1, 1], role="ep"), Lane(V100, [1], seqs=[1], experts=[1, 1], role="ep")]
    setup = StepSetup(lanes=lanes, model=tiny_model(experts=2), seq_len=4, num_microbatches=1, link=LinkConfig())
    res = simulate_step(setup, SlowA40Optimizer(attn={"v100": 2.0}), "ep", keep_timeline=True)
    tl = res.timeline
    ends = {}
    for t, e in zip(tl.tasks, tl.end, strict=True):
        if ":" in t.resource:  # a rank's own tasks (the exchanges run on their channels)
            ends[t.resource[0]] = max(ends.get(t.resource[0], 0.0), e)
    assert ends == {"0": pytest.approx(16.0), "1": pytest.approx(18.0)}
    assert res.step_time == pytest.approx(28.0)


def test_run_dag_rejects_cycles_and_honours_fifo():
    with pytest.raises(ValueError, match="cycle"):
        run_dag([Task("a", "r", 1.0, [1]), Task("b", "r", 1.0, [0])])
    # fifo: the task that became ready first runs first even with a worse priority
    tasks = [
        Task("x", "p", 1.0, []),
        Task("y", "q", 3.0, []),
        Task("late", "r", 1.0, [1], priority=(0,)),
        Task("early", "r", 1.0, [0], priority=(9,)),
    ]
    tl = run_dag(tasks, {"r": "fifo"})
    assert tl.start[3] == pytest.approx(1.0) and tl.start[2] == pytest.approx(3.0)


def test_bad_setups_raise():
    from lightning_hetermoe.simulate.lane_vectors import simulate_step_time

    for simulate in (simulate_step, simulate_step_time):  # the task graph, and all lanes at once
        s = zebra_setup()
        s.lanes[1].experts = [0, 1]  # layer 0 expert placed nowhere
        with pytest.raises(ValueError, match="layer 0"):
            simulate(s, FakeTimer())
        s = zebra_setup()
        s.num_microbatches = 3
        with pytest.raises(ValueError, match="micro-batch"):
            simulate(s, FakeTimer())


def realistic():
    model = ModelConfig(
        name="d",
        vocab_size=32000,
        d_model=1024,
        n_layers=2,
        n_heads=16,
        max_seq_len=8192,
        moe=MoEConfig(num_experts=8, top_k=2, d_ff=3584),
    )
    return model, make_timer(model, 4096)


def test_ep_balanced_gives_faster_ranks_more_and_helps():
    model, timer = realistic()
    devs = [A40, A40, V100, V100]
    bal = ep_setup(devs, model, seq_len=4096, total_seqs=16, link=LinkConfig(), timer=timer, balanced=True)
    seqs = {lane.device.name: sum(lane.seqs) for lane in bal.lanes}
    assert seqs["a40"] > seqs["v100"]
    even = simulate_ep(devs, model, seq_len=4096, total_seqs=16, link=LinkConfig(), timer=timer)
    fast = simulate_ep(devs, model, seq_len=4096, total_seqs=16, link=LinkConfig(), timer=timer, balanced=True)
    assert fast.tokens_per_s > even.tokens_per_s and fast.tokens == even.tokens


def test_ep_groups_run_as_copies_of_one_group_and_sum_the_experts_gradients_over_them():
    """expert_parallel_size < world: world / ep_size EP groups of consecutive ranks, each
    holding every expert over its own ranks and exchanging inside itself; after the
    backward each expert's gradients are summed over its copies in the other groups. On a
    link that costs nothing the step is one group's on its share of the batch, for the
    whole batch's tokens; on a real one the sum over the groups makes it longer. (It was
    priced as one world-wide group whatever ep_size said: each rank half the experts it
    holds, nothing summed over groups.) Groups of other devices: the slowest sets the step."""
    model, timer = realistic()
    E = model.moe.num_experts
    free = LinkConfig(bandwidth_gbps=1e12, latency_us=0.0)

    def ep(devs, seqs, link, **kw):
        return simulate_ep(devs, model, seq_len=4096, total_seqs=seqs, link=link, timer=timer, num_microbatches=1,
                           keep_timeline=False, **kw)

    setup = ep_setup([A40] * 4, model, seq_len=4096, total_seqs=16, link=LinkConfig(), timer=timer, ep_size=2, group=1)
    assert (setup.replicas, setup.replica_ranks, setup.dense_ranks) == (2, {2: [2, 0], 3: [3, 1]}, [0, 1, 2, 3])
    # at even routing the group's two alike ranks are one lane of half the experts each
    assert [(lane.ranks, lane.experts[0], lane.expert_ids) for lane in setup.lanes] == [([2, 3], E // 2, [])]
    # at a measured routing each rank's experts are priced at their own loads
    load = [[1 / E] * E for _ in range(model.n_layers)]
    measured = ep_setup([A40] * 4, model, seq_len=4096, total_seqs=16, link=LinkConfig(), timer=timer, ep_size=2,
                        group=1, expert_load=load)
    assert [(lane.ranks, lane.expert_ids[0]) for lane in measured.lanes] == [([2], list(range(E // 2))),
                                                                             ([3], list(range(E // 2, E)))]
    two, one = ep([A40] * 4, 16, free, ep_size=2), ep([A40] * 2, 8, free)
    assert two.step_time == pytest.approx(one.step_time, rel=1e-9) and two.tokens == 2 * one.tokens
    assert two.step_time > ep([A40] * 4, 16, free).step_time  # one world-wide group: a quarter of the experts each
    assert ep([A40] * 4, 16, LinkConfig(), ep_size=2).step_time > ep([A40] * 2, 8, LinkConfig()).step_time
    mixed = ep([A40, A40, V100, V100], 16, free, ep_size=2)
    assert mixed.step_time == pytest.approx(ep([V100] * 2, 8, free).step_time, rel=1e-9)
    assert mixed.step_time > ep([A40] * 2, 8, free).step_time and mixed.tokens == 16 * 4096
    with pytest.raises(ValueError, match="ep_size=3 is invalid: must divide the 4 ranks"):
        ep([A40] * 4, 16, free, ep_size=3)


def test_ep_ideal_sums_separate_homogeneous_runs():
    model, timer = realistic()
    devs = [A40, A40, V100, V100]
    ideal = simulate_ep_ideal(devs, model, seq_len=4096, total_seqs=16, link=LinkConfig(), timer=timer)
    a = simulate_ep(devs[:2], model, seq_len=4096, total_seqs=8, link=LinkConfig(), timer=timer)
    v = simulate_ep(devs[2:], model, seq_len=4096, total_seqs=8, link=LinkConfig(), timer=timer)
    assert ideal.tokens_per_s == pytest.approx(a.tokens_per_s + v.tokens_per_s)
    assert set(ideal.busy) == {0, 1, 2, 3}


def test_the_gantt_chart_draws_every_task_of_the_timeline_and_each_lane_s_share_of_the_step(tmp_path):
    """Each task of the wave the timeline holds is one bar, in its row, from its start to its
    end; a lane's label says its share of the whole step (both waves' busy time), as the
    result's utilization does; the title says one wave of two is drawn."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from lightning_hetermoe.simulate import gantt
    from lightning_hetermoe.simulate.step import lane_resource

    setup = dataclasses.replace(zebra_setup(), waves=2)
    res = simulate_step(setup, FakeTimer())
    fig, ax = plt.subplots()
    gantt._draw(ax, res, "zebra")
    rows = gantt._rows(res)
    drawn = []
    for collection in ax.collections:
        for path in collection.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            drawn.append((round((ys.min() + ys.max()) / 2), xs.min(), xs.max()))
    tl = res.timeline
    expected = [(rows.index(t.resource), s, e) for t, s, e in zip(tl.tasks, tl.start, tl.end) if e > s]
    assert len(drawn) == len(expected) > 4
    assert np.allclose(sorted(drawn), sorted(expected))
    labels = [label.get_text() for label in ax.get_yticklabels()]
    for i, lane in enumerate(setup.lanes):
        share = res.utilization[lane.ranks[0]]
        assert 0.5 < share <= 1 and labels[rows.index(lane_resource(i, lane))].endswith(f"{share:.0%} busy"), labels
    assert ax.get_title() == "zebra; 1 of 2 waves shown"
    plt.close(fig)
    path = draw_gantt(res, str(tmp_path / "g.png"))
    assert os.path.getsize(path) > 1000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- one way in: predict_step ------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed_plan():
    from lightning_hetermoe.plan import as_cluster, make_plan

    model, timer = realistic()
    view = as_cluster(["a40", "a40", "v100", "v100"])
    plan = make_plan(view, model, seq_len=4096, global_batch_tokens=16 * 4096)
    return plan, view, model, timer


def test_predict_step_prices_every_schedule_as_its_builder_does(mixed_plan):
    from lightning_hetermoe.simulate import PREDICTED, plan_setup, predict_step, simulate_plan
    from lightning_hetermoe.simulate.datacentric import datacentric_step_time
    from lightning_hetermoe.simulate.predict import predict_step_time

    plan, view, model, timer = mixed_plan
    devs, topo, n = view.devices, view.topology, plan.total_seqs

    def ask(schedule):
        return predict_step(schedule, devs, model, topo, timer, plan=plan).step_time

    for s in ("zebra", "distep"):
        assert ask(s) == simulate_step(plan_setup(plan, devs, model, topo, schedule=s), timer).step_time
        # what the planner's search compares: the step alone, without the per-rank breakdown
        assert predict_step_time(s, devs, model, topo, timer, plan=plan) == ask(s)
    with pytest.raises(ValueError, match="not disaggregated"):
        predict_step_time("ep", devs, model, topo, timer, plan=plan)
    for s in ("ep", "ep_balanced"):
        assert ask(s) == simulate_ep(devs, model, seq_len=4096, total_seqs=n, link=topo, timer=timer,
                                     balanced=s == "ep_balanced").step_time
    assert ask("ep_ideal") == simulate_ep_ideal(devs, model, seq_len=4096, total_seqs=n, link=topo,
                                                timer=timer).step_time
    dc = datacentric_step_time(devs, model, seq_len=4096, total_seqs=n, link=topo, timer=timer)
    assert ask("datacentric") == dc
    # the plan recipe asks simulate_plan for every schedule the plan's table lists
    res = simulate_plan(plan, devs, model, topo, timer, schedule="datacentric")
    assert res.step_time == dc and res.tokens == n * 4096
    assert set(PREDICTED) == set(plan.predicted)
    assert all(plan.predicted[s]["step_time_s"] == ask(s) for s in PREDICTED)
    with pytest.raises(ValueError, match="unknown schedule"):
        ask("zebra2")


def test_a_placement_given_to_predict_step_is_priced_and_the_plan_keeps_its_own(mixed_plan):
    import dataclasses

    from lightning_hetermoe.placement import Placement
    from lightning_hetermoe.simulate import predict_step

    plan, view, model, timer = mixed_plan
    devs, topo = view.devices, view.topology
    members = len(plan.zp_groups[0].members)
    owners = [[0 if e < len(row) // 2 else p for e, p in enumerate(row)] for row in plan.placement]  # half on one
    mine = [row[:] for row in plan.placement]
    moved = predict_step("zebra", devs, model, topo, timer, plan=plan,
                         placement=Placement.from_owners(owners, members)).step_time
    by_hand = predict_step("zebra", devs, model, topo, timer, plan=dataclasses.replace(plan, placement=owners))
    assert moved == by_hand.step_time and plan.placement == mine
    assert moved != predict_step("zebra", devs, model, topo, timer, plan=plan).step_time  # it was priced
    # EP: the contiguous split given as a placement is the EP layout itself
    W, L, E = len(devs), model.n_layers, model.moe.num_experts
    for s in ("ep", "ep_balanced"):
        plain = predict_step(s, devs, model, topo, timer, seq_len=4096, total_seqs=16, num_microbatches=1)
        given = predict_step(s, devs, model, topo, timer, seq_len=4096, total_seqs=16, num_microbatches=1,
                             placement=Placement.contiguous(L, E, W), ep_size=W)
        assert given.step_time == plain.step_time


def test_the_data_centric_step_waits_at_every_layers_collectives():
    """Two ranks, one heavy on experts and one on attention: each layer's gathers leave when
    the last rank issues them and its reduce-scatter starts when the last rank reaches it,
    so the step is longer than either rank's own sum (the waits); worked by hand."""
    from lightning_hetermoe.simulate.datacentric import _synchronised_step

    experts_heavy = {"head": 0.0, "attn_fwd": [1.0, 1.0], "attn_bwd": [1.0, 1.0], "experts_fwd": [3.0, 3.0],
                     "experts_bwd": [3.0, 3.0]}
    attention_heavy = {"head": 0.0, "attn_fwd": [2.0, 2.0], "attn_bwd": [2.0, 2.0], "experts_fwd": [1.0, 1.0],
                       "experts_bwd": [1.0, 1.0]}
    # forward: layer 0's gather leaves at 2 (the last rank ready), arrives 2.5; both start
    # then, the next gather leaves at 2.5; the experts-heavy rank ends the forward at 9.5.
    # backward, layer 1: gather 9.5 -> 10, experts to 16 and 12, scatter 16 -> 16.5 (layer 0's
    # gather leaves then, arrives 17), attention to 17.5 and 18.5; layer 0: its gather already
    # there, experts to 23.5 and 20.5, scatter -> 24, attention to 25 and 26 (26.5 and 27.5
    # with layer 0's backward gather issued only when the last rank needed it)
    assert _synchronised_step([experts_heavy, attention_heavy], 2, 0.5, 0.5) == 26.0
    # each alone: 24 and 16 (the same walk with no one to wait for)
    assert _synchronised_step([experts_heavy], 2, 0.5, 0.5) == 24.0
    assert _synchronised_step([attention_heavy], 2, 0.5, 0.5) == 16.0


def test_checkpointed_data_centric_blocks_gather_and_run_their_experts_again_by_hand():
    """Checkpointed, a data-centric block's backward first runs its forward again: the
    attention, a gather in step with the other ranks, the experts; then the experts' own
    recompute runs on the weights that gather brought (no second gather). The backward
    prices include the recompute (3 x forward)."""
    from lightning_hetermoe.simulate.datacentric import _synchronised_step

    experts_heavy = {"head": 0.0, "attn_fwd": [1.0, 1.0], "attn_bwd": [3.0, 3.0], "experts_fwd": [3.0, 3.0],
                     "experts_bwd": [9.0, 9.0]}
    attention_heavy = {"head": 0.0, "attn_fwd": [2.0, 2.0], "attn_bwd": [6.0, 6.0], "experts_fwd": [1.0, 1.0],
                       "experts_bwd": [3.0, 3.0]}
    # forward as above: 9.5 and 6.5. Backward, layer 1: recomputed attention to 10.5 and 8.5,
    # gather 10.5 -> 11, experts (the block's forward, their own recompute and the backward
    # less the forward already run: experts_fwd + experts_bwd) to 23 and 15, scatter -> 23.5
    # (layer 0's gather leaves, arrives 24), attention (its backward less the recompute) to
    # 25.5 and 27.5. Layer 0: recomputed attention to 26.5 and 29.5, its gather there, experts
    # to 38.5 and 33.5, scatter -> 39, to 41 and 43 (46.5 with the backward gather issued when
    # needed, 47.5 with the second gather the experts' recompute once made)
    assert _synchronised_step([experts_heavy, attention_heavy], 2, 0.5, 0.5, recompute=True) == 43.0


def test_issue_order_puts_the_next_dispatch_first_only_where_it_is_safe():
    from lightning_hetermoe.task_order import Round

    sched = build_schedule("zebra", 2, 2)
    early = sched.early_rounds([False, False])
    # every round but the last: the next one is emitted before this one's answers are needed
    assert early == frozenset(sched.rounds[:-1])
    order = sched.issue_order([False, False])
    assert [r for k, r in order if k == "dispatch"] == sched.rounds
    pos = {e: i for i, e in enumerate(order)}
    for q, nxt in zip(sched.rounds, sched.rounds[1:]):
        assert pos[("dispatch", q)] < pos[("dispatch", nxt)] < pos[("combine", q)]
    # an attention rank holding experts of layer 0 answers its rounds before it emits the next
    held = sched.early_rounds([True, False])
    assert not any(r.layer == 0 for r in held) and Round("fwd", 1, 0) in held
    # one micro-batch: each forward round's answer is needed by the task that emits the next
    one = build_schedule("zebra", 2, 1)
    assert Round("fwd", 0, 0) not in one.early_rounds([False, False])
    assert build_schedule("distep", 2, 2).early_rounds([False, False]) == frozenset()


@pytest.mark.parametrize("schedule", ["zebra", "distep"])
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_the_gates_a_channels_order_implies_can_go_without_changing_any_time(schedule, R):
    """An expert rank's collectives wait for the last experts it ran; the graph keeps that edge
    only on the first round after each new answer (a channel runs its rounds in order, so
    the later ones wait anyway). Every task's start and end equal the graph with every edge,
    on plans whose expert ranks hold experts in a few layers only (the thousands-of-ranks case)."""
    from lightning_hetermoe.plan import as_cluster, make_plan
    from lightning_hetermoe.simulate import plan_setup
    from lightning_hetermoe.simulate.step import build_tasks, run_step_dag

    model = ModelConfig(name="sparse", vocab_size=1000, d_model=256, n_layers=6, n_heads=4, max_seq_len=2048,
                        moe=MoEConfig(num_experts=2, top_k=1, d_ff=512))
    timer = make_timer(model, 1024)
    view = as_cluster(["h100", "h100", "a40"] + ["v100"] * 12)
    for M in (2, 3):
        plan = make_plan(view, model, seq_len=1024, global_batch_tokens=8 * R * 1024, num_microbatches=R,
                         num_attention_ranks=M, num_zp_groups=1, schedules=(schedule,))
        # each expert rank holds experts in two layers (one attention rank in some, where M = 3),
        # as on thousands of ranks where a layer's experts are spread thin
        n_exp = len(plan.zp_groups[0].expert_ranks)
        plan.placement = [[M + (2 * l) % n_exp, M + (2 * l + 1) % n_exp] if l % 3 or M == 2 else [0, M + l % n_exp]
                          for l in range(model.n_layers)]
        plan.base_counts = []
        setup = plan_setup(plan, view.devices, model, view.topology, schedule=schedule)
        assert any(0 < sum(x > 0 for x in lane.experts) < model.n_layers for lane in setup.lanes)
        timelines = []
        for every in (False, True):
            tasks, policies, _, late = build_tasks(setup, timer, every_gate=every)
            timelines.append((run_step_dag(tasks, policies, late), sum(len(t.deps) for t in tasks)))
        (pruned, n_pruned), (full, n_full) = timelines
        assert n_pruned < n_full  # edges did go
        assert pruned.start == full.start and pruned.end == full.end


@pytest.mark.parametrize("schedule", ["zebra", "distep"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_order_graphs_timed_in_one_pass_equal_the_event_loop_to_the_last_bit(schedule, seed):
    """Where every resource runs its tasks in a fixed order (zebra, DistEP), run_dag times the
    graph in one topological pass; the event loop is the reference. Random durations, the
    late headers' extra edges included, experts held in a few layers: every start and end equal."""
    import random

    from lightning_hetermoe.plan import as_cluster, make_plan
    from lightning_hetermoe.simulate import plan_setup
    from lightning_hetermoe.simulate.engine import _run_events, _run_ordered
    from lightning_hetermoe.simulate.step import build_tasks

    rng = random.Random(seed)
    model = ModelConfig(name="sparse", vocab_size=1000, d_model=256, n_layers=5, n_heads=4, max_seq_len=2048,
                        moe=MoEConfig(num_experts=4, top_k=2, d_ff=512))
    view = as_cluster(["h100", "a40", "a40"] + ["v100"] * 6)
    R = 1 + seed
    plan = make_plan(view, model, seq_len=1024, global_batch_tokens=8 * R * 1024, num_microbatches=R,
                     num_attention_ranks=2, num_zp_groups=1, schedules=(schedule,))
    setup = plan_setup(plan, view.devices, model, view.topology, schedule=schedule)
    tasks, policies, _, late = build_tasks(setup, make_timer(model, 1024))
    for t in tasks:
        t.duration *= rng.uniform(0.2, 3.0)
    for h in late[::2]:  # as run_step_dag adds them where a header came late
        tasks[h.dispatch].deps.append(h.expert)
        if h.follow is not None:
            tasks[h.follow].deps.extend(h.emitters)
    assert set(policies.values()) == {"order"}
    fast, events = _run_ordered(tasks), _run_events(tasks, policies)
    assert fast.start == events.start and fast.end == events.end
    assert run_dag(tasks, policies).end == events.end
    with pytest.raises(ValueError, match="cycle"):  # an order the dependencies contradict
        first = next(i for i, t in enumerate(tasks) if t.resource == tasks[-1].resource)
        tasks[first].deps.append(len(tasks) - 1)
        _run_ordered(tasks)


def _round_by_round_order(sched, attention_holds):
    """The issue order before layered schedules existed, written out plainly: each dispatch,
    then the combine of the round before it where that round was early, else its own."""
    early = sched.early_rounds(attention_holds)
    out, deferred = [], None
    for r in sched.rounds:
        out.append(("dispatch", r))
        if deferred is not None:
            out.append(("combine", deferred))
            deferred = None
        if r in early:
            deferred = r
        else:
            out.append(("combine", r))
    return out


def _walk(sched, holds, attention_holds):
    """An attention member walking its task list as the executor does: a dispatch at each
    emission, its own combines as its experts answer, others' combines as soon as every
    collective before them in the order was issued. Returns the collectives in the order it
    issued them; raises where a task would wait for an answer that cannot have come."""
    from lightning_hetermoe.task_order import awaited_round, emitted_round

    order = sched.issue_order(attention_holds)
    issued, cursor = [], 0

    def took_part(event):
        nonlocal cursor
        assert order[cursor] == event, (order[cursor], event)
        issued.append(event)
        cursor += 1
        while cursor < len(order) and order[cursor][0] == "combine" and not holds[order[cursor][1].layer]:
            issued.append(order[cursor])
            cursor += 1

    for t in sched.member_tasks(True, holds):
        if t.kind.startswith("expert"):
            r = next(q for q in sched.rounds if q.expert_task == t)
            assert ("dispatch", r) in issued, f"{t} runs before its rows were dispatched"
            took_part(("combine", r))
            continue
        need = awaited_round(t, sched.num_layers)
        if need is not None and need in sched.rounds:
            assert ("combine", need) in issued, f"{t} waits for {need}, whose combine was never issued"
        emitted = emitted_round(t, sched.num_layers)
        if emitted in sched.rounds:
            took_part(("dispatch", emitted))
    assert issued == order
    return issued


@pytest.mark.parametrize("kind", ["zebra", "distep", "forward"])
@pytest.mark.parametrize("R", [1, 2, 3])
def test_layered_and_round_by_round_orders_are_walked_by_every_member_as_issued(kind, R):
    """Every pattern of holdings walks its task list in the issue order, with each answer
    issued before a task waits for it. Round by round, the order is the one written out
    plainly above; layered, a run's combines come after its last dispatch and a holder
    answers the run back to back (DistEP's runs are single rounds: its order is unchanged)."""
    import itertools

    L = 2
    plain, layered = build_schedule(kind, L, R), build_schedule(kind, L, R, layered=True)
    for holds in itertools.product([False, True], repeat=L):
        assert plain.issue_order(holds) == _round_by_round_order(plain, holds)
        _walk(plain, holds, holds)
        everyone = (True,) * L  # layered: every member attends; some hold nothing of a layer
        _walk(layered, holds, everyone)
    if kind == "distep" or R == 1:
        assert layered.issue_order((True,) * L) == plain.issue_order((True,) * L)
    else:
        tasks = [str(t) for t in layered.member_tasks(True, (True,) * L)]
        head = [f"Af0.{j}" for j in range(R)] + [f"Xf0.{j}" for j in range(R)] + [f"Af1.{j}" for j in range(R)]
        assert tasks[:3 * R] == head
        order = layered.issue_order((True,) * L)
        first = [e for e in order if e[1].layer == 0 and e[1].phase == "fwd"]
        assert [k for k, _ in first] == ["dispatch"] * R + ["combine"] * R


def test_a_layered_schedule_hides_the_exchange_an_ep_layout_waits_for():
    """Every rank attends and holds experts: answering each round before emitting the next
    leaves each rank idle through every dispatch; layered, the step is shorter, and the
    simulator's graph is the one the executor walks (same member lists)."""
    model = ModelConfig(name="t", vocab_size=1000, d_model=512, n_layers=3, n_heads=8, max_seq_len=4096,
                        moe=MoEConfig(num_experts=4, top_k=2, d_ff=1024))
    devs = [A40, V100]
    link = LinkConfig(bandwidth_gbps=25.0, latency_us=10.0)
    timer = make_timer(model, 2048)
    R = 4

    def step(layered):
        lanes = [Lane(d, [i], seqs=[2] * R, experts=[2] * 3) for i, d in enumerate(devs)]
        setup = StepSetup(lanes=lanes, model=model, seq_len=2048, num_microbatches=R, link=link,
                          schedule=build_schedule("zebra", 3, R, layered=layered))
        return simulate_step(setup, timer, "zebra", keep_timeline=False).step_time

    plain, layered = step(False), step(True)
    assert layered < 0.95 * plain, (layered, plain)


@pytest.mark.parametrize("seed", range(8))
def test_lanes_timed_at_once_give_the_task_graphs_step_time_to_the_last_bit(seed, monkeypatch):
    """The planner times a step with every lane of a role at once (simulate/lane_vectors.py).
    Against the task graph, task by task: random clusters (flat and on nodes), models, role
    splits and micro-batches, placements that put experts on attention ranks and leave
    layers empty on some ranks, measured routing, zebra, DistEP and forward-only, every rank
    attending (layered) or not. The same step time to the last bit, and late headers taken."""
    import random

    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.plan import as_cluster, make_plan
    from lightning_hetermoe.simulate import lane_vectors, plan_setup
    from lightning_hetermoe.simulate.step import build_tasks, carries_tails, disaggregated_step, run_step_dag

    moved = []
    real_run = lane_vectors._run

    def counting_run(prog, d, legs, dense, late_moved, late, free):
        moved.append(bool(late_moved.any()))
        return real_run(prog, d, legs, dense, late_moved, late, free)

    monkeypatch.setattr(lane_vectors, "_run", counting_run)
    compared = 0
    for case in range(6):
        rng = random.Random(1000 * seed + case)
        L, E = rng.randint(1, 5), rng.choice([1, 2, 3, 4, 8])
        model = ModelConfig(name="m", vocab_size=1000, d_model=256, n_layers=L, n_heads=4, max_seq_len=2048,
                            moe=MoEConfig(num_experts=E, top_k=rng.randint(1, min(2, E)), d_ff=512,
                                          aux_loss_coef=rng.choice([0.0, 0.01])))
        W = rng.randint(2, 9)
        devs = [rng.choice(["h100", "a40", "v100", "l40s", "t4"]) for _ in range(W)]
        cfg = ClusterConfig(name="c", devices=devs) if rng.random() < 0.5 else ClusterConfig(
            name="c", nodes=[{"name": f"n{i}", "devices": devs[i:i + 2], "link": "nvlink2"} for i in range(0, W, 2)],
            network="ib_hdr")
        view = as_cluster(cfg)
        R, M = rng.randint(1, 4), rng.choice([rng.randint(1, W), W])
        try:
            plan = make_plan(view, model, seq_len=1024, global_batch_tokens=rng.randint(1, 3) * M * R * 1024,
                             num_microbatches=R, num_attention_ranks=M, num_zp_groups=1, schedules=("zebra",))
        except ValueError:
            continue  # does not fit: another case
        timer = make_timer(model, 1024)
        n = len(plan.zp_groups[0].members)
        plan.waves = rng.choice([1, 2, 3])  # batches per optimizer step: the tail once after them
        for trial in range(3):
            load = None
            if trial:
                plan.placement = [[rng.randrange(n) for _ in range(E)] for _ in range(L)]
                plan.base_counts = []
            if trial == 2:
                load = [[w / sum(ws) for w in ws] for ws in
                        ([rng.random() + 0.05 for _ in range(E)] for _ in range(L))]
            for kind in ("zebra", "distep", "forward"):
                fast = lane_vectors.step_time(
                    plan_setup(plan, view.devices, model, view.topology, schedule=kind, expert_load=load), timer)
                setup = plan_setup(plan, view.devices, model, view.topology, schedule=kind, expert_load=load)
                tasks, policies, tails, late = build_tasks(setup, timer)
                graph = run_step_dag(tasks, policies, late)
                want = graph.makespan if kind == "forward" else disaggregated_step(graph.makespan, tails, plan.waves,
                                                                                  carries_tails(setup))
                assert fast == want, (case, trial, kind)
                compared += 1
    assert compared >= 18
    if seed in (0, 1):  # these seeds' cases take late headers: the passes that add them are compared too
        assert any(moved)


@pytest.mark.parametrize("kind", ["zebra", "distep", "forward"])
@pytest.mark.parametrize("layered", [False, True])
def test_an_attention_member_runs_the_full_list_less_the_layers_it_does_not_hold(kind, layered):
    """What lets lane_vectors give every attention lane one list: for every holdings pattern
    the member's task list is the list of a member holding every layer, less the expert
    tasks of the layers it does not hold."""
    import itertools

    from lightning_hetermoe.simulate.lane_vectors import _Program
    from lightning_hetermoe.simulate.step import graph_shape

    for R in (1, 2, 3):
        sched = build_schedule(kind, 3, R, layered=layered)
        full = sched.member_tasks(True, (True,) * 3)
        for holds in itertools.product([False, True], repeat=3):
            mine = [t for t in full if t.kind not in ("expert_fwd", "expert_bwd") or holds[t.layer]]
            assert sched.member_tasks(True, holds) == mine
            assert _Program(graph_shape(sched, holds)).valid
