"""Lightning's SIGTERM question, asked over the host side, by every rank.

Lightning lets a job end cleanly on SIGTERM: the rank that got the signal broadcasts a 1 from
rank 0 in its signal handler (``_SignalConnector._sigterm_notifier_fn``), and before every
training batch every rank takes part in a broadcast from rank 0 and reads it with ``.item()``
(``_TrainingEpochLoop._broadcast_sigterm_tensor``): rank 0's handler broadcast meets the other
ranks' next per-batch one, and every rank raises ``SIGTERMException``.

Both broadcasts carry a device tensor on the default group. On a GPU the per-batch read waits
for everything queued on every rank's stream before it: an expert rank's optimizer step among
it. The ranks would meet at every step's start, and zebra's attention ranks could not begin
the next step while the expert ranks step their experts (``simulate.step.carries_tails``).
:func:`ask_on_the_host` asks over a host group of its own (gloo, CPU tensors: no device work
is waited for, and no other traffic's order is met).

And it asks without a collective in the signal handler. A preemption signals every rank of
the job at about the same moment; a handler's broadcast then paired with whichever broadcast
the other rank was at, its handler's or its next batch's: where they differed, one rank
stopped a broadcast before the other, which waited on it, and the job ended 35 s later by the
heartbeat's verdict (3 of 7 group SIGTERMs on the main job, 2026-12-06); a SIGTERM that
reached a child rank alone was never heard. And Lightning also stops a rank at the end of a
batch where its own handler set ``received_sigterm``, whatever the others do: the rank the
signal reached a moment later waited for it in the next batch's question. Here a handler only
notes the signal (and, on the launcher, passes it to its children, as Lightning's does), and
before every batch every rank adds its note to one all-reduce; ``received_sigterm`` is set
where the ranks agree: one collective per batch on every rank, and any rank's SIGTERM stops
every rank before the same batch.

The handler is made quiet as soon as Lightning installs it (:func:`quiet_handler`, wrapped
around the connector's ``register_signal_handlers`` at the strategy's set-up, before it
runs), not at the first training batch: Lightning installs it before the sanity check and
the training's start hooks, whose collectives a handler's broadcast met (a SIGTERM there left
the main job waiting in a host all-gather, 2026-12-07). A signal noted before the question
is asked stops every rank before the first batch."""

from __future__ import annotations

import logging
import signal
import weakref
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

import lightning_hetermoe.comm as comm

log = logging.getLogger(__name__)


class _Note:
    """One rank's SIGTERM, as its quiet handler noted it, and Lightning's handler it stands
    in for (put back where the ranks keep Lightning's question)."""

    def __init__(self, lightnings: Any) -> None:
        self.heard = False
        self.lightnings = lightnings


_notes: "weakref.WeakKeyDictionary[Any, _Note]" = weakref.WeakKeyDictionary()


def quiet_handler(trainer: Any, world_size: int) -> None:
    """Make ``trainer``'s SIGTERM handler quiet each time Lightning installs it (every
    fit, validate, test or predict call): the handler notes the signal and passes it to the
    child ranks, with no collective and no log line (see the module's docstring). No
    collective here; every rank calls it at set-up, before Lightning installs the handler.
    A Lightning without the composed handler or the notifier is left as it is."""
    connector = getattr(trainer, "_signal_connector", None)
    register = getattr(connector, "register_signal_handlers", None)
    if world_size < 2 or register is None or getattr(register, "made_quiet", False):
        return

    def register_quietly() -> None:
        register()
        handlers = signal.getsignal(signal.SIGTERM)
        notifier = getattr(connector, "_sigterm_notifier_fn", None)
        if notifier is None or notifier not in getattr(handlers, "signal_handlers", ()):
            _notes.pop(connector, None)
            return
        note = _notes[connector] = _Note(notifier)

        # No logging here: the signal can land while this thread is inside a write to the
        # same stream a log handler flushes (the job's train.log), and a buffered writer
        # entered again raises "reentrant call" (logging prints it as a traceback: CI,
        # 2026-12-07). The note is logged at the next batch's question instead.
        def notified(signum: int, frame: Any) -> None:
            if not note.heard:
                launcher = trainer.strategy.launcher
                if launcher is not None:
                    launcher.kill(signum)
            note.heard = True

        notified.quiet = True
        handlers.signal_handlers = [notified if h == notifier else h for h in handlers.signal_handlers]

    register_quietly.made_quiet = True
    connector.register_signal_handlers = register_quietly


