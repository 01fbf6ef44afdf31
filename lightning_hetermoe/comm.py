"""Every collective the pack issues, each named by the traffic it carries.

Two kinds of traffic, on two kinds of process group:

* **device**: tensors that live on the compute device (token rows, gradients, weights, the
  loss), on the device backend (NCCL on CUDA, gloo on CPU). A CPU tensor here is a bug
  on NCCL; :func:`_check` rejects it by construction, naming the call site.
* **host**: metadata the host needs (split counts, routing counts, busy times, objects),
  as CPU tensors on gloo groups. Host collectives never touch a device stream, so a host
  wait never stalls compute queued on the GPU.

Every :class:`Group` is built with both a device and a host process group where asked
(``torch.distributed.new_group`` is a collective: every rank builds every group, in the
same order). On CUDA the device side is NCCL and the host side gloo; on CPU both are gloo,
still two process groups, so which traffic went where stays checkable on a machine
without a GPU. There a CPU tensor on device traffic still looks right; on the stand-in
device (:mod:`lightning_hetermoe.standin`, ``HETERMOE_STANDIN=1``) the compute device is not
the host, :func:`_check` refuses host tensors as on NCCL, and gloo is handed the CPU memory
a stand-in tensor holds.

**Two vendors in one job** (NVIDIA and AMD, as HETHUB trains): their device libraries
(NCCL, RCCL) cannot form one communicator. :func:`configure` takes each rank's vendor; a
group whose members are all of one vendor keeps its device side, a group that spans
vendors gets a *staged* device side instead: a gloo group, each tensor copied to host
memory, sent, and copied back. Every recorded call names its path (``device``,
``staged`` or ``host``), so a test can check that no device communicator spans vendors.

:func:`record` turns on a per-process recorder of every call (group, traffic, operation,
sizes); :func:`check_sequences` compares the recordings of all ranks: on every group,
every member must issue the same sequence of collectives with matching sizes (NCCL's
rule). Tests run it on real gloo processes.

Asynchronous calls return a :class:`Pending`; its tensors stay referenced until
:meth:`Pending.wait`, which on CUDA orders the current stream after the communication
without blocking the host. :func:`issuing` runs an issue on the communication stream (on
CUDA), ordered after the compute queued so far (what it sends, and the receive buffer's
block), so a receive posted early never holds back compute and never writes a block a
queued kernel still reads.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import standin

HOST, DEVICE = "host", "device"
STAGED = "staged"  # a device tensor through host memory on gloo (a group spanning vendors)


class CommError(RuntimeError):
    """A collective was given the wrong kind of tensor, or a group it is not part of."""


@dataclass(eq=False)
class Group:
    """A set of global ranks with its device and host process groups (``None`` on ranks
    outside the group, or where that traffic was not asked for)."""

    name: str
    ranks: tuple[int, ...]
    device: Any = None
    host: Any = None
    member: bool = False
    staged: bool = False  # the members span vendors: device traffic goes through host memory

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's rank within the group (group ranks follow sorted global ranks)."""
        return self.ranks.index(dist.get_rank())


@dataclass
class Call:
    """One recorded collective, as this rank issued it."""

    group: str
    ranks: tuple[int, ...]
    traffic: str
    op: str
    what: str
    group_rank: int
    dtype: str
    shape: tuple[int, ...]
    out_splits: tuple[int, ...] | None = None  # all_to_all: rows this rank receives from each member
    in_splits: tuple[int, ...] | None = None  # all_to_all: rows this rank sends to each member
    device: str = ""
    path: str = ""  # device | staged | host: which communicator carried it


@dataclass
class _State:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    world: Group | None = None
    default: Any = None  # the default process group the world was built in
    vendors: tuple[str, ...] = ()  # per global rank, where they differ (else empty)
    # device process groups by members (and path), for groups that may share a communicator
    communicators: dict[tuple, Any] = field(default_factory=dict)
    opened: list[tuple[int, ...]] = field(default_factory=list)  # members of each device group this rank opened
    built: dict[tuple, "Group"] = field(default_factory=dict)  # every group by (name, members, sides)
    recording: list[Call] | None = None
    issued: int = 0  # collectives this process issued (the progress watchdog reads it)
    waiting: str | None = None  # the collective this process is blocked in, if any
    together: dict[str, int] = field(default_factory=dict)  # agreements through the store, per group
    stream: Any = None  # the communication stream (CUDA)
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


