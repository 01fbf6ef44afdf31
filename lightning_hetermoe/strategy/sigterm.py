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
every rank before the same batch."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

import lightning_hetermoe.comm as comm

log = logging.getLogger(__name__)


def ask_on_the_host(trainer: Any, world_size: int) -> bool:
    """Replace ``trainer``'s two SIGTERM broadcasts with a note in the handler and a host
    all-reduce before every batch (a collective: every rank calls it at the same point, before
    the first training batch). ``False`` where there is
    nothing to replace on some rank: one process, or a Lightning without the per-batch
    question or the composed SIGTERM handler (a handler of the user's own in its place, say):
    then every rank keeps Lightning's own, as one rank asking on the host while another
    asked on the device would wait for each other forever. The ranks agree with one host
    all-reduce."""
    if world_size < 2:
        return False
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    connector = getattr(trainer, "_signal_connector", None)
    handlers = signal.getsignal(signal.SIGTERM)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    here = (callable(getattr(loop, "_broadcast_sigterm_tensor", None)) and notifier is not None
            and notifier in getattr(handlers, "signal_handlers", ()))
    votes = torch.tensor([int(here)], dtype=torch.int64, device="cpu")
    comm.host_all_reduce(comm.world(), votes, what="lightning.sigterm.agree")
    if int(votes[0]) != world_size:
        return False
    group = comm.new_group("sigterm", range(world_size), device=False, host=True)

    # This rank's SIGTERM, noted apart from Lightning's ``received_sigterm``: Lightning reads that
    # flag on each rank alone too (at the end of every batch and epoch, in validation) and stops
    # there, while a rank the signal reached a moment later went on into the next batch's
    # all-reduce and waited for it. Set once every rank agreed, it stops them all at one point.
    noted = [False]

    def before_batch() -> None:
        if noted[0]:
            log.info(f"rank {trainer.global_rank}: received SIGTERM")
        heard = torch.tensor([int(noted[0])], dtype=torch.int64, device="cpu")
        comm.host_all_reduce(group, heard, what="lightning.sigterm")
        if int(heard[0]) > 0:
            connector.received_sigterm = True
            raise SIGTERMException()

    # No logging here: the signal can land while this thread is inside a write to the same
    # stream a log handler flushes (the job's train.log), and a buffered writer entered again
    # raises "reentrant call" (logging prints it as a traceback: CI, 2026-12-07). The note is
    # logged at the next batch's question instead.
    def notified(signum: int, frame: Any) -> None:
        if not noted[0]:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        noted[0] = True

    loop._broadcast_sigterm_tensor = before_batch
    handlers.signal_handlers = [notified if h == notifier else h for h in handlers.signal_handlers]
    return True
