"""Python's garbage collector during training: between steps, on every rank at once.

CPython collects whenever container allocations outrun frees, wherever the program is.
Inside a step that is a stall on one rank, which every other rank then waits for in its
next collective: the youngest generation takes well under a millisecond, but the oldest
walks every object the process holds, about 450,000 once torch, Lightning and
transformers are imported (0.7 s on one core of a 2-core CI machine, measured in the
main job's attention rank at step 41). On many ranks each one's collection lands in a
different step, so the job waits for every one of them in turn.

So while it trains, the strategy turns automatic collection off and collects every
``every_n_steps`` optimizer steps, before the step's first batch, on every rank at the
same step. What is alive after the first of them (the imported libraries, the model, the
optimizer and its state) is frozen (``gc.freeze``): later collections walk only what
training made since. Megatron-LM's manual GC and torchtitan's ``gc_freq`` do the same. A
run shorter than ``every_n_steps`` collects nothing while it trains.

Garbage waits for the next collection: a training step that leaves reference cycles
holding tensors holds them for up to ``every_n_steps`` steps. Where the device's memory can
be read without a host sync (CUDA's allocator counts), a collection that frees more than a
share of it (``WARN_FREED_SHARE``) says so, once, naming the setting.

Validation inside ``fit`` runs with automatic collection on, as before: it may run many
batches and has no optimizer step to collect at. When training ends, or fails, the
process gets its collector back: automatic collection as it was, and the frozen objects
unfrozen where nothing was frozen before (a process that trains again, a sweep, can then
free the old trainer and model; an earlier ``gc.freeze`` of the caller's own is left as
it is). A process forked while collection is off (a DataLoader worker) collects
automatically.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Callable

log = logging.getLogger(__name__)

# A collection that frees this share of the device's memory is worth a word: the steps leave
# reference cycles that hold tensors.
WARN_FREED_SHARE = 0.01

_off_here = False  # a schedule in this process turned automatic collection off


def _collect_in_forked_child() -> None:
    global _off_here
    if _off_here:
        _off_here = False
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_collect_in_forked_child)


class CollectBetweenSteps:
    """``every_n_steps``: optimizer steps between collections; ``None`` leaves Python's
    collector alone."""

    def __init__(self, every_n_steps: int | None) -> None:
        self.every_n_steps = every_n_steps
        self.active = False
        self.collections = 0  # between steps, this fit
        self._was_enabled = True
        self._unfreeze = False
        self._frozen = False
        self._last_step: int | None = None
        self._device_bytes: Callable[[], int] | None = None
        self._warn_bytes = float("inf")
        self._where = ""

    def start(self, device_bytes: Callable[[], int] | None = None, device_total: int | None = None,
              where: str = "") -> None:
        """When training starts. ``device_bytes``: the device memory tensors hold now (read
        without a host sync), of ``device_total``; ``where``: this rank, for messages."""
        if self.every_n_steps is None or self.active:
            return
        self.active, self._frozen = True, False
        self.collections, self._last_step = 0, None
        self._was_enabled = gc.isenabled()
        self._unfreeze = False  # decided when this schedule freezes (before_batch)
        self._device_bytes, self._where = device_bytes, where
        self._warn_bytes = WARN_FREED_SHARE * device_total if device_bytes is not None and device_total else float("inf")
        self._turn_off()

    def before_batch(self, global_step: int) -> None:
        """Before a training batch: collect where ``global_step`` is due (once per optimizer
        step, whatever the batches it accumulates)."""
        if not self.active or global_step == self._last_step:
            return
        self._last_step = global_step
        if global_step > 0 and global_step % self.every_n_steps == 0:
            self._collect(global_step)
            if not self._frozen:
                # Counted here rather than at start: the count walks every frozen object
                # (40 ms a call where a fork server froze its imports, at every fit's start),
                # where beside a full collection it costs nothing.
                self._unfreeze = gc.get_freeze_count() == 0
                gc.freeze()
                self._frozen = True

    def pause(self) -> None:
        """Automatic collection on (validation inside ``fit``)."""
        if self.active:
            self._turn_on()

    def resume(self) -> None:
        if self.active:
            self._turn_off()

    def stop(self) -> None:
        """The process's collector as it was before :meth:`start`."""
        if not self.active:
            return
        self.active = False
        self._device_bytes = None  # a closure: the strategy may be pickled again (spawn)
        self._turn_on()
        if not self._was_enabled:
            gc.disable()
        if self._unfreeze and self._frozen:
            gc.unfreeze()

    def _collect(self, step: int) -> None:
        held = self._device_bytes() if self._device_bytes is not None else 0
        gc.collect()
        self.collections += 1
        freed = held - self._device_bytes() if self._device_bytes is not None else 0
        if freed >= self._warn_bytes:
            log.warning(f"[hetermoe] {self._where}: the garbage collection before step {step} freed "
                        f"{freed / 1e9:.2f} GB of device memory: the training steps leave reference cycles that hold "
                        f"tensors, kept until the next collection (strategy gc_every_n_steps={self.every_n_steps}). "
                        f"Break the cycles, or collect more often (a lower gc_every_n_steps, or null: Python's own "
                        f"collector)")
            self._warn_bytes = float("inf")  # once

    @staticmethod
    def _turn_off() -> None:
        global _off_here
        gc.disable()
        _off_here = True

    @staticmethod
    def _turn_on() -> None:
        global _off_here
        _off_here = False
        gc.enable()