# -- set-up ---------------------------------------------------------------------------
def configure(device: torch.device, vendors: Sequence[str] | None = None) -> None:
    """At process-group set-up, on every rank: the compute device, each rank's vendor where
    the job mixes them (see the module's doc), and the world's groups (built once per
    process group; a collective)."""
    _state.device = torch.device(device)
    if _state.device.type == "cuda" and _state.stream is None:
        _state.stream = torch.cuda.Stream(device=_state.device)
    world = tuple(range(dist.get_world_size()))
    if vendors is not None and len(vendors) != len(world):
        raise CommError(f"comm.configure: {len(vendors)} vendors for a world of {len(world)} ranks")
    mixed = tuple(vendors) if vendors is not None and len(set(vendors)) > 1 else ()
    if _state.world is not None and _state.default is dist.group.WORLD and (vendors is None or mixed == _state.vendors):
        return
    _state.default, _state.vendors = dist.group.WORLD, mixed
    _state.communicators, _state.built = {}, {}
    # even where the default group is gloo, host traffic gets its own group
    host = dist.new_group(list(world), backend="gloo")
    if _state.vendors:
        # the default group of a mixed-vendor job is gloo (the strategy asks for it): its own
        # gloo group carries the world's staged device traffic
        _state.world = Group("world", world, device=dist.new_group(list(world), backend="gloo"), host=host,
                             member=True, staged=True)
    else:
        _state.world = Group("world", world, device=dist.group.WORLD, host=host, member=True)
    _state.communicators[(world, _state.world.staged)] = _state.world.device
    _state.opened = [world]


def communicators_opened() -> dict[tuple[int, ...], int]:
    """How many device communicators this rank opened per member set, groups of several
    ranks only (a one-rank group never talks; NCCL opens it lazily, on first use). More than
    one for the same members costs their memory again on every member."""
    return dict(Counter(r for r in _state.opened if len(r) > 1))


def spans_vendors(ranks: Sequence[int]) -> bool:
    return bool(_state.vendors) and len({_state.vendors[r] for r in ranks}) > 1


def compute_device() -> torch.device:
    return _state.device


def configured() -> bool:
    """Whether a process group is running and its groups are built (:func:`configure` ran
    for it)."""
    return (dist.is_available() and dist.is_initialized() and _state.world is not None
            and _state.default is dist.group.WORLD)


