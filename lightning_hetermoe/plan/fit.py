"""Which layouts fit in memory, and the largest batch that plans: the planner's search when
memory binds.

A layout is what the memory model sees of a plan: how many ranks of each device kind
attend (ranks of one kind are alike, so which of them does not change what fits), G ZP
groups (each kind dealt evenly over them, as the planner deals them), R micro-batches.
Sequences go to a group's attention ranks as the planner gives them (in proportion to
their speed); experts may sit on any member of a group, any number per layer, so the
experts fit iff the members' capacities add up to every expert of every layer.

Memory only falls as R grows (a micro-batch's working set shrinks; zebra keeps every
token in flight whatever R), so each (kinds, G) is checked at the most micro-batches it
allows. Where the count vectors are few (``MAX_VECTORS``) every one is checked, and a
refusal is a proof that no layout the plan format can express fits.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from ..apportion import apportion_alike
from ..cluster.devices import DeviceSpec
from ..profile.memory import MemoryModel, format_bytes

# Count vectors checked one by one up to this many; beyond, a grid per kind (not a proof).
MAX_VECTORS = 4096

Cap = Callable[[DeviceSpec, int, str], int]


def _no_cap(dev: DeviceSpec, modelled: int, role: str) -> int:
    return modelled


def optimizer_shares(devs: Sequence[DeviceSpec], attention: Sequence[int], sharded: bool) -> dict[int, float]:
    """Each attention rank's part of the dense optimizer state: all of it, or (ZeRO-1, as
    strategy/zero.py splits it) a range in proportion to its device memory."""
    if not sharded or len(attention) < 2:
        return {r: 1.0 for r in attention}
    total = sum(devs[r].memory_gb for r in attention)
    return {r: devs[r].memory_gb / total for r in attention}


def member_capacity(mem: MemoryModel, dev: DeviceSpec, *, seq_len: int, group_seqs: int, R: int,
                    seqs: int | None, share: float = 1.0) -> int:
    """Experts (all layers) one ZP-group member holds beside the rest, -1 where the rest does
    not fit; ``seqs``: the sequences it attends, ``None`` on an expert rank. Every token of
    the group is in flight (zebra); the working sets are one micro-batch's."""
    m = mem.model
    k, E = m.moe.top_k, m.moe.num_experts
    flight = group_seqs * seq_len * k / E
    mb = math.ceil(group_seqs / R) * seq_len * k / E
    if seqs is None:
        return mem.expert_capacity(dev, tokens_in_flight_per_expert=flight, mb_tokens_per_expert=mb)
    return mem.expert_capacity(dev, tokens_in_flight_per_expert=flight, mb_tokens_per_expert=mb,
                               attention_tokens_in_flight=seqs * seq_len,
                               attention_mb_tokens=math.ceil(seqs / R) * seq_len, holds_attention=True,
                               optimizer_share=share)


@dataclass(frozen=True)
class Layout:
    attention: tuple[int, ...]  # attention ranks per device kind (kinds sorted by name)
    G: int
    R: int


@dataclass(frozen=True)
class Verdict:
    layout: Layout
    fits: bool
    held: int  # experts the group's members hold (0 where an attention rank overflows)
    need: int
    overflow: float  # bytes the worst attention rank lacks (0 where every one fits)
    why: str  # the binding constraint, in words
    shape: bool = False  # refused for its shape (a group without a sequence, R over a rank's sequences)


def _last_true(pred: Callable[[int], bool], lo: int) -> int:
    """The last ``t >= lo`` where ``pred`` holds (0 if not at ``lo``), for ``pred`` true up
    to a point and false beyond: doubling, then bisection."""
    if not pred(lo):
        return 0
    hi = lo * 2
    while pred(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid)
    return lo


