"""The order of work in one step of a disaggregated (zebra or DistEP) schedule.

One definition, two users: the executor follows these lists on real processes, and the
simulator builds its task graph from the very same lists, so the two cannot drift apart.

Tasks of a ZP group, for layer ``l`` and micro-batch ``j`` (``L`` layers, ``R`` micro-batches):

* ``attn_fwd (l, j)`` on attention ranks: the block's work up to its experts (for ``l > 0``
  it first combines the experts' answer of ``(l-1, j)``); it hands tokens to the experts.
* ``expert_fwd (l, j)`` on each rank that holds experts of layer ``l``.
* ``head (j)``: combine of the last layer, LM head, loss, and the backward down to the last
  layer's experts.
* ``expert_bwd (l, j)``, then ``attn_bwd (l, j)``: the rest of the block's backward, which
  also sends the gradient of layer ``l-1``'s expert outputs.

Each expert round trip ``(phase, l, j)`` crosses the dispatch channel (attention to
experts) and comes back on the combine channel; a *round* is one such trip. Rounds are
served on both channels in one global order, the order in which attention ranks emit them.

**Zebra (Theorem 1).** Attention ranks: forward layer by layer, micro-batches ``1..R``
inside each layer; at the last layer each micro-batch's forward runs straight into its
backward (``head``); then the backward goes down the layers, micro-batches ``1..R`` inside
each layer. Expert ranks serve rounds in the order their inputs arrive, which is the
round order. While the experts work on micro-batch ``j`` the attention ranks compute
``j+1``: ``R`` micro-batches hide one round trip per layer.

**DistEP.** The same roles, one micro-batch at a time: forward up, backward down, next.

**Forward only** (validation, test, predict): zebra's forward and the head's forward.

Experts that Asym-EA puts on an attention rank run inside that rank's list, right after
the attention task that emits their round: the rank answers round ``r`` before it emits
round ``r + 1``, so every member of the ZP group issues the exchange's collectives in
one order (dispatch ``r``, combine ``r``, dispatch ``r + 1``, ...), which NCCL asks of
communicators used side by side.

**Layered** (:func:`answers_layered`: every member of the ZP group attends, the EP layout
with zebra's overlap). Each rank holds experts beside its attention, so answering round
``r`` before emitting ``r + 1`` would leave it idle through every dispatch of its own. A
run of rounds (one phase and layer, emitted one after another: a layer's micro-batches)
is answered back to back after its last emission, before the first attention task that
waits for an answer; every member issues the run's dispatches, then its combines
(:meth:`Schedule.combine_points`). DistEP's runs are single rounds: its order is unchanged.

**Balance counts.** The load-balancing loss takes its expert fractions over every token
computed together (see :mod:`lightning_hetermoe.moe.balance`): for zebra all micro-batches
of a step, for DistEP (gradient accumulation) one micro-batch. A layer's counts are summed
over the attention ranks once all their micro-batches of that group have routed; the
combine of that layer waits for them. With ``balance=False`` (no balance loss) there is no
such wait.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Sequence

KINDS = ("attn_fwd", "head", "attn_bwd", "expert_fwd", "expert_bwd")
SCHEDULE_KINDS = ("zebra", "distep", "forward")


@dataclass(frozen=True, order=True)
class Task:
    kind: str
    layer: int
    mb: int

    def __str__(self) -> str:
        short = {"attn_fwd": "Af", "head": "H", "attn_bwd": "Ab", "expert_fwd": "Xf", "expert_bwd": "Xb"}[self.kind]
        return f"H.{self.mb}" if self.kind == "head" else f"{short}{self.layer}.{self.mb}"


@dataclass(frozen=True, order=True)
class Round:
    """One expert round trip: ``phase`` "fwd" (tokens out, answers back) or "bwd" (gradient of
    the answers out, gradient of the tokens back)."""

    phase: str
    layer: int
    mb: int

    @functools.cached_property
    def expert_task(self) -> Task:
        # cached: a simulation asks each round's for every lane
        return Task("expert_fwd" if self.phase == "fwd" else "expert_bwd", self.layer, self.mb)


def emitted_round(task: Task, num_layers: int) -> Round | None:
    """The round an attention task hands to the experts when it ends."""
    if task.kind == "attn_fwd":
        return Round("fwd", task.layer, task.mb)
    if task.kind == "head":
        return Round("bwd", num_layers - 1, task.mb)
    if task.kind == "attn_bwd" and task.layer > 0:
        return Round("bwd", task.layer - 1, task.mb)
    return None


def awaited_round(task: Task, num_layers: int) -> Round | None:
    """The round whose answer an attention task needs before it can start."""
    if task.kind == "attn_fwd" and task.layer > 0:
        return Round("fwd", task.layer - 1, task.mb)
    if task.kind == "head":
        return Round("fwd", num_layers - 1, task.mb)
    if task.kind == "attn_bwd":
        return Round("bwd", task.layer, task.mb)
    return None


@dataclass
class Schedule:
    kind: str
    num_layers: int
    num_microbatches: int
    attention: list[Task] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    # micro-batch groups whose routing counts are summed for the balance loss (empty: none)
    balance_groups: list[tuple[int, ...]] = field(default_factory=list)
    # holders answer a run of rounds back to back (see build_schedule): for ZP groups whose
    # every member attends
    layered: bool = False
    # member_tasks per (has_attention, holds), and the issue order per attention holdings: a
    # planner's search asks for the same few thousands of times
    _members: dict = field(default_factory=dict, repr=False, compare=False)

    def balance_group(self, mb: int) -> int | None:
        for g, mbs in enumerate(self.balance_groups):
            if mb in mbs:
                return g
        return None

    def count_rounds(self) -> list[tuple[int, int]]:
        """``(layer, balance group)`` in the order the attention ranks finish routing them:
        the order of the counts all-reduce on the dense channel."""
        where = {t: i for i, t in enumerate(self.attention)}
        keys = [(max(where[Task("attn_fwd", l, j)] for j in mbs), l, g)
                for g, mbs in enumerate(self.balance_groups) for l in range(self.num_layers)]
        return [(l, g) for _, l, g in sorted(keys)]

    def early_rounds(self, attention_holds: Sequence[bool]) -> frozenset[Round]:
        """Rounds ``q`` whose successor's dispatch every member issues before ``combine(q)``:
        the attention ranks emit the successor before they need ``q``'s answers, and no
        attention rank holds experts of ``q``'s layer (it answers ``q`` before it emits the
        next round). An expert rank can then receive the successor's rows while it computes
        ``q`` and still issue the collectives of both communicators in one order with every
        other member (``attention_holds[l]``: some attention rank holds experts of layer ``l``)."""
        key = ("early", tuple(bool(h) for h in attention_holds))
        if key not in self._members:
            emitter, first_need = self._emission()
            self._members[key] = frozenset(
                q for q, nxt in zip(self.rounds, self.rounds[1:])
                if not key[1][q.layer] and emitter[nxt] < first_need.get(q, len(self.attention)))
        return self._members[key]

    def combine_points(self, attention_holds: Sequence[bool]) -> list[int]:
        """Per round (in round order), the index of the attention task before which its
        combine is issued, and a holder on an attention rank runs its experts: right after
        the emitting task, or after the next round's emitter where the round is early
        (:meth:`early_rounds`). ``layered``: after the last emitter of its run (the rounds of
        one phase and layer emitted one after another), before the first attention task after
        it that waits for an answer."""
        key = ("points", tuple(bool(h) for h in attention_holds))
        if key not in self._members:
            emitter, first_need = self._emission()
            end = len(self.attention)
            if self.layered:
                needs = [i for i, t in enumerate(self.attention) if awaited_round(t, self.num_layers) is not None]
                last = [emitter[r] for r in self.rounds]
                for k in reversed(range(len(self.rounds) - 1)):
                    r, nxt = self.rounds[k], self.rounds[k + 1]
                    if (r.phase, r.layer) == (nxt.phase, nxt.layer):
                        last[k] = last[k + 1]
                after = [bisect.bisect_right(needs, at) for at in last]  # the first need past each
                points = [min(needs[j] if j < len(needs) else end, first_need.get(r, end))
                          for r, j in zip(self.rounds, after)]
            else:
                early = self.early_rounds(attention_holds)
                after = dict(zip(self.rounds, self.rounds[1:]))
                points = [emitter[after[r] if r in early else r] + 1 for r in self.rounds]
            self._members[key] = points
        return self._members[key]

    def issue_order(self, attention_holds: Sequence[bool]) -> list[tuple[str, Round]]:
        """Every member's order of the exchange's collectives over both communicators:
        ``("dispatch", r)`` in round order as the attention ranks emit them, ``("combine", q)``
        where its point comes (:meth:`combine_points`)."""
        key = ("order", tuple(bool(h) for h in attention_holds))
        if key not in self._members:
            emitter, _ = self._emission()
            points = self.combine_points(attention_holds)
            events = [((emitter[r], 0, k), ("dispatch", r)) for k, r in enumerate(self.rounds)]
            events += [((p - 1, 1, k), ("combine", r)) for k, (r, p) in enumerate(zip(self.rounds, points))]
            self._members[key] = [e for _, e in sorted(events, key=lambda x: x[0])]
        return list(self._members[key])

    def _emission(self) -> tuple[dict[Round, int], dict[Round, int]]:
        """Per round, the index in ``attention`` of the task that emits it and of the first
        task that needs its answers."""
        if "emission" not in self._members:
            emitter = {emitted_round(t, self.num_layers): i for i, t in enumerate(self.attention)}
            first_need: dict[Round, int] = {}
            for i, t in enumerate(self.attention):
                need = awaited_round(t, self.num_layers)
                if need is not None:
                    first_need.setdefault(need, i)
            self._members["emission"] = (emitter, first_need)
        return self._members["emission"]

    def member_tasks(self, has_attention: bool, holds: Sequence[bool]) -> list[Task]:
        """The task list of one ZP member: ``holds[l]`` says whether it holds experts of layer ``l``."""
        if len(holds) != self.num_layers:
            raise ValueError(f"holds has {len(holds)} layers, the schedule {self.num_layers}")
        key = (bool(has_attention), tuple(bool(h) for h in holds))
        if key not in self._members:
            self._members[key] = self._member_tasks(*key)
        return list(self._members[key])

    def _member_tasks(self, has_attention: bool, holds: Sequence[bool]) -> list[Task]:
        mine = [r for r in self.rounds if holds[r.layer]]
        if not has_attention:
            return [r.expert_task for r in mine]
        attn = self.attention
        point = dict(zip(self.rounds, self.combine_points(holds)))
        # slot[i]: expert tasks that run just before attention task i (len(attn): after all)
        slots: dict[int, list[Task]] = {}
        last = -1
        for r in mine:
            at = point[r]
            at = max(at, last)  # keep round order on this rank
            last = at
            slots.setdefault(at, []).append(r.expert_task)
        out: list[Task] = []
        for i, t in enumerate(attn):
            out += slots.get(i, [])
            out.append(t)
        out += slots.get(len(attn), [])
        return out


def build_schedule(kind: str, num_layers: int, num_microbatches: int, *, balance: bool = True,
                   layered: bool = False) -> Schedule:
    """The schedule of one step; ``balance`` when the model has a load-balancing loss;
    ``layered`` (see :func:`answers_layered`): holders answer each run of rounds back to back."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"schedule kind {kind!r} is invalid: must be one of {SCHEDULE_KINDS}")
    L, R = num_layers, num_microbatches
    if L < 1 or R < 1:
        raise ValueError(f"a schedule needs >= 1 layer and micro-batch, got {L} and {R}")
    if kind == "distep":
        attention = []
        for j in range(R):
            attention += [Task("attn_fwd", l, j) for l in range(L)] + [Task("head", L - 1, j)]
            attention += [Task("attn_bwd", l, j) for l in reversed(range(L))]
        groups = [(j,) for j in range(R)]
    else:
        attention = [Task("attn_fwd", l, j) for l in range(L) for j in range(R)]
        attention += [Task("head", L - 1, j) for j in range(R)]
        if kind == "zebra":
            attention += [Task("attn_bwd", l, j) for l in reversed(range(L)) for j in range(R)]
        groups = [tuple(range(R))]
    rounds = [r for r in (emitted_round(t, L) for t in attention) if r is not None]
    if kind == "forward":
        rounds = [r for r in rounds if r.phase == "fwd"]
    return Schedule(kind, L, R, attention, rounds, groups if balance else [], layered=layered)


