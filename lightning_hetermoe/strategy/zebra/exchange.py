"""The bipartite exchange of one ZP group during one step, issued by the executor's one
thread, asynchronously, in the order the schedule gives (the same on every member).

Every round ``r`` of ``schedule.rounds`` (one expert round trip, in the order attention
ranks emit them) is three collectives on the ZP group:

1. **header** (host: gloo, the dispatch group's host side): an all-gather of every member's
   rows per expert (forward rounds; backward rounds reuse the forward's sizes) and, under
   emulation, the moment its rows left. Expert ranks post all headers when the step
   starts, since their share is empty and host traffic touches no device stream; attention
   ranks post theirs when the round is emitted. The header is the round's one host sync:
   the routing counts were copied to the host once, and every split size comes from here.
2. **dispatch** (device): an all-to-all of rows, attention ranks to the holders of the
   layer's experts. Rows travel by destination group rank, then by the destination's own
   expert order, in the compute dtype (the autocast dtype under mixed precision).
3. **combine** (device): an all-to-all of the answers, back in the order the rows came.

Issue order, on every member: ``dispatch(r)`` before ``combine(r)`` before
``dispatch(r + 1)``. An attention rank posts ``combine(r)``'s receive with the dispatch, so
the answer can land while it computes the next micro-batch (on CUDA the receive runs on
the communication stream; nothing waits on it until the answer is used); a holder issues
``combine(r)`` once its experts ran (holders on attention ranks run them right after the
emitting task, see :meth:`lightning_hetermoe.schedule.Schedule.member_tasks`, which keeps
this order). Nothing is waited for before it is needed; every handle is waited once.

Under emulation a transfer is padded at its receiver: it arrives at ``max(sent, link
free) + modelled`` (one transfer at a time per direction), ``sent`` being the header's
stamp (dispatch) or the moment the combine completed (every holder had sent).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from ... import comm
from ...comm import Pending
from ...schedule import Round, Schedule
from .layout import Layout, ZebraGroups
from .records import Dispatched


class Exchange:
    def __init__(self, layout: Layout, groups: ZebraGroups, schedule: Schedule, *, d_model: int,
                 device: torch.device, wire_dtype: torch.dtype, emulator: Any = None) -> None:
        self.lay, self.groups, self.schedule = layout, groups, schedule
        self.d, self.device, self.wire = d_model, device, wire_dtype
        self.emulator = emulator
        self.G, self.me, self.E = len(layout.group_ranks), layout.my_group_rank, layout.num_experts
        self._headers: dict[Round, Pending] = {}
        self._sizes: dict[tuple[int, int], tuple[Tensor, list[list[int]]]] = {}  # (layer, mb) -> counts, matrix
        self._my_splits: dict[tuple[int, int], list[int]] = {}  # (layer, mb) -> rows this rank sent per member
        self._dispatch: dict[Round, Pending] = {}
        self._combine: dict[Round, Pending] = {}
        self._sends: list[Pending] = []  # pure sends: waited once complete, or at the end
        self._balance: dict[Any, Pending] = {}
        self._link_free = {"dispatch": 0.0, "combine": 0.0}
        self.transfer_s: dict[tuple[str, Round], float] = {}

    # -- the step -------------------------------------------------------------------------
    def start(self) -> None:
        if not self.lay.is_attention:
            for r in self.schedule.rounds:
                self._post_header(r, None)

    def finish(self) -> None:
        """Wait for everything still in flight (the last sends), and book the transfers."""
        for pending in [*self._headers.values(), *self._dispatch.values(), *self._combine.values(), *self._sends,
                        *self._balance.values()]:
            pending.wait()
        if self.emulator is not None:
            for r in self.schedule.rounds:
                seconds = self._transfer_seconds(r)
                self.transfer_s[("dispatch", r)] = self.transfer_s[("combine", r)] = seconds
        self._dispatch.clear()
        self._combine.clear()
        self._sends.clear()

    def in_flight(self) -> list[Tensor]:
        """Tensors held by collectives not yet waited (for accounting a step's memory)."""
        out: list[Tensor] = []
        for p in [*self._dispatch.values(), *self._combine.values(), *self._sends]:
            out += [t for t in p.keep if isinstance(t, Tensor)]
        return out

    # -- attention ranks ------------------------------------------------------------------
    def emit(self, r: Round, rows: Tensor, expert_counts: Tensor | None) -> None:
        """Rows of round ``r`` leave (``expert_counts``: host, rows per expert id, forward rounds)."""
        key = (r.layer, r.mb)
        self._post_header(r, expert_counts)
        if r.phase == "fwd":
            holders = self.lay.by_group_rank(r.layer)
            self._my_splits[key] = [int(expert_counts[h].sum()) if h else 0 for h in holders]
        send = self._my_splits[key]
        holds = bool(self.lay.mine(r.layer))
        recv = self._column(r) if holds else [0] * self.G
        out = torch.empty((sum(recv), self.d), dtype=self.wire, device=self.device)
        wire = rows.to(self.wire).contiguous()
        with comm.issuing(after=[wire]):
            self._dispatch[r] = comm.all_to_all(self.groups.dispatch, out, wire, recv, send, what="zebra.rows",
                                                async_op=True)
        if not holds:
            self._post_combine(r, None)

    def answers(self, r: Round) -> Tensor:
        """The experts' answer to round ``r`` (waited here: the compute stream follows it)."""
        pending = self._combine.pop(r)
        got = pending.wait()
        sent = self._dispatch.pop(r, None)
        if sent is not None:
            sent.wait()  # complete: every holder received before it answered
        self._arrive("combine", r, pending.completed_at)
        return got

    def post_balance(self, key: Any, counts: Tensor) -> None:
        """Routing counts of one layer and balance group, summed over every attention rank (host)."""
        self._balance[key] = comm.host_all_reduce(self.groups.dense, counts.clone(), what="zebra.balance",
                                                  async_op=True)

    def balance(self, key: Any) -> Tensor:
        return self._balance.pop(key).wait()

    # -- holders of experts ---------------------------------------------------------------
    def rows(self, r: Round) -> Dispatched | Tensor:
        """What round ``r`` brings this holder (forward: :class:`Dispatched`; backward: the
        gradient of its answers)."""
        self._reap()
        if r not in self._dispatch:  # an expert rank issues its part when it reaches the round
            recv = self._column(r)
            out = torch.empty((sum(recv), self.d), dtype=self.wire, device=self.device)
            empty = torch.empty((0, self.d), dtype=self.wire, device=self.device)
            with comm.issuing():
                self._dispatch[r] = comm.all_to_all(self.groups.dispatch, out, empty, recv, [0] * self.G,
                                                    what="zebra.rows", async_op=True)
        got = self._dispatch.pop(r).wait()
        self._arrive("dispatch", r, self._sent_at(r))
        if r.phase == "bwd":
            return got
        counts, _ = self._round_sizes(r)
        mine = self.lay.mine(r.layer)
        return Dispatched(got, counts[:, mine])

    def reply(self, r: Round, answers: Tensor) -> None:
        """This holder's answers to round ``r`` leave."""
        self._post_combine(r, answers)
        if not self.lay.is_attention:
            self._sends.append(self._combine.pop(r))

    # -- pieces ---------------------------------------------------------------------------
    def _post_header(self, r: Round, expert_counts: Tensor | None) -> None:
        payload = torch.zeros(self.E + 1, dtype=torch.long, device="cpu")
        if expert_counts is not None:
            payload[: self.E] = expert_counts
        if self.emulator is not None and self.lay.is_attention:
            payload[self.E] = time.perf_counter_ns()  # when these rows left (one machine: one monotonic clock)
        parts = [torch.empty_like(payload) for _ in range(self.G)]
        self._headers[r] = comm.host_all_gather(self.groups.dispatch, parts, payload, what="zebra.header",
                                                async_op=True)

    def _header(self, r: Round) -> Tensor:
        """``[G, E + 1]``: every member's header of round ``r`` (host)."""
        return torch.stack(self._headers[r].wait())

    def _round_sizes(self, r: Round) -> tuple[Tensor, list[list[int]]]:
        """``(counts [G, E], matrix[s][d] rows from member s to member d)`` of the round's
        (layer, micro-batch); backward rounds move the same rows as the forward."""
        key = (r.layer, r.mb)
        if key not in self._sizes:
            counts = self._header(Round("fwd", r.layer, r.mb))[:, : self.E]
            holders = self.lay.by_group_rank(r.layer)
            matrix = [[int(counts[s, holders[d]].sum()) if holders[d] else 0 for d in range(self.G)]
                      for s in range(self.G)]
            self._sizes[key] = (counts, matrix)
        return self._sizes[key]

    def _column(self, r: Round) -> list[int]:
        """Rows this holder receives from each member in round ``r``."""
        _, matrix = self._round_sizes(r)
        return [matrix[s][self.me] for s in range(self.G)]

    def _post_combine(self, r: Round, answers: Tensor | None) -> None:
        send = self._column(r) if answers is not None else [0] * self.G
        recv = self._my_splits[(r.layer, r.mb)] if self.lay.is_attention else [0] * self.G
        out = torch.empty((sum(recv), self.d), dtype=self.wire, device=self.device)
        inp = answers.to(self.wire).contiguous() if answers is not None else \
            torch.empty((0, self.d), dtype=self.wire, device=self.device)
        with comm.issuing(after=[inp] if answers is not None else []):
            self._combine[r] = comm.all_to_all(self.groups.combine, out, inp, recv, send, what="zebra.answers",
                                               async_op=True, stamp=self.emulator is not None)

    def _reap(self) -> None:
        """Release sends that completed (their rows were held until now)."""
        while self._sends and self._sends[0].work.is_completed():
            self._sends.pop(0).wait()

    def _sent_at(self, r: Round) -> float:
        return float(self._header(r)[:, self.E].max()) / 1e9

    def _transfer_seconds(self, r: Round) -> float:
        """The busiest link of the round's matrix, on the emulated link."""
        _, rows = self._round_sizes(r)
        G = self.G
        off_sent = max(sum(rows[s]) - rows[s][s] for s in range(G))
        off_recv = max(sum(rows[s][d] for s in range(G)) - rows[d][d] for d in range(G))
        return self.emulator.transfer(max(off_sent, off_recv))

    def _arrive(self, channel: str, r: Round, sent_at: float | None) -> None:
        """Emulation: the rows of ``r`` arrive once the link carried them after they left."""
        if self.emulator is None:
            return
        seconds = self._transfer_seconds(r)
        arrival = max(sent_at or 0.0, self._link_free[channel]) + seconds
        self._link_free[channel] = arrival
        self.emulator.arrive("transfer", (channel, r), arrival, seconds)