def world() -> Group:
    """Every rank. Configured by the strategy when its process group starts; under another
    strategy, on first use (a collective: every rank reaches it at the same point)."""
    if not configured():
        if not (dist.is_available() and dist.is_initialized()):
            raise CommError("lightning_hetermoe.comm: no process group is running")
        nccl = dist.get_backend() == "nccl"
        configure(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    return _state.world


def forget() -> None:
    """The process group ended: its groups are gone."""
    _state.world = _state.default = None
    _state.vendors = ()
    _state.communicators, _state.built = {}, {}
    _state.opened = []


def new_group(name: str, ranks: Sequence[int], *, device: bool = True, host: bool = False,
              reuse: bool = False) -> Group:
    """Build ``name`` over ``ranks`` (a collective over the world: call on every rank). A
    group spanning vendors gets a staged device side (gloo); one vendor's group the
    device backend (NCCL on CUDA, whatever the default group is).

    ``reuse``: take the device communicator of a group built earlier with the same members,
    if any (every rank decides alike: the same calls in the same order). Each NCCL
    communicator costs hundreds of MB of device memory; reuse only where one thread issues
    both groups' collectives, in program order (NCCL runs one communicator's operations in
    the order they were issued; two threads issuing at once could interleave differently on
    two ranks, and each would wait for the other's).

    A group asked for again by the same name, members and sides (the next ``fit`` in this
    process, on the same process group) is the one built before: each fit would otherwise
    open its communicators again and hold both."""
    ranks = tuple(sorted(ranks))
    known = _state.built.get((name, ranks, device, host, reuse))
    if known is not None:
        return known
    me = dist.get_rank()
    staged = device and spans_vendors(ranks)
    key = (ranks, staged)
    if not device:
        dev = None
    elif reuse and key in _state.communicators:
        dev = _state.communicators[key]
    elif staged:
        dev = dist.new_group(list(ranks), backend="gloo")
    else:
        dev = dist.new_group(list(ranks), backend="nccl" if _state.device.type == "cuda" else None)
    member = me in ranks
    if dev is not None:
        if member and dev is not _state.communicators.get(key):
            _state.opened.append(ranks)
        _state.communicators.setdefault(key, dev)
    hst = dist.new_group(list(ranks), backend="gloo") if host else None
    group = Group(name, ranks, device=dev if member else None, host=hst if member else None, member=member,
                  staged=staged)
    _state.built[(name, ranks, device, host, reuse)] = group
    return group


# -- progress -------------------------------------------------------------------------
def activity() -> tuple[int, str | None]:
    """How many collectives this process issued, and the one it is blocked in (read by the
    progress watchdog's thread: a rank alive but stuck is told apart from one that waits)."""
    return _state.issued, _state.waiting


def _watched(fn):
    """Count the call and say, while it blocks, which collective this process waits in."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        _state.issued += 1
        before, _state.waiting = _state.waiting, kwargs.get("what", fn.__name__)
        try:
            return fn(*args, **kwargs)
        finally:
            _state.waiting = before
    return call


# -- recording ------------------------------------------------------------------------
@contextlib.contextmanager
def record() -> Iterator[list[Call]]:
    """Record every collective this process issues inside the block."""
    calls: list[Call] = []
    previous, _state.recording = _state.recording, calls
    try:
        yield calls
    finally:
        _state.recording = previous


def _note(group: Group, traffic: str, op: str, what: str, t: Tensor | None, out_splits=None, in_splits=None) -> None:
    if _state.recording is None:
        return
    path = HOST if traffic == HOST else STAGED if group.staged else DEVICE
    _state.recording.append(Call(group.name, group.ranks, traffic, op, what, group.rank,
                                 str(t.dtype) if t is not None else "", tuple(t.shape) if t is not None else (),
                                 tuple(out_splits) if out_splits is not None else None,
                                 tuple(in_splits) if in_splits is not None else None,
                                 str(t.device) if t is not None else "", path))


def check_sequences(per_rank: Sequence[Sequence[Call]]) -> list[str]:
    """What breaks NCCL's rule in recordings of every rank (empty: nothing): on every
    communicator (a group's device side, or its host side), every member issues the same
    collectives in the same order with matching sizes; and two ranks issue the device
    collectives of the communicators they share in one order."""
    problems: list[str] = []
    by_group: dict[str, dict[int, list[Call]]] = {}
    ranks_of: dict[str, tuple[int, ...]] = {}
    for rank, calls in enumerate(per_rank):
        for c in calls:
            name = f"{c.group} ({c.traffic})"
            by_group.setdefault(name, {}).setdefault(rank, []).append(c)
            if ranks_of.setdefault(name, c.ranks) != c.ranks:
                problems.append(f"group {name}: ranks {c.ranks} on rank {rank}, {ranks_of[name]} elsewhere")
    for name, seqs in sorted(by_group.items()):
        members = ranks_of[name]
        missing = [r for r in members if r not in seqs]
        if missing:
            problems.append(f"group {name}: members {missing} issued nothing, others issued {len(next(iter(seqs.values())))}")
            continue
        strangers = [r for r in seqs if r not in members]
        if strangers:
            problems.append(f"group {name}: ranks {strangers} issued collectives but are not members")
        lengths = {r: len(seqs[r]) for r in members}
        if len(set(lengths.values())) != 1:
            problems.append(f"group {name}: members issued different numbers of collectives {lengths}")
        for k in range(min(lengths.values())):
            calls = {r: seqs[r][k] for r in members}
            problems += _mismatch(name, k, calls)
    return problems + _cross_order(per_rank)


def _cross_order(per_rank: Sequence[Sequence[Call]]) -> list[str]:
    """Two ranks that share several communicators issue their device collectives in one
    order: NCCL kernels wait for their peers, and where two communicators' kernels cannot
    run side by side, two members that queue them in opposite orders wait on each other."""
    problems: list[str] = []
    for a in range(len(per_rank)):
        for b in range(a + 1, len(per_rank)):
            seqs = [[c.group for c in per_rank[r] if c.traffic != HOST and a in c.ranks and b in c.ranks]
                    for r in (a, b)]
            if len(set(seqs[0] + seqs[1])) < 2 or seqs[0] == seqs[1]:
                continue
            k = next((i for i, (x, y) in enumerate(zip(*seqs)) if x != y), min(map(len, seqs)))
            got = [s[k] if k < len(s) else "nothing" for s in seqs]
            problems.append(f"ranks {a} and {b} issue the device collectives of the groups they share in different "
                            f"orders: at their #{k} shared one, rank {a} issues {got[0]}, rank {b} {got[1]}")
    return problems


def _mismatch(name: str, k: int, calls: dict[int, Call]) -> list[str]:
    first = next(iter(calls.values()))
    where = f"group {name}, collective #{k}"
    kinds = {(c.op, c.traffic, c.what) for c in calls.values()}
    if len(kinds) != 1:
        return [f"{where}: members issued different collectives {sorted(kinds)}"]
    if len({c.dtype for c in calls.values()}) != 1:
        return [f"{where} ({first.what}): dtypes differ {[c.dtype for c in calls.values()]}"]
    if first.op == "all_to_all":
        out = []
        ranks = sorted(calls)
        for i, ri in enumerate(ranks):
            for j, rj in enumerate(ranks):
                sent, got = calls[ri].in_splits[j], calls[rj].out_splits[i]
                if sent != got:
                    out.append(f"{where} ({first.what}): rank {ri} sends {sent} rows to rank {rj}, which expects {got}")
        if len({c.shape[1:] for c in calls.values()}) != 1:
            out.append(f"{where} ({first.what}): row shapes differ {[c.shape for c in calls.values()]}")
        return out
    if first.op != "objects" and len({c.shape for c in calls.values()}) != 1:
        return [f"{where} ({first.what}): shapes differ {[c.shape for c in calls.values()]}"]
    return []


# -- checks by construction -----------------------------------------------------------
def check_device_traffic(t: Tensor, what: str, where: str = "a device collective") -> None:
    """Raise, naming ``what``, where ``t`` would travel as device traffic off the compute
    device (a CPU tensor given to NCCL; on a CPU run, to the stand-in device's group)."""
    if t.device != _state.device:
        raise CommError(f"{what}: {where} got a tensor on {t.device}; the compute device is {_state.device} "
                        f"(host metadata goes over the host group)")


def _check(group: Group, traffic: str, what: str, *tensors: Tensor) -> Any:
    pg = group.device if traffic == DEVICE else group.host
    if not group.member or pg is None:
        raise CommError(f"{what}: rank {dist.get_rank()} issued {traffic} traffic on group {group.name}, which has no "
                        f"{traffic} side here (members {list(group.ranks)})")
    if traffic == DEVICE:
        for t in tensors:
            check_device_traffic(t, what, f"a device collective on group {group.name}")
        return pg
    for t in tensors:  # (is_cpu: no device object built per tensor, on the step's path)
        if not t.is_cpu:
            raise CommError(f"{what}: a host collective on group {group.name} got a tensor on {t.device}; host "
                            f"traffic is CPU tensors on gloo")
    return pg


# -- asynchronous work ----------------------------------------------------------------
class Pending:
    """An issued asynchronous collective and the tensors it must keep alive until waited."""

    __slots__ = ("work", "keep", "what", "_done")

    def __init__(self, work: Any, keep: tuple, what: str) -> None:
        self.work, self.keep, self.what = work, keep, what
        self._done = False

    def wait(self) -> Any:
        """Wait (on CUDA: order the current stream after it), release the kept tensors,
        and return the received tensor (the first kept one)."""
        if not self._done:
            if self.work is not None:
                before, _state.waiting = _state.waiting, self.what
                try:
                    self.work.wait()
                finally:
                    _state.waiting = before
            self._done = True
        out = self.keep[0] if self.keep else None
        self.keep = (out,) if out is not None else ()
        return out

    @property
    def done(self) -> bool:
        return self._done

    @property
    def completed(self) -> bool:
        """Whether its work finished (a query: no wait, no host sync)."""
        return self._done or self.work is None or bool(self.work.is_completed())


def compute_idle() -> bool:
    """Whether the compute stream has run everything queued on it (CUDA: an event recorded
    now has completed; no host sync). Elsewhere compute runs as it is called: always."""
    if _state.device.type != "cuda":
        return True
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(_state.device))
    return event.query()


@contextlib.contextmanager
def issuing(after: Sequence[Tensor] = ()) -> Iterator[None]:
    """Issue collectives on the communication stream (CUDA), ordered after everything queued
    on the compute stream so far: the tensors sent (``after``) were made there, and so were
    the receive buffers, which the caching allocator may have carved from a block whose
    previous user's kernels are still queued (the stream's order makes that safe for the
    compute stream only). Every collective queued before stays ahead, so no cycle forms. A
    no-op on CPU."""
    stream = _state.stream
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(_state.device))
    with torch.cuda.stream(stream):
        yield


# -- device traffic -------------------------------------------------------------------
# A staged group (its members span vendors) carries device tensors through host memory:
# copy out, the gloo collective, copy back. Synchronous by nature (the host waits for the
# copies); an asynchronous caller gets a Pending that orders its stream after the copy back.
def _host(t: Tensor) -> Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def _host_like(t: Tensor) -> Tensor:
    """Where a staged collective writes what ``t`` will hold."""
    return t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _back(t: Tensor, host: Tensor) -> None:
    if host is not t and host is not _wire(t):
        t.copy_(host)


def _single(name: str, before: str) -> Any:
    """torch.distributed's single-tensor collective ``name``: torch 2.12's name for it, else
    ``before``, the name every torch this pack supports (2.4 on) has and 2.12 deprecates
    (``all_gather_single`` was ``all_gather_into_tensor``, ``reduce_scatter_single``
    ``reduce_scatter_tensor``). Looked up at each call (two attribute reads beside a
    collective), so a process that imported this module can still be given the older torch's
    names, as the test of the fallback does."""
    return getattr(dist, name, None) or getattr(dist, before)


def _wire(t: Tensor) -> Tensor:
    """What the device process group is handed: the tensor, or on the CPU stand-in device
    (:mod:`lightning_hetermoe.standin`) the CPU memory it holds (gloo takes CPU tensors only)."""
    return standin.host_view(t)


class _CopiedBack:
    """The staged collective's result is in place: on CUDA the waiting stream is ordered
    after the copy back (queued on the stream current at issue)."""

    def __init__(self) -> None:
        self.event = None
        if _state.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(_state.device).wait_event(self.event)

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


def _done(group: Group, work: Any, keep: tuple, what: str, async_op: bool) -> Pending | None:
    if not async_op:
        return None
    return Pending(_CopiedBack() if group.staged else work, keep, what)


@_watched
def all_to_all(group: Group, out: Tensor, inp: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], *,
               what: str, async_op: bool = False) -> Pending | None:
    """Uneven all-to-all of rows: ``out_splits[j]`` rows arrive from member ``j``,
    ``in_splits[j]`` rows of ``inp`` go to member ``j``."""
    pg = _check(group, DEVICE, what, out, inp)
    _note(group, DEVICE, "all_to_all", what, inp, out_splits, in_splits)
    if group.staged:
        host = _host_like(out)
        dist.all_to_all_single(host, _host(inp), list(out_splits), list(in_splits), group=pg)
        _back(out, host)
        return _done(group, None, (out, inp), what, async_op)
    work = dist.all_to_all_single(_wire(out), _wire(inp), list(out_splits), list(in_splits), group=pg,
                                  async_op=async_op)
    return _done(group, work, (out, inp), what, async_op)


