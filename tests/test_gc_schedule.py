"""Python's garbage collector while the strategy trains: no collection inside a step, one
every ``gc_every_n_steps`` steps on every rank at the same boundary, the collector given
back as it was when training ends or fails, and automatic in a process forked meanwhile."""

from __future__ import annotations

import gc
import os

import lightning as L
import pytest

from harness import run_ranks
from helpers_zebra import make_test_plan
from lightning_hetermoe import HeterMoEStrategy
from lightning_hetermoe.configs import ConfigError
from lightning_hetermoe.strategy.gc_schedule import CollectBetweenSteps
from reference import data, make_model, trainer


@pytest.fixture
def fresh_collector():
    """A collector as a fresh process has it (on, nothing frozen), and put back after."""
    was = gc.isenabled()
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


class FullCollections:
    """Counts the collections of every generation while installed."""

    def __init__(self) -> None:
        self.generations: list[int] = []

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "stop":
            self.generations.append(info["generation"])

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def test_collection_is_off_from_the_start_the_first_due_step_collects_and_freezes_and_stop_puts_all_back(
        fresh_collector):
    schedule = CollectBetweenSteps(every_n_steps=3)
    with FullCollections() as seen:
        schedule.start()
        schedule.before_batch(0)
        assert not gc.isenabled() and seen.generations == [] and gc.get_freeze_count() == 0
        schedule.before_batch(3)
    assert seen.generations == [2] and schedule.collections == 1
    assert not gc.isenabled() and gc.get_freeze_count() > 1000
    schedule.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_run_shorter_than_the_interval_collects_nothing_and_freezes_nothing(fresh_collector):
    schedule = CollectBetweenSteps(every_n_steps=50)
    with FullCollections() as seen:
        schedule.start()
        for step in range(49):
            schedule.before_batch(step)
        schedule.stop()
    assert seen.generations == [] and gc.get_freeze_count() == 0 and gc.isenabled()


class DeviceMemory:
    """A device's allocated bytes, as CUDA's allocator counts them."""

    def __init__(self) -> None:
        self.allocated = 10 * 2**30


class HeldInACycle:
    """A tensor's memory on that device, held by a reference cycle."""

    def __init__(self, memory: DeviceMemory, nbytes: int) -> None:
        self.memory, self.nbytes, self.me = memory, nbytes, self
        memory.allocated += nbytes

    def __del__(self) -> None:
        self.memory.allocated -= self.nbytes


def test_a_collection_that_frees_device_memory_says_so_once_naming_the_setting(fresh_collector, caplog):
    memory = DeviceMemory()
    schedule = CollectBetweenSteps(every_n_steps=2)
    schedule.start(lambda: memory.allocated, 80 * 2**30, "rank 1 (attention rank, device h100)")
    for step in range(7):
        with caplog.at_level("WARNING", logger="lightning_hetermoe.strategy.gc_schedule"):
            schedule.before_batch(step)
        HeldInACycle(memory, 2**30 if step < 4 else 2**20)  # the step's cycles: 1 GB each, then 1 MB
    schedule.stop()
    said = [r.getMessage() for r in caplog.records]
    # 2 GB freed before step 2 (over 1% of 80 GB): said; 2 GB again before step 4: said once only
    assert len(said) == 1 and said[0].startswith("[hetermoe] rank 1 (attention rank, device h100): the garbage "
                                                 "collection before step 2 freed 2.15 GB of device memory"), said
    assert "gc_every_n_steps=2" in said[0]
    quiet = CollectBetweenSteps(every_n_steps=2)  # 1 MB a step is nobody's concern
    quiet.start(lambda: memory.allocated, 80 * 2**30, "rank 1")
    with caplog.at_level("WARNING", logger="lightning_hetermoe.strategy.gc_schedule"):
        for step in range(5):
            quiet.before_batch(step)
            HeldInACycle(memory, 2**20)
    quiet.stop()
    assert len(caplog.records) == 1


def test_a_freeze_of_the_callers_own_stays_and_a_collector_it_turned_off_stays_off(fresh_collector):
    gc.freeze()
    frozen = gc.get_freeze_count()
    gc.disable()
    schedule = CollectBetweenSteps(every_n_steps=3)
    schedule.start()
    schedule.pause()  # validation inside fit: automatic collection on
    assert gc.isenabled()
    schedule.resume()
    assert not gc.isenabled()
    schedule.stop()
    # A frozen object may still die by its reference count meanwhile (the test runner's own
    # threads free some: the count fell by 2 once under load); an unfreeze would leave none.
    assert not gc.isenabled() and gc.get_freeze_count() > frozen // 2, (gc.get_freeze_count(), frozen)


def test_collects_once_at_each_due_step_whatever_the_batches_it_accumulates(fresh_collector):
    schedule = CollectBetweenSteps(every_n_steps=2)
    schedule.start()
    with FullCollections() as seen:
        for step in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5):  # two batches per optimizer step
            schedule.before_batch(step)
            due = len(seen.generations)
            assert due == (step // 2 if step < 5 else 2), step
    schedule.stop()
    assert seen.generations == [2, 2] and schedule.collections == 2


def test_none_leaves_pythons_collector_alone(fresh_collector):
    schedule = CollectBetweenSteps(every_n_steps=None)
    schedule.start()
    schedule.before_batch(50)
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not schedule.active


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "50"])
def test_a_bad_interval_is_refused_naming_the_field(value):
    with pytest.raises(ConfigError, match=rf"gc_every_n_steps={value!r} is invalid: must be an integer >= 1"):
        HeterMoEStrategy(gc_every_n_steps=value)


