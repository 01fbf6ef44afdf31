"""What set-up prints: the schedule ``mode="auto"`` runs beside the runner-up, the plan table at
the run's own predictions, and a rank's name before it has chosen (a failure in set-up names
the rank)."""

from __future__ import annotations

from lightning_hetermoe.strategy.selection import choice_line


def test_the_fastest_is_chosen_and_the_runner_up_named_with_how_much_slower_it_is():
    best, line = choice_line({"zebra": 2_000.0, "ep": 1_000.0, "datacentric": 1_500.0})
    assert best == "zebra"
    assert line == ("hetermoe[auto]: chose zebra (2,000 tokens/s predicted); "
                    "runner-up datacentric (1,500 tokens/s, 1.33x slower)")


def test_a_tie_runs_the_first_candidate_and_is_not_called_slower():
    # zebra and distep on a layout where every rank attends run the same steps
    best, line = choice_line({"zebra": 1_018_006.0, "distep": 1_018_006.0, "ep": 900_000.0})
    assert best == "zebra"
    assert line.endswith("runner-up distep (1,018,006 tokens/s, within 0.5%)") and "slower" not in line
    best, line = choice_line({"distep": 1_000.0, "zebra": 1_004.0})
    assert best == "zebra" and line.endswith("runner-up distep (1,000 tokens/s, within 0.5%)")
    best, line = choice_line({"distep": 1_000.0, "zebra": 1_006.0})
    assert line.endswith("runner-up distep (1,000 tokens/s, 1.01x slower)")


def test_a_single_candidate_has_no_runner_up():
    best, line = choice_line({"ep": 10.0})
    assert (best, line) == ("ep", "hetermoe[auto]: chose ep (10 tokens/s predicted)")


def test_before_auto_chooses_a_rank_is_named_by_its_device_not_as_an_auto_rank():
    from lightning_hetermoe import HeterMoEStrategy

    cluster = {"name": "mix", "devices": ["a40", "v100"]}
    assert HeterMoEStrategy(cluster=cluster).describe_rank(1) == "schedule not chosen yet, device v100"
    assert HeterMoEStrategy(mode="ep", cluster=cluster).describe_rank(1) == "ep rank, device v100"


def test_the_announced_plan_table_is_the_run_s_own_prediction_not_the_planner_s_at_the_placed_batches():
    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.plan import make_plan
    from lightning_hetermoe.strategy.backends.base import Simulated
    from lightning_hetermoe.strategy.run_clock import RunClock
    from lightning_hetermoe.strategy.selection import priced_for_the_run

    model = ModelConfig(n_layers=2, moe=MoEConfig(num_experts=4))
    cluster = ClusterConfig(name="mix", devices=["a40", "v100", "v100"])
    clock = RunClock(cluster, None, rank=0)
    clock.bind(model, 4, 64, 3, cluster.specs())
    placed_at = [[0.4, 0.3, 0.2, 0.1]] * 2  # the pooled routing the planner places experts at
    clock.expert_load, clock.batch_loads = placed_at, [[[0.1, 0.2, 0.3, 0.4]] * 2, [[0.25] * 4] * 2]
    plan = make_plan(cluster, model, seq_len=64, global_batch_tokens=12 * 64, timer=clock.timer,
                     expert_load=placed_at, max_waves=1)
    before = {k: dict(v) for k, v in plan.predicted.items()}
    priced_for_the_run(plan, clock, 3)
    zebra = clock.step_time(Simulated("zebra", plan=plan))  # the mean over the two held-out batches
    assert plan.predicted["zebra"]["step_time_s"] == zebra != before["zebra"]["step_time_s"]
    assert plan.predicted["zebra"]["tokens_per_s"] == clock.tokens_per_step / zebra
    assert plan.predicted["ep"]["step_time_s"] == clock.step_time(Simulated("ep", ep_size=3))
    assert set(plan.predicted) == set(before)  # every row re-priced, none added


def test_a_given_plan_is_priced_for_the_run_on_a_copy_the_caller_s_plan_stays_as_given():
    import copy

    from lightning_hetermoe import HeterMoEStrategy, MoELanguageModel
    from lightning_hetermoe.cluster import ClusterConfig
    from lightning_hetermoe.configs import ModelConfig, MoEConfig
    from lightning_hetermoe.plan import make_plan
    from lightning_hetermoe.strategy.run_clock import RunClock
    from lightning_hetermoe.strategy.selection import _decide, _Description

    model = ModelConfig(n_layers=2, moe=MoEConfig(num_experts=4))
    cluster = ClusterConfig(name="mix", devices=["a40", "v100", "v100"])
    clock = RunClock(cluster, None, rank=0)
    clock.bind(model, 4, 64, 3, cluster.specs())
    clock.batch_loads = [[[0.1, 0.2, 0.3, 0.4]] * 2]  # held-out routing unlike the even one it was planned at
    given = make_plan(cluster, model, seq_len=64, global_batch_tokens=12 * 64, max_waves=1)
    before = copy.deepcopy(given.predicted)
    module = MoELanguageModel(model)
    for mode in ("zebra", "auto"):
        strategy = HeterMoEStrategy(mode=mode, plan=given, cluster=cluster)
        schedule, plan, ep_size = _decide(strategy.args, clock, 3, module, _Description.of(module))
        assert schedule == "zebra" and plan is not given and ep_size is None
        assert plan.predicted["zebra"]["step_time_s"] != before["zebra"]["step_time_s"]  # priced for the run
        assert given.predicted == before  # the caller's plan as it was given