@_watched
def all_reduce(group: Group, t: Tensor, *, what: str, op: Any = None, async_op: bool = False) -> Pending | None:
    """Sum (or ``op``) of ``t`` over the group, in place."""
    pg = _check(group, DEVICE, what, t)
    _note(group, DEVICE, "all_reduce", what, t)
    op = op if op is not None else dist.ReduceOp.SUM
    if group.staged:
        host = _host(t)
        dist.all_reduce(host, op=op, group=pg)
        _back(t, host)
        return _done(group, None, (t,), what, async_op)
    work = dist.all_reduce(_wire(t), op=op, group=pg, async_op=async_op)
    return _done(group, work, (t,), what, async_op)


@_watched
def all_gather(group: Group, outs: list[Tensor], t: Tensor, *, what: str) -> None:
    pg = _check(group, DEVICE, what, t, *outs)
    _note(group, DEVICE, "all_gather", what, t)
    if group.staged:
        hosts = [_host_like(o) for o in outs]
        dist.all_gather(hosts, _host(t), group=pg)
        for o, h in zip(outs, hosts, strict=True):
            _back(o, h)
        return
    dist.all_gather([_wire(o) for o in outs], _wire(t), group=pg)


@_watched
def all_gather_into(group: Group, out: Tensor, t: Tensor, *, what: str, async_op: bool = False) -> Pending | None:
    """Every member's equal-sized ``t`` into ``out`` (``size * t.numel()``), in rank order."""
    pg = _check(group, DEVICE, what, out, t)
    _note(group, DEVICE, "all_gather_into", what, t)
    if group.staged:
        host = _host_like(out)
        _single("all_gather_single", "all_gather_into_tensor")(host, _host(t), group=pg)
        _back(out, host)
        return _done(group, None, (out, t), what, async_op)
    work = _single("all_gather_single", "all_gather_into_tensor")(_wire(out), _wire(t), group=pg,
                                                                  async_op=async_op)
    return _done(group, work, (out, t), what, async_op)


