"""Each rank's busy time per step, as the load monitor sees it: measured on real devices
(EP without emulation), or from the emulated clock, one step at a time."""

from __future__ import annotations

import lightning as L
import pytest

from harness import run_ranks
from lightning_hetermoe import ExpertLoadMonitor, HeterMoEStrategy
from lightning_hetermoe.emulate import BusyMeter
from lightning_hetermoe.emulate import meter as meter_module
from reference import data, make_model, trainer

KINDS = ("attention", "experts", "comm", "idle")


class Record(L.Callback):
    """Every step's busy split and step time, read from the strategy right after the step."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.strategy
        self.steps.append((s.rank_busy(), s.clock.last_step_s))


def fit_busy(rank: int, world: int, cluster):
    model = make_model(4)
    record = Record()
    monitor = ExpertLoadMonitor(log_every_n_steps=2, plots=False)
    t = trainer(HeterMoEStrategy(mode="ep", cluster=cluster), world, max_steps=4, callbacks=[monitor, record])
    t.fit(model, datamodule=data(world))
    return {"steps": record.steps, "logged": monitor.busy_history}


@pytest.mark.slow
@pytest.mark.parametrize("emulate", [False, True], ids=["measured", "emulated"])
def test_busy_time_is_one_steps_work_split_by_kind(emulate):
    cluster = ({"name": "a40_v100", "devices": ["a40", "v100"], "emulate": True, "time_scale": 1.0}
               if emulate else None)
    results = run_ranks(2, fit_busy, 2, cluster)
    for rank, got in enumerate(results):
        assert len(got["steps"]) == 4
        for busy, step_s in got["steps"]:
            assert busy is not None and set(busy) == set(KINDS), busy
            # every kind of work happened, inside the step and not counted twice
            assert busy["attention"] > 0 and busy["experts"] > 0 and busy["comm"] > 0, busy
            work = busy["attention"] + busy["experts"] + busy["comm"]
            assert work <= step_s * 1.02, (rank, busy, step_s)
            assert busy["idle"] == pytest.approx(max(step_s - work, 0.0), abs=1e-9)
        # the monitor logs every 2nd step: one step's figures each time, gathered from every rank
        assert len(got["logged"]) == 2 and all(len(step) == 2 for step in got["logged"])
        for logged in got["logged"]:
            assert sum(logged[rank][k] for k in KINDS[:3]) <= max(s for _, s in got["steps"]) * 1.02


def test_meter_sums_spans_by_kind_and_clears(virtual_clock):
    clock = virtual_clock(meter_module)
    meter = BusyMeter("cpu")
    t0 = meter.now()
    clock.advance(0.02)
    seg = (t0, meter.now())
    clock.advance(0.01)
    meter.pad("attention", (0, "bwd"), meter.now(), 0.0, earlier=[seg])
    start = meter.now()
    clock.advance(0.01)
    meter.transfer_done((0, "fwd"), start, 0.0)
    got = meter.take()
    assert got["attention"] == pytest.approx(0.02)  # the segment, not the 10 ms gap after it
    assert got["transfer"] == pytest.approx(0.01) and got["experts"] == 0.0
    assert meter.take() == {"attention": 0.0, "head": 0.0, "experts": 0.0, "transfer": 0.0}


def test_the_meter_times_a_step_on_the_clock_of_its_task_spans(virtual_clock):
    """A step's time comes from the same stopwatch as the busy spans set against it (CUDA
    events on a GPU; perf_counter here): the spans fit inside it."""
    clock = virtual_clock(meter_module)
    meter = BusyMeter("cpu")
    start = meter.now()
    clock.advance(0.005)  # before the task: in the step, not in its span
    t0 = meter.now()
    clock.advance(0.02)
    meter.pad("experts", None, t0, 0.0)
    clock.advance(0.003)
    step = meter.elapsed_since(start)
    busy = meter.take()
    assert busy["experts"] == pytest.approx(0.02) and step == pytest.approx(0.028)


def fit_zebra_busy(rank: int, world: int):
    from helpers_zebra import make_test_plan

    model = make_model(4)
    record = Record()
    strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2))
    trainer(strategy, world, max_steps=3, callbacks=[record]).fit(model, datamodule=data(world))
    device_steps = strategy.clock.device_step_s()
    transfers = strategy.backend.last_step.transfers
    return {"steps": record.steps, "device_step": device_steps, "transfers": len(transfers),
            "spans": sum(e - s for _, s, e in transfers)}


@pytest.mark.slow
def test_zebra_measures_its_exchange_and_the_four_kinds_add_up_to_the_step():
    """Outside emulation zebra times every transfer (from its issue to its work's completion)
    and the step on the same clock as its tasks: the exchange the rank waited on is not zero,
    and attention + experts + comm + idle is the step (on the attention and the expert rank)."""
    results = run_ranks(2, fit_zebra_busy, 2)
    for rank, got in enumerate(results):
        assert len(got["steps"]) == 3
        # 2 layers x 2 micro-batches x (forward, backward) rounds: a dispatch and a combine each
        assert got["transfers"] == 2 * 2 * 2 * 2 and got["spans"] > 0, got
        for busy, _ in got["steps"]:
            assert busy is not None and set(busy) == set(KINDS), busy
            assert busy["attention" if rank == 0 else "experts"] > 0, (rank, busy)
        # a step whose every transfer had landed before its rank waited counts its wait idle
        # (seen once in a loaded CI run, on the attention rank): over the run, some is comm
        assert sum(busy["comm"] for busy, _ in got["steps"]) > 0, (rank, got["steps"])
        busy = got["steps"][-1][0]
        assert sum(busy.values()) == pytest.approx(got["device_step"], rel=1e-9), (rank, busy, got["device_step"])


def test_uncovered_is_the_union_of_spans_outside_the_covered_ones():
    from lightning_hetermoe.emulate.meter import uncovered

    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]  # union: [0, 3] and [5, 6], 4 s
    covered = [(0.5, 1.0), (2.5, 5.5), (7.0, 8.0)]  # covers 0.5 + 0.5 + 0.5 of it
    assert uncovered(spans, covered) == pytest.approx(2.5)
    assert uncovered(spans, []) == pytest.approx(4.0)
    assert uncovered([], covered) == 0.0
    # a naive reference on a grid of 1 ms
    grid = [t / 1000 for t in range(8000)]
    inside = lambda t, ss: any(a <= t < b for a, b in ss)  # noqa: E731
    assert uncovered(spans, covered) == pytest.approx(sum(inside(t, spans) and not inside(t, covered)
                                                          for t in grid) / 1000, abs=2e-3)
