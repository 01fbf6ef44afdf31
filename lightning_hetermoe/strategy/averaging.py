"""Lightning's weight averaging (``WeightAveraging``, ``EMAWeightAveraging``) over laid-out ranks.

The callback keeps an ``AveragedModel``: a copy of the module whose tensors it averages
with the module's, element by element, after each step, swaps in for validation and copies
into the module at the end of the fit. Element by element, each rank averaging the share it
holds is what one process does with the whole. What stands in the way, and how this module
mends it:

- the callback copies the module in its ``setup``, before the strategy lays it out (each
  rank keeps its experts; under zebra only the attention ranks keep the dense weights): the
  copy is taken again from the laid-out module (:func:`follow_layout`), in every stage;
- at the end of a stage the strategy makes the module whole again, and the average with it
  (:func:`made_whole`), so that a checkpoint saved after ``fit`` holds the whole average;
  experts moved mid-run (the rebalancer) carry their average with them (:func:`averages`,
  then :func:`load_average`);
- its checkpoint puts the average in ``state_dict`` and the trained weights in
  ``current_model_state``, both as this rank holds them, where the strategy's checkpoints
  keep every tensor whole (a full file) or as placement-free pieces (a sharded directory):
  the strategy converts both on the way out and the way in (:func:`saved_with_average`).

Everything goes through the callback's public hooks (``setup``, ``on_save_checkpoint``,
``on_load_checkpoint``), none through its private state.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

import lightning_hetermoe.comm as comm
from ..model_contract import moe_layers


def averagers(callbacks: list) -> list:
    """The trainer's weight-averaging callbacks (``EMAWeightAveraging`` is one)."""
    from lightning.pytorch.callbacks import WeightAveraging

    return [c for c in callbacks if isinstance(c, WeightAveraging)]


def averages_on(callbacks: list, device: torch.device) -> int:
    """How many weight-averaging callbacks will keep their average on ``device``'s kind:
    what the planner prices before the strategy lays the module out (a callback builds its
    average on its ``device`` argument, else on the module's device, which is the strategy's
    once laid out)."""
    count = 0
    for callback in averagers(callbacks):
        # the callback's device argument has no public reader: one it does not state is on the device
        where = getattr(callback, "_device", None)
        if where is None:
            count += 1
        elif isinstance(where, int):  # an index: the accelerator's
            count += device.type != "cpu"
        else:
            count += torch.device(where).type == device.type
    return count


def follow_layout(trainer: Any, module: Any, cut: Callable[[dict], dict]) -> None:
    """Each averaging callback's average laid out as the module now is (after the backend's
    set-up, in every stage: a validation after the fit swaps it in too). The average it held
    (whole: from the callback's set-up before the layout, or from the end of an earlier fit)
    is cut to this rank's part (``cut``: a whole state dict -> this rank's part) and loaded
    into a copy taken again from the laid-out module (:func:`load_average`). A model built
    on the meta device is materialised by now, too."""
    for callback, average, state in averages(trainer, module):
        load_average(trainer, module, callback, cut(average), state)


def averages(trainer: Any, module: Any) -> list[tuple[Any, dict, Any]]:
    """``(callback, its average, its averaging state)`` of each averaging callback that holds
    an average (it builds one in a fit's set-up), through its checkpoint hook: the average
    as a state dict laid out as its copy is, its tensors the copy's own."""
    out = []
    for callback in averagers(trainer.callbacks):
        checkpoint: dict[str, Any] = {"state_dict": {}}
        with _quiet():  # (without an average the hook says so, at info level)
            callback.on_save_checkpoint(trainer, module, checkpoint)
        if saved_with_average(checkpoint):
            out.append((callback, checkpoint["state_dict"], checkpoint["averaging_state"]))
    return out


def average_bytes(trainer: Any, module: Any, device: torch.device) -> int:
    """Bytes of the averages the callbacks keep on ``device``'s kind (one kept in host
    memory, ``WeightAveraging(device="cpu")`` beside a GPU, costs the GPU nothing)."""
    return sum(t.numel() * t.element_size() for _, average, _ in averages(trainer, module)
               for t in average.values() if t.device.type == device.type)


def load_average(trainer: Any, module: Any, callback: Any, average: dict, state: Any) -> None:
    """The callback's copy taken again from ``module`` as it is laid out now, with
    ``average`` (laid out alike) and ``state`` loaded into it, through the callback's own
    ``setup`` and ``on_load_checkpoint``: what it saves is what it loads. (The module's own
    weights go back into it: the hook loads both.)"""
    with exchanges_left_out(module), _quiet():
        callback.setup(trainer, module, "fit")
        callback.on_load_checkpoint(trainer, module, {"state_dict": average, "averaging_state": state,
                                                      "current_model_state": module.state_dict()})


def made_whole(trainer: Any, module: Any, gather: Callable[[dict], dict], writer: int | None,
               experts: set[str]) -> Callable[[], None]:
    """At the end of a stage, before the backend gathers the module back whole: each
    averaging callback's average with its experts gathered whole (``gather``: a state dict
    laid out as the module is -> every expert tensor whole; collectives, in the callbacks'
    order on every rank). The returned step, run once the module is whole, broadcasts the
    average's other tensors from ``writer`` (a rank that holds every dense tensor: under
    zebra and distep the others hold none; ``None`` where every rank averaged them alike, as
    under ep and datacentric: nothing to send) and loads the whole average into the callback's
    copy, taken again from the whole module: a checkpoint saved after the run (its
    ``state_dict`` is the average) holds the whole model on any rank, as one process's does.
    ``experts``: the state dict names of the expert tensors."""
    saved = [(callback, gather(average), state) for callback, average, state in averages(trainer, module)]

    def load() -> None:
        for callback, average, state in saved:
            if writer is not None:
                for name, t in module.state_dict().items():
                    if name not in experts:
                        # sent on the compute device, kept where the average keeps its tensors
                        held = average[name]
                        dense = held.to(t.device) if held.shape == t.shape else torch.empty_like(t)
                        comm.broadcast(comm.world(), dense, writer, what="averaging.dense")
                        average[name] = dense.to(held.device)
            load_average(trainer, module, callback, average, state)

    return load


@contextmanager
def _quiet() -> Iterator[None]:
    # the callback's load announces a resume ("Found current_model_state in the checkpoint"):
    # here nothing is resumed
    before = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(before)


@contextmanager
def exchanges_left_out(module: Any) -> Iterator[None]:
    """Each MoE layer with the parts a parallel backend swaps in (its dispatcher, balance
    and padding test, which hold the backend, its threads and the job's communicators) put
    back to a single process's while a copy is taken: the copy is of the tensors the
    callback averages, and a copy of the backend would be a second one, or fail on a lock."""
    from ..moe import LocalDispatcher
    from ..moe.balance import LocalBalance
    from ..moe.layer import every_token_real

    layers = [layer for _, layer in moe_layers(module)]
    swapped = [(layer.dispatcher, layer.balance, layer.real_tokens) for layer in layers]
    try:
        for layer in layers:
            layer.dispatcher, layer.balance, layer.real_tokens = LocalDispatcher(), LocalBalance(), every_token_real
        yield
    finally:
        for layer, parts in zip(layers, swapped, strict=True):
            layer.dispatcher, layer.balance, layer.real_tokens = parts


def saved_with_average(checkpoint: dict[str, Any]) -> bool:
    """Whether ``checkpoint`` was written through a weight-averaging callback (its
    ``on_save_checkpoint`` moved the trained weights aside and put the average in their place)."""
    return "current_model_state" in checkpoint and "averaging_state" in checkpoint