@_watched
def reduce_scatter(group: Group, out: Tensor, t: Tensor, *, what: str) -> None:
    """Sum of ``t`` (``size * out.numel()``) over the group; member ``i`` keeps chunk ``i``."""
    pg = _check(group, DEVICE, what, out, t)
    _note(group, DEVICE, "reduce_scatter", what, t)
    if group.staged:
        host = _host_like(out)
        _single("reduce_scatter_single", "reduce_scatter_tensor")(host, _host(t), group=pg)
        _back(out, host)
        return
    _single("reduce_scatter_single", "reduce_scatter_tensor")(_wire(out), _wire(t), group=pg)


@_watched
def broadcast(group: Group, t: Tensor, src: int, *, what: str) -> None:
    """``src`` is a global rank."""
    pg = _check(group, DEVICE, what, t)
    _note(group, DEVICE, "broadcast", what, t)
    host = _host(t) if group.staged else _wire(t)
    dist.broadcast(host, src=src, group=pg)
    _back(t, host)


def ddp_allreduce_hook(group: Group, bucket):  # DDP rejects annotations it cannot resolve
    """A DDP comm hook: each gradient bucket's mean over ``group`` through this module (so
    staged where the replicas span vendors, and recorded), as DDP's own all-reduce does it
    (divided first, then summed)."""
    t = bucket.buffer()
    t.div_(group.size)
    all_reduce(group, t, what="ddp.grads")
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(t)
    return done