class LayoutSearch:
    """Feasible layouts of ``total`` sequences, the binding constraint where none is, and
    the largest batch that plans. ``speed(dev)``: the planner's weight for a rank's share
    of sequences; ``cap``: a measured capacity bounding the modelled one."""

    def __init__(self, mem: MemoryModel, devs: Sequence[DeviceSpec], speed: Callable[[DeviceSpec], float],
                 seq_len: int, *, max_microbatches: int, sharded: bool, cap: Cap = _no_cap,
                 num_microbatches: int | None = None, num_attention_ranks: int | None = None,
                 num_zp_groups: int | None = None, require_expert_ranks: bool = False):
        self.mem, self.S, self.cap = mem, seq_len, cap
        self.kinds = sorted({d.name for d in devs})
        self.spec = {d.name: d for d in devs}
        self.count = [sum(1 for d in devs if d.name == k) for k in self.kinds]
        self.speed = {k: speed(self.spec[k]) for k in self.kinds}
        self.sharded, self.max_R, self.pin_R = sharded, max(max_microbatches, 1), num_microbatches
        self.pin_M, self.pin_G, self.need_experts = num_attention_ranks, num_zp_groups, require_expert_ranks
        m = mem.model
        self.need = m.n_layers * m.moe.num_experts
        self._memo: dict[tuple, int] = {}
        self.exhaustive = True
        self._vectors: list[tuple[int, ...]] | None = None

    # ---- layouts -------------------------------------------------------------------------
    def vectors(self) -> list[tuple[int, ...]]:
        """Attention ranks per kind that the pins allow: every count vector, or a grid per
        kind where they are more than ``MAX_VECTORS``."""
        if self._vectors is not None:
            return self._vectors
        W = sum(self.count)
        axes = [range(n + 1) for n in self.count]
        if math.prod(n + 1 for n in self.count) > MAX_VECTORS:
            per = max(int(MAX_VECTORS ** (1 / len(self.count))), 2)
            axes = [sorted({0, n} | {round(i * n / (per - 1)) for i in range(per)}) for n in self.count]
            self.exhaustive = False
        out = []
        for a in itertools.product(*axes):
            M = sum(a)
            if M < 1 or (self.pin_M is not None and M != self.pin_M) or (self.need_experts and M == W):
                continue
            out.append(tuple(a))
        self._vectors = out
        return out

    def group_counts(self, a: tuple[int, ...]) -> list[int]:
        g = 0
        for n, x in zip(self.count, a, strict=True):
            g = math.gcd(math.gcd(g, x), n - x)
        Gs = [G for G in range(1, g + 1) if g % G == 0]
        return [G for G in Gs if G == self.pin_G] if self.pin_G is not None else Gs

    def judge(self, a: tuple[int, ...], G: int, total: int) -> Verdict:
        """Whether ``total`` sequences fit with ``a`` attention ranks per kind in ``G`` groups."""
        group_seqs = total // G
        R0 = self.pin_R or 1
        if group_seqs < 1:
            return Verdict(Layout(a, G, R0), False, 0, self.need, 0.0, f"{total} sequences cannot feed {G} ZP groups",
                           shape=True)
        # a group's attention ranks, kind by kind as the planner deals them, get their sequences
        # in proportion to speed; ranks of a kind with as many sequences are alike
        attn = [(k, x // G) for k, x in zip(self.kinds, a, strict=True) if x // G]
        experts = [(k, (n - x) // G) for k, n, x in zip(self.kinds, self.count, a, strict=True)]
        alike: Counter = Counter()
        for (k, ranks), (base, plus) in zip(attn, apportion_alike(group_seqs, [(self.speed[k], n) for k, n in attn])):
            for s, n in ((base + 1, plus), (base, ranks - plus)):
                if n:
                    alike[(k, s)] += n
        most = max(s for _, s in alike)
        R = self.pin_R or min(self.max_R, most)
        lay = Layout(a, G, R)
        if R > most:
            return Verdict(lay, False, 0, self.need, 0.0,
                           f"num_microbatches={R} exceeds the {most} sequences of the busiest attention rank",
                           shape=True)
        M_all = sum(a)
        mem_all = sum(self.spec[k].memory_gb * x for k, x in zip(self.kinds, a, strict=True))
        held, worst, caps = 0, None, {}  # caps: role -> experts one rank holds
        for (k, s), ranks in sorted(alike.items()):  # one capacity per alike
            share = self.spec[k].memory_gb / mem_all if self.sharded and M_all > 1 else 1.0
            c = self._capacity(k, group_seqs, R, s, share)
            if c < 0:
                over = self._attention_overflow(k, group_seqs, R, s, share)
                if worst is None or over > worst[0]:
                    worst = (over, k, s, share)
            held += c * ranks
            caps.setdefault(f"{k} attention", []).append(c)
        if worst is not None:
            return Verdict(lay, False, 0, self.need, worst[0], self._attention_words(*worst[1:], M_all, group_seqs, R))
        for k, n in experts:
            if n:
                c = max(self._capacity(k, group_seqs, R, None, 1.0), 0)
                held += n * c
                caps[f"{k} expert"] = [c]
        if held >= self.need:
            return Verdict(lay, True, held, self.need, 0.0, "")
        return Verdict(lay, False, held, self.need, 0.0, self._expert_words(held, group_seqs, caps))

    def _capacity(self, kind: str, group_seqs: int, R: int, seqs: int | None, share: float) -> int:
        key = (kind, group_seqs, R, seqs, share)
        if key not in self._memo:
            dev = self.spec[kind]
            c = member_capacity(self.mem, dev, seq_len=self.S, group_seqs=group_seqs, R=R, seqs=seqs, share=share)
            self._memo[key] = c if c < 0 else self.cap(dev, c, "expert" if seqs is None else "attention")
        return self._memo[key]

    def verdicts(self, total: int, stop_at_first: bool = False) -> list[Verdict]:
        out = []
        for a in self.vectors():
            for G in self.group_counts(a):
                v = self.judge(a, G, total)
                out.append(v)
                if v.fits and stop_at_first:
                    return out
        return out

    def fits(self, total: int) -> bool:
        return any(v.fits for v in self.verdicts(total, stop_at_first=True))

    def largest(self) -> int:
        """The most sequences that plan (0: not one). Unpinned, the whole search at once:
        doubling, then bisection (a layout's memory only grows with its batch, and one
        group and one micro-batch per sequence serve the smallest). A pinned R or G needs a
        batch of at least R sequences on a rank or one per group, so there each layout
        gets its own range: from the fewest sequences it admits, doubling, bisection."""
        if self.pin_R or self.pin_G:
            return max((self._layout_largest(a, G) for a in self.vectors() for G in self.group_counts(a)), default=0)
        return _last_true(self.fits, 1)

    def _layout_largest(self, a: tuple[int, ...], G: int) -> int:
        W = sum(self.count)
        # past R sequences per rank of the whole cluster, only memory can refuse a batch
        admits = (t for t in range(G, G * (self.pin_R or 1) * W + 1) if not self.judge(a, G, t).shape)
        first = next(admits, 0)
        return _last_true(lambda t: self.judge(a, G, t).fits, first) if first else 0

    # ---- words ---------------------------------------------------------------------------
    def closest(self, verdicts: list[Verdict]) -> Verdict:
        """The failing layout nearest to fitting: attention that fits and the most experts
        held, else the smallest overflow on an attention rank."""
        return max(verdicts, key=lambda v: (v.overflow == 0 and v.held > 0, v.held / v.need, -v.overflow))

    def describe(self, lay: Layout) -> str:
        kinds = " + ".join(f"{x} {k}" for k, x in zip(self.kinds, lay.attention, strict=True) if x)
        return f"{kinds} attention rank(s) in {lay.G} ZP group(s), R={lay.R}"

    def _attention_overflow(self, kind: str, group_seqs: int, R: int, seqs: int, share: float) -> float:
        dev = self.spec[kind]
        # before any expert: an expert's working set is its own (MemoryModel.expert_capacity)
        need = self.mem.attention_bytes(tokens_in_flight=seqs * self.S, mb_tokens=math.ceil(seqs / R) * self.S,
                                        optimizer_share=share)
        return need - dev.usable_bytes

    def _attention_words(self, kind: str, seqs: int, share: float, M_all: int, group_seqs: int, R: int) -> str:
        mem, S = self.mem, self.S
        state = mem.attention_bytes(tokens_in_flight=0, mb_tokens=0, optimizer_share=share)
        ckpt = mem.attention_bytes(tokens_in_flight=seqs * S, mb_tokens=0) - mem.attention_bytes(
            tokens_in_flight=0, mb_tokens=0)
        work = mem.attention_bytes(tokens_in_flight=0, mb_tokens=math.ceil(seqs / R) * S) - mem.attention_bytes(
            tokens_in_flight=0, mb_tokens=0)
        terms = {"dense state": state, f"checkpoints of its {seqs} sequence(s)": ckpt, "working set": work}
        top = max(terms, key=terms.get)
        sharded = f", optimizer state sharded over {M_all}" if share < 1 else ""
        return (f"an attention rank on {kind} ({format_bytes(self.spec[kind].usable_bytes)} usable) cannot hold "
                f"the dense state ({format_bytes(state)}{sharded}), the checkpoints of its {seqs} sequence(s) "
                f"({format_bytes(ckpt)}) and the working set ({format_bytes(work)}); the {top} binds")

    def _expert_words(self, held: int, group_seqs: int, caps: dict[str, list[int]]) -> str:
        m = self.mem.model
        flight = group_seqs * self.S * m.moe.top_k / m.moe.num_experts
        state = self.mem.expert_bytes(tokens_in_flight_per_expert=0)
        saved = self.mem.expert_bytes(tokens_in_flight_per_expert=flight) - state
        top = "expert state" if state >= saved else "experts' saved inputs"
        each = ", ".join(f"{role} {min(c)}" + (f"-{max(c)}" if max(c) > min(c) else "") for role, c in caps.items())
        return (f"a ZP group holds {held} of the {self.need} experts it needs (per rank: {each}; each expert takes "
                f"{format_bytes(state)} of state and {format_bytes(saved)} of saved inputs for the group's "
                f"{group_seqs} sequence(s) in flight); the {top} binds")
