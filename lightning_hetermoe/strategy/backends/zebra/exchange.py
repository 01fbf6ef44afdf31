"""The bipartite exchange of one ZP group during one step, issued by the executor's one
thread, asynchronously, in the order the schedule gives (the same on every member).

Every round ``r`` of ``schedule.rounds`` (one expert round trip, in the order attention
ranks emit them) is up to three collectives on the ZP group:

1. **header** (host: gloo, the dispatch group's host side): an all-gather of every member's
   rows per expert and, under emulation, the moment its rows left. A backward round moves
   its forward's sizes: it has a header of its own only under emulation (for that moment),
   elsewhere one host collective less per backward round. Expert ranks post all headers when the step
   starts, since their share is empty and host traffic touches no device stream; attention
   ranks post theirs when the round is emitted. The header is the round's one host sync:
   the routing counts were copied to the host once, and every split size comes from here.
2. **dispatch** (device): an all-to-all of rows, attention ranks to the holders of the
   layer's experts. Rows travel by destination group rank, then by the destination's own
   expert order, in the compute dtype (the autocast dtype under mixed precision).
3. **combine** (device): an all-to-all of the answers, back in the order the rows came.

Issue order, on every member, over both communicators: :meth:`Schedule.issue_order
<lightning_hetermoe.task_order.Schedule.issue_order>`, every round, also where a member
holds no expert of the round's layer (its share is then empty; a collective skipped on one
member hangs the others, and two communicators issued in different orders can deadlock
where their kernels cannot run side by side). ``dispatch(r)`` before ``combine(r)``; where
``r`` is early (the attention ranks emit ``r + 1`` before they need ``r``'s answers, and
no attention rank holds experts of ``r``'s layer) ``dispatch(r + 1)`` comes before
``combine(r)``, else after it; in a layered schedule (every member attends) a layer's
combines come after the last dispatch of its run. An attention rank walks the order as it
issues: its dispatches as it emits, the combines of rounds it holds once its experts ran
(they are slotted where the order wants them, see
:meth:`lightning_hetermoe.task_order.Schedule.member_tasks`), and the combines of rounds it
holds nothing of at once after the collective before them, so the answer can land while it
computes (on CUDA the receive runs on the communication stream; nothing waits on it until
the answer is used). Where it holds experts of the round's layer itself, its dispatch needs
every member's header (its receive sizes): the dispatch and what follows it in the order
are held back until the header is in, issued between and during its next tasks
(:meth:`pump`), so a member late to emit the same round does not stall its attention. An
expert rank walks the order too: it issues ``dispatch(r)`` when it
reaches ``r``, and where ``r`` is early also ``dispatch(r + 1)`` (waiting for its header)
before ``r``'s experts are queued, so ``r + 1``'s rows move while they run: the
communication stream waits for the compute queued before each issue, and ``r``'s is not
queued yet. Nothing is waited for before it is needed; every handle is waited once.

Under emulation a transfer is padded at its receiver: it arrives at ``max(sent, link
free) + modelled`` (one transfer at a time per direction), ``sent`` being the moment the
sending task ends on the modelled clock, carried in the round's header (dispatch) or in a
combine header (a one-number host all-gather, emulation only), or later, the moment the
last member took part. On a GPU the communication stream waits for the compute stream at
every issue, so an expert rank's part of a round it issues after a task's reply starts
when that task's kernels end: under emulation it takes part after the task's padding (not
right after its reply), and stamps that moment in a ready header (dispatch) or its answer
header (a round it holds nothing of). Tasks issue their sends before their padding, as a GPU's host runs
ahead of its kernels.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import Tensor

import lightning_hetermoe.comm as comm
from ....comm import Pending
from ....emulate.meter import Stopwatch
from ....task_order import Round, Schedule
from .layout import Layout, ZebraGroups
from .records import Dispatched


PREFETCH_POLL_S = 50e-6  # how often an expert rank looks for the next round's header while it waits
PUMP_POLL_S = 200e-6  # how often an emulated attention rank looks for held-back headers while it pads


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
        self._answer_headers: dict[Round, Pending] = {}  # emulation: when each round's answers left
        self._ready: dict[Round, Pending] = {}  # emulation: when each member took part in a round's dispatch
        self._link_free = {"dispatch": 0.0, "combine": 0.0}
        self._seconds: dict[tuple[int, int], float] = {}  # modelled transfer of a (layer, mb)'s rows
        self._onehot: dict[int, Tensor] = {}  # layer -> [E, G] which group rank holds each expert
        self._member = [[False] * self.G for _ in range(layout.num_layers)]  # [layer][group rank] holds experts
        for l in range(layout.num_layers):
            for d, held in enumerate(layout.by_group_rank(l)):
                self._member[l][d] = bool(held)
        attending = [layout.group_rank(g) for g in layout.attention_members]
        holds = [any(self._member[l][d] for d in attending) for l in range(layout.num_layers)]
        # every member's order of the collectives over both communicators (see issue_order)
        self._order = schedule.issue_order(holds)
        self._early = schedule.early_rounds(holds)
        self._after = dict(zip(schedule.rounds, schedule.rounds[1:]))
        self._position = {event: i for i, event in enumerate(self._order)}
        self._cursor = 0  # the next collective of _order not yet issued here
        # attention ranks: collectives of the order not issued yet, each with the round whose
        # headers it waits for (see emit)
        self._held: list[tuple[Round | None, Callable[[], None], tuple[Tensor, ...]]] = []
        self.transfer_s: dict[tuple[str, Round], float] = {}
        # measured runs: each device transfer's span, from its issue (on the communication
        # stream) to its work's completion; read with the step's other stamps
        self.watch = Stopwatch(device) if emulator is None else None
        self.spans: list[tuple[tuple[str, Round], Any, Any]] = []

    # -- the step -------------------------------------------------------------------------
    def start(self) -> None:
        if not self.lay.is_attention:
            for r in self.schedule.rounds:
                if self._has_header(r):
                    self._post_header(r, None)
            self._issue(block=False)

    def finish(self) -> None:
        """Wait for everything still in flight (the last sends), and book the transfers."""
        self.pump(block=True)
        if not self.lay.is_attention:
            self._issue()  # the rounds after this rank's last one, now that its last task ended
        for pending in [*self._headers.values(), *self._dispatch.values(), *self._combine.values(), *self._sends,
                        *self._balance.values(), *self._answer_headers.values(), *self._ready.values()]:
            pending.wait()
        if self.watch is not None:
            self.watch.settle()  # a stamp taken next comes after every completion
        if self.emulator is not None:
            for r in self.schedule.rounds:
                seconds = self._transfer_seconds(r)
                self.transfer_s[("dispatch", r)] = self.transfer_s[("combine", r)] = seconds
        self._dispatch.clear()
        self._combine.clear()
        self._sends.clear()
        self._ready.clear()

    def in_flight(self) -> list[Tensor]:
        """Tensors held by collectives not yet waited (for accounting a step's memory)."""
        out: list[Tensor] = []
        for p in [*self._dispatch.values(), *self._combine.values(), *self._sends]:
            out += [t for t in p.keep if isinstance(t, Tensor)]
        return out + [t for _, _, keep in self._held for t in keep]

    # -- attention ranks ------------------------------------------------------------------
    def emit(self, r: Round, rows: Tensor, expert_counts: Tensor | None, leaves_at: float | None = None) -> None:
        """Rows of round ``r`` leave (``expert_counts``: host, rows per expert id, forward
        rounds; ``leaves_at``: under emulation, when they leave on the modelled clock).

        The header goes now. Where this rank holds experts of the round's layer (every
        member attends), the rows' all-to-all needs every member's header for its receive
        sizes: it is held back until they are in (:meth:`pump`), so the rank goes on to its
        next task instead of waiting for the slowest member to emit the same round."""
        key = (r.layer, r.mb)
        if self._has_header(r):
            self._post_header(r, expert_counts, leaves_at)
        if r.phase == "fwd":  # rows to each member: the counts of the experts it holds
            self._my_splits[key] = (expert_counts @ self._holder_of(r.layer)).tolist()
        wire = rows.to(self.wire).contiguous()
        holds = bool(self.lay.mine(r.layer))
        self._hold_back(Round("fwd", r.layer, r.mb) if holds else None,
                        lambda: self._send_rows(r, wire, holds, leaves_at), keep=(wire,))

    def _send_rows(self, r: Round, wire: Tensor, holds: bool, leaves_at: float | None) -> None:
        self._expect(("dispatch", r))
        send = self._my_splits[(r.layer, r.mb)]
        recv = self._column(r) if holds else [0] * self.G
        out = torch.empty((sum(recv), self.d), dtype=self.wire, device=self.device)
        with comm.issuing(after=[wire]):
            self._dispatch[r] = self._timed("dispatch", r, lambda: comm.all_to_all(
                self.groups.dispatch, out, wire, recv, send, what="zebra.rows", async_op=True))
        self._post_ready(r)
        self._took_part(leaves_at)

    def _hold_back(self, header: Round | None, issue: Callable[[], None], keep: tuple[Tensor, ...] = ()) -> None:
        """Attention ranks: issue the next collective of the order once ``header`` (a round
        whose every header it needs) is in, after those held back before it (``keep``: the
        tensors it will send, held meanwhile)."""
        self._held.append((header, issue, keep))
        self.pump()

    def pump(self, *, block: bool = False, until: Callable[[], bool] | None = None) -> bool:
        """Attention ranks: issue the collectives held back, in the order, as far as their
        headers are in (``block``: waiting for them, until ``until()`` holds, by default until
        none is held: a later round's header is not waited for where an earlier collective is
        all that is needed). Whether any is still held."""
        while self._held and not (block and until is not None and until()):
            header, issue, _ = self._held[0]
            if header is not None and not block and not self._sizes_header(header).completed:
                return True
            self._held.pop(0)
            issue()
        return bool(self._held)

    def pump_until(self, deadline: float) -> None:
        """Emulation: pump while a task's padding runs, until ``deadline`` (``perf_counter``)
        or nothing is held, as a GPU's host would issue while the device computes."""
        while self.pump() and time.perf_counter() < deadline:
            time.sleep(min(PUMP_POLL_S, max(deadline - time.perf_counter(), 0.0)))

    def answers(self, r: Round) -> Tensor:
        """The experts' answer to round ``r`` (waited here: the compute stream follows it)."""
        self.pump(block=True, until=lambda: r in self._combine)
        if r not in self._combine:
            raise RuntimeError(f"zebra exchange: the answers of {r} are needed before its combine was issued; "
                               f"the schedule's issue order is broken (Schedule.early_rounds)")
        got = self._combine.pop(r).wait()
        sent = self._dispatch.pop(r, None)
        if sent is not None:
            sent.wait()  # complete: every holder received before it answered
        if self.emulator is not None:
            stamps = self._answer_headers.pop(r).wait()
            self._arrive("combine", r, max(int(t) for t in stamps) / 1e9)
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
        self.pump(block=True, until=lambda: r in self._dispatch)
        early = not self.lay.is_attention and r in self._early
        if not self.lay.is_attention:
            self._issue(("dispatch", r))  # an expert rank takes part in a round when it reaches it
        if early and self.emulator is None:
            self._prefetch(r, lambda: self._dispatch[r].completed and comm.compute_idle())
        got = self._dispatch.pop(r).wait()
        # emulated: the rows are in at their modelled arrival; the next header is looked for until then
        before = (lambda at: self._prefetch(r, lambda: time.perf_counter() >= at)) if early else None
        self._arrive("dispatch", r, self._sent_at(r) if self.emulator is not None else None, before=before)
        if r.phase == "bwd":
            return got
        counts, _ = self._round_sizes(r)
        mine = self.lay.mine(r.layer)
        return Dispatched(got, counts[:, mine])

    def reply(self, r: Round, answers: Tensor, leaves_at: float | None = None) -> None:
        """This holder's answers to round ``r`` leave (``leaves_at``: on the modelled clock)."""
        if self.lay.is_attention:
            self._hold_back(None, lambda: self._answer(r, answers, leaves_at), keep=(answers,))
            return
        self._issue(("combine", r), inclusive=False, at=leaves_at)
        self._post_combine(r, answers, leaves_at)
        self._send_only(r)
        self._cursor += 1
        if self.emulator is None:
            self._issue(block=False)  # the next receives whose headers are in
        # under emulation a GPU's communication stream would wait for this task's kernels
        # before the next round's receive: that is the end of the task's padding, so the
        # next rounds are taken part in when this rank reaches them (rows, finish)

    def _answer(self, r: Round, answers: Tensor, leaves_at: float | None) -> None:
        self._expect(("combine", r))
        self._post_combine(r, answers, leaves_at)
        self._took_part(leaves_at)

    def _expect(self, event: tuple[str, Round]) -> None:
        """Attention ranks: ``event`` must be the next collective of the order, checked before
        anything of it is issued (a collective out of order would hang the other members)."""
        due = self._order[self._cursor] if self._cursor < len(self._order) else "the end of the order"
        if due != event:
            raise RuntimeError(f"zebra exchange: {event[0]} of {event[1]} about to be issued where the order has "
                               f"{due}; the schedule's issue order is broken")

    def _took_part(self, leaves_at: float | None) -> None:
        """Attention ranks: the collective :meth:`_expect` checked was just issued here; the
        combines after it of rounds this rank holds nothing of follow at once (their receive
        needs no work of its own), up to the next one it must issue itself."""
        self._cursor += 1
        while self._cursor < len(self._order):
            kind, r = self._order[self._cursor]
            if kind == "dispatch" or self._member[r.layer][self.me]:
                return
            self._post_combine(r, None, leaves_at)
            self._cursor += 1

    def _prefetch(self, r: Round, ready_to_run: Callable[[], bool]) -> None:
        """An expert rank about to run early round ``r``: issue the next round's receive
        before ``r``'s experts are queued (its rows then move while they run) if its header
        comes in before ``r`` could start anyway (``ready_to_run``: its rows are in and the
        device has nothing else queued); else :meth:`reply` issues it, after ``r``'s experts."""
        nxt = ("dispatch", self._after[r])
        header = self._sizes_header(nxt[1])
        while not header.completed and not ready_to_run():
            time.sleep(PREFETCH_POLL_S)
        if header.completed:
            self._issue(nxt)

    def _issue(self, stop: tuple[str, Round] | None = None, *, inclusive: bool = True, block: bool = True,
               at: float | None = None) -> None:
        """Expert ranks: issue the next collectives of the order, up to ``stop`` (``None``:
        to the end; ``inclusive``: ``stop`` too), waiting for headers; ``block=False``: only
        those that need no wait (a dispatch whose header is in, a combine of a round this
        rank holds nothing of), stopping at the first that does. A combine of a round this
        rank holds is issued by :meth:`reply` alone. ``at``: when they are issued, on the
        modelled clock (default: now)."""
        end = len(self._order) if stop is None else self._position[stop] + (1 if inclusive else 0)
        while self._cursor < end:
            kind, r = self._order[self._cursor]
            held = self._member[r.layer][self.me]
            if kind == "combine" and held:
                if block:
                    raise RuntimeError(f"zebra exchange: {stop or 'the step end'} comes after the combine of {r}, "
                                       f"which this rank holds and has not answered; the issue order is broken")
                return
            if not block and kind == "dispatch" and not self._sizes_header(r).completed:
                return
            if kind == "dispatch":
                self._post_receive(r, at)
                if not held:  # an empty share: nothing to wait for
                    self._sends.append(self._dispatch.pop(r))
            else:
                self._post_combine(r, None, at)
                self._send_only(r)
            self._cursor += 1

    def _send_only(self, r: Round) -> None:
        """An expert rank's part of ``combine(r)`` (and its stamp) only sends: waited once done."""
        self._sends.append(self._combine.pop(r))
        if r in self._answer_headers:
            self._sends.append(self._answer_headers.pop(r))

    def _post_receive(self, r: Round, at: float | None = None) -> None:
        recv = self._column(r) if self._member[r.layer][self.me] else [0] * self.G
        out = torch.empty((sum(recv), self.d), dtype=self.wire, device=self.device)
        empty = torch.empty((0, self.d), dtype=self.wire, device=self.device)
        with comm.issuing():
            self._dispatch[r] = self._timed("dispatch", r, lambda: comm.all_to_all(
                self.groups.dispatch, out, empty, recv, [0] * self.G, what="zebra.rows", async_op=True))
        self._post_ready(r, at)

    def _post_ready(self, r: Round, at: float | None = None) -> None:
        """Emulation: when this member took part in ``r``'s dispatch (an expert rank's moment,
        ``at`` or now; an attention rank's is its header's). On the combine group's host
        side, in the order of :meth:`Schedule.issue_order` on every member."""
        if self.emulator is None:
            return
        ns = 0 if self.lay.is_attention else int((at if at is not None else time.perf_counter()) * 1e9)
        stamp = torch.tensor([ns], dtype=torch.long, device="cpu")
        parts = [torch.empty_like(stamp) for _ in range(self.G)]
        self._ready[r] = comm.host_all_gather(self.groups.combine, parts, stamp, what="zebra.ready", async_op=True)

    # -- pieces ---------------------------------------------------------------------------
    def _post_header(self, r: Round, expert_counts: Tensor | None, leaves_at: float | None = None) -> None:
        payload = torch.zeros(self.E + 1, dtype=torch.long, device="cpu")
        if expert_counts is not None:
            payload[: self.E] = expert_counts
        if self.emulator is not None and self.lay.is_attention:
            # when these rows leave (one machine: one monotonic clock for every process)
            payload[self.E] = int((leaves_at if leaves_at is not None else time.perf_counter()) * 1e9)
        parts = [torch.empty_like(payload) for _ in range(self.G)]
        self._headers[r] = comm.host_all_gather(self.groups.dispatch, parts, payload, what="zebra.header",
                                                async_op=True)

    def _has_header(self, r: Round) -> bool:
        """Whether round ``r`` has a header of its own: every forward round (its sizes); a
        backward round moves its forward's sizes, so only under emulation (the moment its
        rows left). Alike on every member: a host collective skipped on one would hang the rest."""
        return r.phase == "fwd" or self.emulator is not None

    def _sizes_header(self, r: Round) -> Pending:
        """The header whose arrival gives round ``r``'s sizes: its own, or its forward's."""
        return self._headers[r if self._has_header(r) else Round("fwd", r.layer, r.mb)]

    def _header(self, r: Round) -> Tensor:
        """``[G, E + 1]``: every member's header of round ``r`` (host)."""
        return torch.stack(self._headers[r].wait())

    def _round_sizes(self, r: Round) -> tuple[Tensor, list[list[int]]]:
        """``(counts [G, E], matrix[s][d] rows from member s to member d)`` of the round's
        (layer, micro-batch); backward rounds move the same rows as the forward."""
        key = (r.layer, r.mb)
        if key not in self._sizes:
            counts = self._header(Round("fwd", r.layer, r.mb))[:, : self.E]
            self._sizes[key] = (counts, (counts @ self._holder_of(r.layer)).tolist())
        return self._sizes[key]

    def _holder_of(self, layer: int) -> Tensor:
        """``[E, G]`` one-hot: which group rank holds each expert of ``layer`` (built once a
        step: every round of the layer asks)."""
        onehot = self._onehot.get(layer)
        if onehot is None:
            onehot = torch.zeros(self.E, self.G, dtype=torch.long, device="cpu")
            for d, held in enumerate(self.lay.by_group_rank(layer)):
                onehot[held, d] = 1
            self._onehot[layer] = onehot
        return onehot

    def _column(self, r: Round) -> list[int]:
        """Rows this holder receives from each member in round ``r``."""
        _, matrix = self._round_sizes(r)
        return [matrix[s][self.me] for s in range(self.G)]

    def _post_combine(self, r: Round, answers: Tensor | None, leaves_at: float | None) -> None:
        send = self._column(r) if answers is not None else [0] * self.G
        recv = self._my_splits[(r.layer, r.mb)] if self.lay.is_attention else [0] * self.G
        out = torch.empty((sum(recv), self.d), dtype=self.wire, device=self.device)
        inp = answers.to(self.wire).contiguous() if answers is not None else \
            torch.empty((0, self.d), dtype=self.wire, device=self.device)
        if self.emulator is not None:
            # a holder's answers leave at leaves_at; another member takes part at leaves_at
            # (the task that issues it ends), or an expert rank now (its last task ended:
            # see reply), which can be what the round waits for
            at = leaves_at if leaves_at else None if self.lay.is_attention else time.perf_counter()
            stamp = torch.tensor([int(at * 1e9) if at else 0], dtype=torch.long, device="cpu")
            parts = [torch.empty_like(stamp) for _ in range(self.G)]
            self._answer_headers[r] = comm.host_all_gather(self.groups.combine, parts, stamp,
                                                           what="zebra.answer_header", async_op=True)
        with comm.issuing(after=[inp] if answers is not None else []):
            self._combine[r] = self._timed("combine", r, lambda: comm.all_to_all(
                self.groups.combine, out, inp, recv, send, what="zebra.answers", async_op=True))

    def _timed(self, channel: str, r: Round, issue: Callable[[], Pending]) -> Pending:
        """Issue a transfer (inside ``comm.issuing``: on CUDA its start stamp is on the
        communication stream, after what it waits for) and stamp its work's completion."""
        if self.watch is None:
            return issue()
        start = self.watch.now()
        pending = issue()
        self.spans.append(((channel, r), start, self.watch.completion(pending.work)))
        return pending

    def _reap(self) -> None:
        """Release sends that completed (their rows were held until now)."""
        while self._sends and self._sends[0].work.is_completed():
            self._sends.pop(0).wait()

    def _sent_at(self, r: Round) -> float:
        """When round ``r``'s dispatch could start: its rows left and every member took part."""
        at = float(self._header(r)[:, self.E].max())
        ready = self._ready.pop(r, None)
        if ready is not None:
            at = max(at, float(max(int(t) for t in ready.wait())))
        return at / 1e9

    def _transfer_seconds(self, r: Round) -> float:
        """The busiest link of the round's matrix, on the emulated link (a round's backward
        moves the same rows as its forward)."""
        key = (r.layer, r.mb)
        if key not in self._seconds:
            _, rows = self._round_sizes(r)
            self._seconds[key] = self.emulator.round_seconds(rows, self.lay.every_group_ranks())
        return self._seconds[key]

    def _arrive(self, channel: str, r: Round, sent_at: float | None,
                before: Callable[[float], None] | None = None) -> None:
        """Emulation: the rows of ``r`` arrive once the link carried them after they left
        (``before``: called with that moment, on the modelled clock, before waiting for it)."""
        if self.emulator is None:
            return
        seconds = self._transfer_seconds(r)
        arrival = max(sent_at or 0.0, self._link_free[channel]) + seconds
        self._link_free[channel] = arrival
        if before is not None:
            before(arrival)
        self.emulator.arrive("transfer", (channel, r), arrival, seconds)
