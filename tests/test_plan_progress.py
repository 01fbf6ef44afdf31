"""A long plan says, while it runs, how long it has run, how many layouts it has simulated
and where the search is (``plan/progress.py``): the recipe and the strategy's set-up watch
every plan they make; a plan shorter than the interval says nothing."""

from __future__ import annotations

import re
import time

import pytest

from lightning_hetermoe.cluster import ClusterConfig
from lightning_hetermoe.configs import ModelConfig, MoEConfig
from lightning_hetermoe.plan import make_plan
from lightning_hetermoe.plan import progress
from lightning_hetermoe.plan.progress import watched

LINE = re.compile(r"^\[plan\] (\d+) s: ([\d,]+) layouts simulated; (.+)$")


def plan_a_mix():
    model = ModelConfig(name="m", vocab_size=32000, d_model=1024, n_layers=4, n_heads=16, max_seq_len=4096,
                        moe=MoEConfig(num_experts=16, top_k=2, d_ff=2048))
    cluster = ClusterConfig(name="c", devices=["a40"] * 6 + ["v100"] * 6)
    return make_plan(cluster, model, seq_len=4096, global_batch_tokens=24 * 4096)


def test_a_watched_plan_says_how_far_it_got_while_it_runs():
    said: list[str] = []
    start = time.perf_counter()
    with watched(every_s=0.05, say=said.append):
        plan_a_mix()
    took = time.perf_counter() - start
    assert took > 0.15, f"the plan took {took:.2f} s: too short to watch"
    assert said, "nothing was said while the plan ran"
    parsed = [LINE.match(line) for line in said]
    assert all(parsed), said
    counts = [int(m.group(2).replace(",", "")) for m in parsed]
    assert counts == sorted(counts) and counts[-1] > 0, counts
    assert any("all 12 GPUs in 1 wave" in m.group(3) or "schedule" in m.group(3) for m in parsed), said
    after = len(said)
    time.sleep(0.2)
    assert len(said) == after, "the watch went on after its block"
    # unwatched, the search's reports change nothing
    progress.simulated(5)
    progress.stage("nowhere")
    assert progress._watch is None


def test_a_short_plan_says_nothing_and_a_nested_watch_adds_no_second_voice():
    said: list[str] = []
    start = time.perf_counter()
    with watched(every_s=30, say=said.append):
        with watched(every_s=0.01, say=said.append):
            time.sleep(0.1)
    assert said == [] and time.perf_counter() - start < 5


@pytest.mark.parametrize("bad", [0, -1.0, True, "10"])
def test_a_bad_interval_is_named(bad):
    with pytest.raises(ValueError, match="every_s"):
        with watched(every_s=bad):
            pass
