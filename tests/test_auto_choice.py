"""What ``mode="auto"`` prints: the schedule it runs beside the runner-up, and a rank's name
before it has chosen (a failure in set-up names the rank)."""

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