def answers_layered(member_roles: Sequence[str]) -> bool:
    """Whether a ZP group's schedule is ``layered``: where every member attends (the EP layout
    with zebra's overlap) each rank holds experts beside its attention, and answering round
    ``r`` before emitting ``r + 1`` would leave it idle through every dispatch. Layered, a
    rank emits a layer's micro-batches, then answers them all: dispatch ``j`` moves while it
    attends or answers ``j - 1``, combine ``j`` while it answers ``j + 1``. With expert ranks
    the round-by-round order stays: their answer to ``r`` must not wait for ``r + 1``'s rows."""
    return bool(member_roles) and all(role == "attention" for role in member_roles)


def check_theorem1(order: Sequence[Task], num_layers: int, num_microbatches: int) -> list[str]:
    """What in an attention rank's task order breaks Theorem 1 (empty: nothing)."""
    L, R = num_layers, num_microbatches
    attn = [t for t in order if t.kind in ("attn_fwd", "head", "attn_bwd")]
    problems = []
    want_fwd = [Task("attn_fwd", l, j) for l in range(L) for j in range(R)]
    if [t for t in attn if t.kind == "attn_fwd"] != want_fwd:
        problems.append("forward is not layer by layer with micro-batches 1..R inside each layer")
    pos = {t: i for i, t in enumerate(attn)}
    for j in range(R):
        if pos.get(Task("head", L - 1, j), -1) < pos.get(Task("attn_fwd", L - 1, j), 1 << 30):
            problems.append(f"micro-batch {j}'s head runs before its last-layer forward")
    heads = [t.mb for t in attn if t.kind == "head"]
    if heads != list(range(R)):
        problems.append("micro-batches do not reach the head in order 1..R")
    bwd = [t for t in attn if t.kind == "attn_bwd"]
    want_bwd = [Task("attn_bwd", l, j) for l in reversed(range(L)) for j in range(R)]
    if bwd != want_bwd:
        problems.append("backward is not layer by layer downwards with micro-batches 1..R inside each layer")
    if bwd and heads and pos[bwd[0]] < pos[Task("head", L - 1, R - 1)]:
        problems.append("the backward of a lower layer starts before every head ran")
    return problems