# -- host traffic ---------------------------------------------------------------------
@_watched
def host_all_gather(group: Group, outs: list[Tensor], t: Tensor, *, what: str, async_op: bool = False
                    ) -> Pending | None:
    pg = _check(group, HOST, what, t, *outs)
    _note(group, HOST, "all_gather", what, t)
    work = dist.all_gather(outs, t, group=pg, async_op=async_op)
    return Pending(work, (outs, t), what) if async_op else None


@_watched
def host_all_reduce(group: Group, t: Tensor, *, what: str, async_op: bool = False) -> Pending | None:
    pg = _check(group, HOST, what, t)
    _note(group, HOST, "all_reduce", what, t)
    # one member's sum is its own tensor: no round trip through gloo (a single device's
    # per-step agreements, a ZP plan's one attention rank's balance counts)
    work = dist.all_reduce(t, group=pg, async_op=async_op) if group.size > 1 else None
    return Pending(work, (t,), what) if async_op else None


@_watched
def host_all_to_all(group: Group, out: Tensor, inp: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], *,
                    what: str) -> None:
    pg = _check(group, HOST, what, out, inp)
    _note(group, HOST, "all_to_all", what, inp, out_splits, in_splits)
    dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=pg)


@_watched
def gather_objects(group: Group, obj: Any, *, what: str) -> list[Any]:
    """Every member's ``obj`` (picklable), in group-rank order."""
    pg = _check(group, HOST, what)
    _note(group, HOST, "objects", what, None)
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=pg)
    return out


@_watched
def broadcast_object(group: Group, obj: Any, src: int, *, what: str) -> Any:
    """Global rank ``src``'s ``obj`` (picklable) on every member, over the host side: an
    object broadcast on a NCCL group stages the pickle through device memory and reads its
    size back (a host sync), for what is host metadata (a path, a plan, a decision)."""
    pg = _check(group, HOST, what)
    _note(group, HOST, "objects", what, None)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=pg)
    return box[0]


@_watched
def host_broadcast(group: Group, t: Tensor, src: int, *, what: str) -> None:
    """A CPU tensor from global rank ``src`` to every member, over the host side."""
    pg = _check(group, HOST, what, t)
    _note(group, HOST, "broadcast", what, t)
    dist.broadcast(t, src=src, group=pg)


@_watched
def host_barrier(group: Group, *, what: str) -> None:
    pg = _check(group, HOST, what)
    _note(group, HOST, "barrier", what, None)
    dist.barrier(group=pg)


