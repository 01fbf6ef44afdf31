"""Lightning's SIGTERM question, asked over the host side.

Lightning lets a job end cleanly on SIGTERM: the rank that got the signal broadcasts a 1 from
rank 0 in its signal handler (``_SignalConnector._sigterm_notifier_fn``), and before every
training batch every rank takes part in a broadcast from rank 0 and reads it with ``.item()``
(``_TrainingEpochLoop._broadcast_sigterm_tensor``): rank 0's handler broadcast meets the other
ranks' next per-batch one, and every rank raises ``SIGTERMException``.

Both broadcasts carry a device tensor on the default group. On a GPU the per-batch read waits
for everything queued on every rank's stream before it: an expert rank's optimizer step among
it. The ranks would meet at every step's start, and zebra's attention ranks could not begin
the next step while the expert ranks step their experts (``simulate.step.carries_tails``).
:func:`ask_on_the_host` sends both over a host group of their own (gloo, CPU tensors: no
device work is waited for, and no other traffic's order is met), keeping the protocol."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

import lightning_hetermoe.comm as comm

log = logging.getLogger(__name__)


def ask_on_the_host(trainer: Any, world_size: int) -> bool:
    """Replace ``trainer``'s two SIGTERM broadcasts with host ones (a collective: every rank
    calls it at the same point, before the first training batch). ``False`` where there is
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

    def from_rank_zero(flag: int) -> int:
        t = torch.tensor([flag], dtype=torch.int64, device="cpu")
        comm.host_broadcast(group, t, 0, what="lightning.sigterm")
        return int(t[0])

    def before_batch() -> None:
        if from_rank_zero(1 if connector.received_sigterm else 0) == 1:
            raise SIGTERMException()

    def notified(signum: int, frame: Any) -> None:
        log.info(f"rank {trainer.global_rank}: received SIGTERM: {signum}")
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        from_rank_zero(1)
        connector.received_sigterm = True

    loop._broadcast_sigterm_tensor = before_batch
    handlers.signal_handlers = [notified if h == notifier else h for h in handlers.signal_handlers]
    return True
