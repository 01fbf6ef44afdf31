"""The bipartite exchange of one ZP group: a dispatch channel (attention -> experts) and a
combine channel (experts -> attention), each its own process group and its own thread, so
both directions are in flight at once; plus the balance-count channel over all attention
ranks.

Every member serves the schedule's rounds in the same order with one
``all_to_all_single`` per round and channel (uneven splits; a member with nothing to send
or receive still takes part). The forward dispatch first all-gathers each attention
rank's rows per expert, so every member knows the whole round: how many rows go from
whom to whom (the same matrix sizes all four legs of the round trip) and, under
emulation, how long the busiest link is busy.

Rows travel in a fixed layout: by destination group rank, then by the destination's own
expert order; the answers come back in the order the rows were sent.

The executor ``post``s what it sends and ``get``s what arrived; waiting never blocks
forever on a dead peer: a failed collective ends the channel, and every waiter raises
:class:`ChannelError` naming the channel and the round.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ...schedule import Round, Schedule
from .layout import Layout, ZebraGroups


class ChannelError(RuntimeError):
    """A collective of the zebra exchange failed (usually: a peer rank died)."""


@dataclass
class Dispatched:
    """What a holder receives on the forward dispatch of a round."""

    rows: Tensor  # [n, d] by source group rank, then by this rank's expert order
    counts: Tensor  # [G, my experts] rows per (source, local expert)


class _Slot:
    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None


class Mailboxes:
    """Hand-over points between the executor and the channel threads, keyed by anything."""

    def __init__(self) -> None:
        self._slots: dict[Any, _Slot] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def _slot(self, key: Any) -> _Slot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            return slot

    def put(self, key: Any, value: Any) -> None:
        slot = self._slot(key)
        slot.value = value
        slot.event.set()

    def take(self, key: Any, timeout_s: float, what: str) -> Any:
        slot = self._slot(key)
        deadline = time.monotonic() + timeout_s
        while not slot.event.wait(0.05):
            if self.error is not None:
                raise ChannelError(f"{what}: {self.error}") from self.error
            if time.monotonic() > deadline:
                raise ChannelError(f"{what}: nothing arrived in {timeout_s:.0f} s")
        if self.error is not None and slot.value is None:
            raise ChannelError(f"{what}: {self.error}") from self.error
        with self._lock:
            self._slots.pop(key, None)
        return slot.value

    def fail(self, err: BaseException) -> None:
        if self.error is None:
            self.error = err
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            slot.event.set()


class Exchange:
    """The channels of one step (threads live for one step)."""

    def __init__(self, layout: Layout, groups: ZebraGroups, schedule: Schedule, *, d_model: int,
                 dtype: torch.dtype, device: torch.device, emulator: Any = None, timeout_s: float = 1800.0) -> None:
        self.layout, self.groups, self.schedule = layout, groups, schedule
        self.d, self.dtype, self.device = d_model, dtype, device
        self.emulator = emulator
        self.timeout_s = timeout_s
        self.box = Mailboxes()
        self._matrices: dict[tuple[int, int], tuple[Tensor, list[list[int]]]] = {}
        self._matrix_ready: dict[tuple[int, int], threading.Event] = {}
        self._lock = threading.Lock()
        self.transfer_s: dict[tuple[str, Round], float] = {}
        self._threads: list[threading.Thread] = []

    # -- executor side ------------------------------------------------------------------
    def start(self) -> None:
        jobs = [("dispatch", self._serve_dispatch), ("combine", self._serve_combine)]
        if self.layout.is_attention and self.schedule.balance_groups:
            jobs.append(("balance", self._serve_balance))
        for name, fn in jobs:
            t = threading.Thread(target=self._guard, args=(name, fn), daemon=True, name=f"hetermoe-{name}")
            t.start()
            self._threads.append(t)

    def post(self, channel: str, key: Any, value: Any) -> None:
        self.box.put(("post", channel, key), value)

    def get(self, channel: str, key: Any) -> Any:
        return self.box.take(("got", channel, key), self.timeout_s, f"zebra {channel} channel, {key}")

    def join(self) -> None:
        for t in self._threads:
            while t.is_alive():
                t.join(0.05)
                if self.box.error is not None:
                    raise ChannelError(f"zebra exchange failed: {self.box.error}") from self.box.error
        if self.box.error is not None:
            raise ChannelError(f"zebra exchange failed: {self.box.error}") from self.box.error

    def abort(self, err: BaseException) -> None:
        self.box.fail(err)

    # -- channel threads ----------------------------------------------------------------
    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as err:  # a dead peer, most often: every waiter must hear of it
            self.box.fail(RuntimeError(f"the {name} channel of rank {self.layout.rank} "
                                       f"({self.layout.role}) failed: {err}"))

    def _await_post(self, channel: str, key: Any) -> Any:
        return self.box.take(("post", channel, key), self.timeout_s, f"zebra {channel} channel waiting for {key}")

    def _matrix(self, layer: int, mb: int) -> tuple[Tensor, list[list[int]]]:
        with self._lock:
            ev = self._matrix_ready.setdefault((layer, mb), threading.Event())
        deadline = time.monotonic() + self.timeout_s
        while not ev.wait(0.05):
            if self.box.error is not None:
                raise RuntimeError(str(self.box.error))
            if time.monotonic() > deadline:
                raise RuntimeError(f"round ({layer}, {mb}) never dispatched")
        return self._matrices[(layer, mb)]

    def _exchange(self, group, rows: Tensor, send: list[int], recv: list[int]) -> Tensor:
        out = torch.empty((sum(recv), self.d), dtype=self.dtype, device=self.device)
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    def _pad(self, channel: str, r: Round) -> None:
        """Emulation: once the exchange returned (every peer has joined: the moment the
        modelled transfer starts), the busiest link's modelled time passes."""
        if self.emulator is None:
            return
        _, rows = self._matrix(r.layer, r.mb)
        G = len(rows)
        off_sent = max(sum(rows[s]) - rows[s][s] for s in range(G))
        off_recv = max(sum(rows[s][d] for s in range(G)) - rows[d][d] for d in range(G))
        seconds = self.emulator.transfer(max(off_sent, off_recv))
        self.transfer_s[(channel, r)] = seconds
        self.emulator.sleep_for("transfer", channel, seconds)

    def _serve_dispatch(self) -> None:
        lay, group = self.layout, self.groups.dispatch
        me, G, E = lay.my_group_rank, len(lay.group_ranks), lay.num_experts
        for r in self.schedule.rounds:
            post = self._await_post("dispatch", r) if lay.is_attention else None
            rows = post["rows"] if post is not None else torch.empty(0, self.d, dtype=self.dtype, device=self.device)
            if r.phase == "fwd":
                local = post["expert_counts"] if post is not None else torch.zeros(E, dtype=torch.long)
                parts = [torch.empty_like(local) for _ in range(G)]
                dist.all_gather(parts, local.contiguous(), group=group)
                counts = torch.stack(parts)  # [G, E]
                holders = lay.by_group_rank(r.layer)
                matrix = [[int(counts[s, holders[d]].sum()) if holders[d] else 0 for d in range(G)] for s in range(G)]
                with self._lock:
                    self._matrices[(r.layer, r.mb)] = (counts, matrix)
                    self._matrix_ready.setdefault((r.layer, r.mb), threading.Event()).set()
            counts, matrix = self._matrix(r.layer, r.mb)
            out = self._exchange(group, rows.to(self.dtype), matrix[me], [matrix[s][me] for s in range(G)])
            self._pad("dispatch", r)
            if r.phase == "fwd":
                mine = lay.mine(r.layer)
                out = Dispatched(out, counts[:, mine] if mine else torch.zeros(G, 0, dtype=torch.long))
            self.box.put(("got", "dispatch", r), out)

    def _serve_combine(self) -> None:
        lay, group = self.layout, self.groups.combine
        me, G = lay.my_group_rank, len(lay.group_ranks)
        for r in self.schedule.rounds:
            counts, matrix = self._matrix(r.layer, r.mb)
            holding = bool(lay.mine(r.layer))
            post = self._await_post("combine", r) if holding else None
            rows = post if post is not None else torch.empty(0, self.d, dtype=self.dtype, device=self.device)
            out = self._exchange(group, rows.to(self.dtype), [matrix[s][me] for s in range(G)], matrix[me])
            self._pad("combine", r)
            self.box.put(("got", "combine", r), out)

    def _serve_balance(self) -> None:
        for key in self.schedule.count_rounds():
            counts = self._await_post("balance", key).clone()
            dist.all_reduce(counts, group=self.groups.dense)
            self.box.put(("got", "balance", key), counts)