def ask_on_the_host(trainer: Any, world_size: int) -> bool:
    """Replace ``trainer``'s per-batch SIGTERM broadcast with a host all-reduce of the quiet
    handlers' notes before every batch (a collective: every rank calls it at the same point,
    before the first training batch). ``False`` where there is nothing to replace on some
    rank: one process, or a Lightning without the per-batch question, or a handler other
    than the quiet one (a handler of the user's own in its place, say): then every rank
    keeps Lightning's question and handler (put back, a signal noted so far set as its
    handler would have set it), as one rank asking on the host while another asked on the
    device would wait for each other forever. The ranks agree with one host all-reduce."""
    if world_size < 2:
        return False
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    connector = getattr(trainer, "_signal_connector", None)
    note = _notes.get(connector) if connector is not None else None
    handlers = signal.getsignal(signal.SIGTERM)
    here = (callable(getattr(loop, "_broadcast_sigterm_tensor", None)) and note is not None
            and any(getattr(h, "quiet", False) for h in getattr(handlers, "signal_handlers", ())))
    votes = torch.tensor([int(here)], dtype=torch.int64, device="cpu")
    comm.host_all_reduce(comm.world(), votes, what="lightning.sigterm.agree")
    if int(votes[0]) != world_size:
        if note is not None and hasattr(handlers, "signal_handlers"):
            handlers.signal_handlers = [note.lightnings if getattr(h, "quiet", False) else h
                                        for h in handlers.signal_handlers]
            if note.heard:
                connector.received_sigterm = True
        return False
    group = _group(world_size)  # (once: every batch asks over it)
    loop._broadcast_sigterm_tensor = lambda: _stop_if_heard(trainer, group)
    return True


def before_evaluation_batch(trainer: Any, world_size: int) -> None:
    """The same question before every validation, test and predict batch (inside a fit too):
    where any rank's quiet handler heard SIGTERM, every rank stops before this batch with
    Lightning's ``SIGTERMException``, and the job ends as a preempted fit does. Lightning's
    own check there reads each rank's flag alone, after its batch (and predict has none):
    with the quiet handler, an evaluation went on to its end, however long, while the
    scheduler's grace ran out; with Lightning's, the rank the signal reached stopped and its
    peers waited for it in the next batch's collectives. A collective: every rank runs every
    evaluation batch (the strategy checks that their counts agree)."""
    if world_size > 1:
        _stop_if_heard(trainer, _group(world_size))


def _group(world_size: int) -> comm.Group:
    """The ranks' own host group for the question (built by its first asking, on every rank
    at once): no other traffic's order is met."""
    return comm.new_group("sigterm", range(world_size), device=False, host=True)


def _stop_if_heard(trainer: Any, group: comm.Group) -> None:
    """One host all-reduce of this rank's note over ``group`` (:func:`_group`); where any rank heard SIGTERM, ``received_sigterm`` is set and
    ``SIGTERMException`` raised on every rank here. The note, apart from Lightning's
    ``received_sigterm``: Lightning reads that flag on each rank alone too (at the end of
    every batch and epoch, in validation) and stops there, while a rank the signal reached a
    moment later went on into the next batch's all-reduce and waited for it. Set once every
    rank agreed, it stops them all at one point."""
    connector = trainer._signal_connector
    note = _notes.get(connector)
    heard_here = note is not None and note.heard
    if heard_here:
        log.info(f"rank {trainer.global_rank}: received SIGTERM")
    heard = torch.tensor([int(heard_here)], dtype=torch.int64, device="cpu")
    comm.host_all_reduce(group, heard, what="lightning.sigterm")
    if int(heard[0]) > 0:
        connector.received_sigterm = True
        raise SIGTERMException()