def arrive_together(group: Group, timeout_s: float) -> list[int]:
    """Every member of ``group`` says, through the job's store, that it reached this point
    (its next agreement on ``group``: the members must call this equally often); returns
    the global ranks that had not within ``timeout_s`` (empty: every member did). Not a
    collective: one that some members never issue would pair with whatever they issue next
    on the group (an all-to-all of the next training step, exchanging rows that belong to
    nothing) instead of failing. Once every member has arrived, the keys of the agreement
    before are removed: every member has passed it."""
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    base = f"hetermoe/together/{'-'.join(map(str, group.ranks))}"
    count = _state.together[base] = _state.together.get(base, 0) + 1
    here, me = f"{base}/{count}", dist.get_rank()
    store.set(f"{here}/{me}", "1")
    if store.add(here, 1) == group.size:
        store.set(f"{here}/all", "1")
    try:
        store.wait([f"{here}/all"], timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError):  # the store's timeout
        return [r for r in group.ranks if not store.check([f"{here}/{r}"])]
    if count > 1 and me == group.ranks[0]:
        for suffix in ("", "/all", *(f"/{r}" for r in group.ranks)):
            store.delete_key(f"{base}/{count - 1}{suffix}")
    return []


def first_to_say(line: str) -> bool:
    """Whether this rank is the first of the job to say ``line``: the job's store counts who
    said it, so an error every rank meets alike (a config error found inside the fit) is
    printed once, not once a rank. ``True`` where no store can be asked (one process, a
    group already gone, its host gone): then every rank says it, as before."""
    import hashlib

    if not (dist.is_available() and dist.is_initialized()):
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        key = "hetermoe/said/" + hashlib.sha1(line.encode()).hexdigest()
        first = store.add(key, 1) == 1
        if dist.get_rank() == 0:
            _outlive_the_others(store, key, dist.get_world_size())
        return first
    except (RuntimeError, ValueError, dist.DistError):
        return True


SAY_WAIT_S = 3.0  # how long rank 0 waits for the other ranks to ask whether they say a line


def _outlive_the_others(store: Any, key: str, world: int) -> None:
    """Rank 0 hosts the job's store where the pack launched it, and exits once it has said
    the line: a rank asking after that found no store, took itself for the first and said
    the line again beside the store's own report of the lost connection. So rank 0 waits
    (at most :data:`SAY_WAIT_S`: a rank that never meets the error is not waited for) until
    every rank has asked."""
    import time

    deadline = time.monotonic() + SAY_WAIT_S
    while store.add(key, 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)


# -- what travels ---------------------------------------------------------------------
def wire_dtype(t: Tensor) -> torch.dtype:
    """The dtype ``t``'s values travel in: the autocast dtype where autocast is on for its
    device and ``t`` is a wider float (the receiver computes in it anyway: the same values,
    half the bytes), else its own. Gradients of fp32 weights are synced in fp32."""
    return wire_dtype_of(t.device, t.dtype) if t.is_floating_point() else t.dtype


def wire_dtype_of(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What floats of ``dtype`` on ``device`` travel in, under the autocast state in force."""
    if torch.is_autocast_enabled(device.type):
        narrow = torch.get_autocast_dtype(device.type)
        if narrow.itemsize < dtype.itemsize:
            return narrow
    return dtype


# -- host to device -------------------------------------------------------------------
def to_device(t: Tensor, device: torch.device | None = None) -> Tensor:
    """A host tensor on the compute device without a host sync: from pinned memory,
    ``non_blocking`` (the copy is ordered on the current stream)."""
    device = torch.device(device) if device is not None else _state.device
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# -- device to host ---------------------------------------------------------------------
class HostCopy:
    """A device tensor's values on their way to the host, to be read later: the copy is
    queued on the current stream (into pinned memory, ``non_blocking``, an event after it),
    so making it waits for nothing, and reading it (:meth:`get`) waits only for the work
    queued before the copy, long finished when it is read a step later. Off CUDA the copy
    is made at once."""

    __slots__ = ("host", "_event", "_source")

    def __init__(self, t: Tensor) -> None:
        if t.device.type != "cuda":
            self.host, self._event, self._source = t.detach().to("cpu"), None, None
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.host.copy_(t.detach(), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        self._source = t  # alive until the copy is read

    def get(self) -> Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = self._source = None
        return self.host