@pytest.mark.slow
def test_a_process_forked_while_collection_is_off_collects_automatically(fresh_collector):
    schedule = CollectBetweenSteps(every_n_steps=2)
    schedule.start()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say
        os.write(write, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.close(write)
    child = os.read(read, 1)
    os.waitpid(pid, 0)
    os.close(read)
    assert not gc.isenabled()
    schedule.stop()
    assert child == b"1"


class WhereCollections(L.Callback):
    """Each collection with the optimizer step it ran before or in, and whether it ran
    inside a step: from the module's first ``training_step`` of a batch to the batch's end
    (the strategy's own hook before the batch runs after the callbacks', so the window opens
    in the module's hook)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, bool]] = []  # (generation, global step, inside a step)
        self.in_step = self.validating = False
        self.step = -1

    def setup(self, trainer, pl_module, stage: str) -> None:
        gc.callbacks.append(self._seen)
        module = self

        def training_step(*args, **kwargs):
            module.in_step = True
            return type(pl_module).training_step(pl_module, *args, **kwargs)

        pl_module.training_step = training_step

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "stop" and not self.validating:
            self.events.append((info["generation"], self.step, self.in_step))

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validating = True  # Python's own collector runs there

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validating = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.in_step = False

    def teardown(self, trainer, pl_module, stage: str) -> None:
        gc.callbacks.remove(self._seen)


class PackGarbage(L.Callback):
    """The types of the pack's own objects left as cyclic garbage while training: objects
    a collection, not their last reference, frees."""

    def __init__(self) -> None:
        self.types: set[str] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what every collection finds stays in gc.garbage

    def on_train_end(self, trainer, pl_module) -> None:
        gc.collect()
        gc.set_debug(0)
        self.types = {type(o).__qualname__ for o in gc.garbage
                      if (getattr(type(o), "__module__", None) or "").startswith("lightning_hetermoe")}
        gc.garbage.clear()


def zebra_fit_collections(rank: int, world: int, every: int | None) -> dict:
    gc.unfreeze()  # as a fresh process: nothing frozen (the harness's fork server froze its imports)
    where, garbage = WhereCollections(), PackGarbage()
    strategy = HeterMoEStrategy(mode="zebra", plan=make_test_plan(world, [0], R=2), gc_every_n_steps=every)
    callbacks = [where] if every is not None else [where, garbage]
    t = trainer(strategy, world, max_steps=7, callbacks=callbacks, limit_val_batches=2, val_check_interval=3)
    t.fit(make_model(4, seed=rank), datamodule=data(world))
    return {"events": where.events, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
            "collections": strategy.gc.collections, "garbage": garbage.types}


@pytest.mark.slow
def test_under_zebra_no_rank_collects_inside_a_step_and_every_rank_collects_at_the_same_steps():
    per_rank = run_ranks(2, zebra_fit_collections, 2, 3)
    for rank, got in enumerate(per_rank):
        inside = [e for e in got["events"] if e[2]]
        assert not inside, (rank, inside)
        # before steps 3 and 6 (set-up's are Python's, before training starts)
        full_between = [step for generation, step, inside in got["events"] if generation == 2 and step >= 0]
        assert full_between == [3, 6], (rank, got["events"])
        assert got["collections"] == 2
        # the collector is the process's again, as it was before the fit
        assert got["enabled"] and got["frozen"] == 0, rank
    # the control: Python's own collector, left alone, collects inside the attention rank's steps
    control = run_ranks(2, zebra_fit_collections, 2, None)
    assert any(inside for _, _, inside in control[0]["events"]), control[0]["events"]
    # and what it finds there is not the executor's: a step's fibers and their run are freed
    # when the step ends (they held each other: about 1,500 objects a step on an attention rank)
    assert [got["garbage"] for got in control] == [set(), set()]


def failing_fit(rank: int, world: int) -> dict:
    gc.unfreeze()
    model = make_model(4, seed=rank)
    steps = []

    def training_step(batch, batch_idx):
        steps.append(gc.isenabled())
        if len(steps) == 3:
            raise RuntimeError("a step failed")
        return type(model).training_step(model, batch, batch_idx)

    model.training_step = training_step
    t = trainer(HeterMoEStrategy(mode="ep", gc_every_n_steps=2), world, max_steps=6)
    try:
        t.fit(model, datamodule=data(world))
    except RuntimeError as err:
        return {"error": str(err), "enabled_in_steps": steps, "enabled": gc.isenabled(),
                "frozen": gc.get_freeze_count()}
    return {"error": None}


@pytest.mark.slow
def test_a_failed_fit_gives_the_collector_back():
    for got in run_ranks(2, failing_fit, 2):
        assert got["error"] == "a step failed" and got["enabled_in_steps"] == [False] * 3, got
        assert got["enabled"] and got["frozen"] == 0, got
