"""The modelled clock of an emulated device.

Every task an emulated rank runs does its real math on the CPU and is then padded (slept)
to the time the task would take on the device the rank plays, times ``time_scale``.

**Whose time.** Without ``cluster.emulate_workload`` a task is timed as the model actually
run (tiny shapes, where launch overhead dominates and device kinds barely differ). With
``emulate_workload: {model: d1, seq_len: 16384}`` it is timed as the matching task of that
workload: the workload's widths (``d_model``, heads, ``d_ff``, activation, vocabulary) at
its sequence length, on the run's own depth, expert count and ``top_k`` (give the tiny
model the workload's ``n_layers``/``num_experts``/``top_k`` to stand for the whole of it),
recomputing what the run recomputes (``activation_checkpointing``: each block's forward once
more inside its backward; ``moe.recompute_activation``: the experts' hidden activation).

**The token mapping.** One sequence of the run stands for one workload sequence: every
token the run really handled counts ``token_scale = workload seq_len / run seq_len``
workload tokens. Attention of a micro-batch, each expert on the tokens routed to it, each
transfer (per direction, by the rows that really moved) and the head are timed on the
scaled counts, so routing skew in the run shows in the clock.

:class:`Emulator` is one rank's clock: the task times, the padding, and an honest count of
the tasks whose real compute overran their modelled time.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ..configs import ModelConfig, workload_model


def emulation_cost_model(**overrides: Any):
    """The cost model emulated ranks use. Its recomputation is the timed model's (a timer
    fills ``activation_checkpointing`` in): what the CPU job recomputes, the clock pays."""
    from ..profile.cost_model import CostModel

    return CostModel(**overrides)


@dataclass(frozen=True)
class EmulatedWorkload:
    """What an emulated run's clock times, and how its tokens map onto it."""

    model: ModelConfig  # the clock's model (workload widths on the run's depth and experts)
    seq_len: int  # the clock's sequence length
    token_scale: float  # clock tokens per real token
    timer: Any  # a CostModelTimer over ``model`` at ``seq_len``

    def scaled(self, run_tokens: float) -> float:
        return run_tokens * self.token_scale


def emulated_workload(cluster: Any, run_model: ModelConfig, run_seq_len: int) -> EmulatedWorkload:
    from ..profile.timer import make_timer

    spec = getattr(cluster, "emulate_workload", None)
    precision = (spec or {}).get("precision", "16-mixed")
    if not spec:
        model, seq_len, scale = run_model, run_seq_len, 1.0
    else:
        work = workload_model(spec["model"])
        seq_len = int(spec["seq_len"])
        # the widths are the workload's; what the run does with them (depth, experts, routing,
        # what its backward recomputes) is the run's, or the clock would time other work
        moe = replace(work.moe, num_experts=run_model.moe.num_experts, top_k=run_model.moe.top_k,
                      aux_loss_coef=run_model.moe.aux_loss_coef, capacity_factor=run_model.moe.capacity_factor,
                      recompute_activation=run_model.moe.recompute_activation)
        # the run's dense layers at the workload's MLP width (where it has none, the run's
        # width scaled as d_model is)
        dense_d_ff = work.dense_d_ff
        if run_model.dense_layers and not work.dense_layers:
            dense_d_ff = max(1, round(run_model.dense_d_ff * work.d_model / run_model.d_model))
        model = replace(work, n_layers=run_model.n_layers, max_seq_len=max(work.max_seq_len, seq_len), moe=moe,
                        activation_checkpointing=run_model.activation_checkpointing,
                        dense_layers=run_model.dense_layers, dense_d_ff=dense_d_ff)
        scale = seq_len / run_seq_len
    return EmulatedWorkload(model, seq_len, scale, make_timer(model, seq_len,
                                                              cost=emulation_cost_model(precision=precision)))


# A run's clock is faithful when no rank's padded tasks ran more than this share past their
# modelled time, summed: their slip is what the measured step can have absorbed, and 2% leaves
# most of a 5% prediction error to the model. (A count of overruns was the rule before: a
# few-microsecond overrun of a tiny task counted as much as one of many milliseconds.)
FAITHFUL_SLIP = 0.02


class EmulationWarning(UserWarning):
    """Real CPU compute took longer than the modelled device time: the clock is not faithful."""


@dataclass
class TaskStats:
    count: int = 0
    real_s: float = 0.0  # real time spent in the task before padding
    modelled_s: float = 0.0  # scaled modelled time (what the task should take)
    slept_s: float = 0.0
    overruns: int = 0  # calls whose real time exceeded the modelled time
    # seconds the overruns added beyond their modelled times: how far the clock slipped, which
    # a count of overruns cannot tell (1 us over and 100 ms over count alike)
    slip_s: float = 0.0
    worst_ratio: float = 0.0  # max real / modelled

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


TASKS = ("attention", "experts", "transfer", "head", "tail")


class Emulator:
    """One emulated device's clock. Durations returned are already times ``time_scale``.

    ``warmup_calls`` first calls of each task key are not warned about (allocator and
    thread-pool start-up, modules imported on first use: on a fresh install each first
    import compiles its bytecode inside the task), only counted: the warning judges the
    calls after them. Where the caller tells it of steps (``warmup_steps`` not ``None``,
    then :meth:`step_done` after each), the first ``warmup_steps`` steps are not judged
    either, and the warning judges at a step's end, not at an overrun: the CPU's slow start
    runs on past a key's first call (the first micro-batches of a step, a few ms past a
    clock that then holds), and judged a few tasks into a step, one such task was 20-30% of
    the time so far: a 2-step main job warned every time while its summary.json judged it
    faithful (slip 0.03-0.4%)."""

    def __init__(self, device, timer, *, link, time_scale: float = 1.0, token_scale: float = 1.0,
                 warmup_calls: int = 1, warmup_steps: int | None = None, sleep: Callable[[float], None] | None = None,
                 topology: Any = None, rank: int = 0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale={time_scale!r} is invalid: must be > 0")
        self.device, self.timer, self.link = device, timer, link
        # which link each transfer crosses (None: every transfer on ``link``), and this rank
        self.topology, self.rank = topology, rank
        self.time_scale, self.token_scale = float(time_scale), float(token_scale)
        self.warmup_calls, self.warmup_steps = warmup_calls, warmup_steps
        self._steps_done = 0
        self._latest_overrun: tuple[str, Any, float, float] | None = None
        # sleeps and stamps from one clock, this module's ``time`` (the tests run it virtually)
        self._sleep = sleep if sleep is not None else time.sleep
        self.stats: dict[str, TaskStats] = {t: TaskStats() for t in TASKS}
        self._seen: dict[Any, int] = {}
        self._warned = False
        self._needed_scale = 0.0
        # the padded tasks' modelled and slipped seconds past each key's warm-up calls: what
        # the warning judges (summary.json's slip_fraction counts every call)
        self._judged_modelled_s = 0.0
        self._judged_slip_s = 0.0
        self._lock = threading.Lock()
        self._deferred: tuple[str, Any, float, float, float] | None = None  # see defer

    # -- modelled durations (scaled) -----------------------------------------------------
    def attention(self, tokens: float, backward: bool = False) -> float:
        return self.time_scale * self.timer.attention(self.device, tokens * self.token_scale, backward)

    def head(self, tokens: float, forward_only: bool = False) -> float:
        return self.time_scale * self.timer.head(self.device, tokens * self.token_scale, forward_only=forward_only)

    def experts(self, counts, backward: bool = False) -> float:
        """Every local expert, each on its own token count."""
        return self.time_scale * sum(self.timer.expert(self.device, c * self.token_scale, backward)
                                     for c in counts if c > 0)

    def transfer(self, rows: float) -> float:
        """One leg of an exchange whose busiest link moves ``rows`` token rows."""
        return self.time_scale * self.timer.transfer(rows * self.token_scale, self.link)

    def _legs_seconds(self, legs) -> float:
        """An exchange leg that moves ``rows`` on each ``(rows, link)``: its slowest link."""
        return self.time_scale * max((self.timer.transfer(rows * self.token_scale, link) for rows, link in legs),
                                     default=0.0)

    def _topology(self, ranks: Sequence[int]):
        from ..cluster.topology import Topology

        return self.topology or Topology.flat(self.link, max(ranks) + 1)

    def round_seconds(self, rows: Sequence[Sequence[float]], groups: Sequence[Sequence[int]]) -> float:
        """A round of a group's exchange from its whole matrix (``rows[s][d]``, members in
        the order of each of ``groups``' ranks), every group taken to move the same."""
        return self._legs_seconds(self._topology([r for g in groups for r in g]).matrix_legs(rows, groups))

    def needs_matrix(self, ranks: Sequence[int]) -> bool:
        """Whether an exchange over ``ranks`` crosses nodes: its network port carries every
        rank of a node together, so its time needs every member's rows
        (:meth:`exchange_seconds`' ``rows``), not this rank's alone."""
        return self.topology is not None and len({self.topology.node_of[r] for r in ranks}) > 1

    def exchange_seconds(self, ranks: Sequence[int], send: Sequence[float], recv: Sequence[float],
                         rows: Sequence[Sequence[float]] | None = None) -> float:
        """An exchange over ``ranks``: from every member's rows where ``rows`` gives them
        (``rows[s][d]``, as the simulator prices a round: the busiest member on each node's
        link, each node's rows through its port); else from this rank's own, those to and
        from its node's ranks over the node's link, the rest through the node's network
        port, which every rank of the node is taken to load alike (what the node sums give
        under even routing; under skew a rank's port share is not the node's, which timed
        EP over two emulated servers 21% past the simulator)."""
        if rows is not None:
            return self.round_seconds(rows, [ranks])
        topo = self._topology(ranks)
        node = topo.node_of[self.rank]
        mine = list(ranks).index(self.rank)
        near = [topo.node_of[r] == node and i != mine for i, r in enumerate(ranks)]
        far = [topo.node_of[r] != node for r in ranks]
        intra = max(sum(x for x, k in zip(send, near) if k), sum(x for x, k in zip(recv, near) if k))
        inter = max(sum(x for x, k in zip(send, far) if k), sum(x for x, k in zip(recv, far) if k))
        legs = [(intra, topo.links[node])] if intra else []
        return self._legs_seconds(legs + ([(inter * len(topo.node_ranks(node)), topo.network)] if inter else []))

    def ring(self, ranks) -> Any:
        """The link a ring over ``ranks`` runs at (the emulated link without a topology)."""
        return self._topology(ranks).ring_link(list(ranks)) if ranks else self.link

    def tail(self, *, experts_held: int, has_attention: bool, replicas: int, attention_dp: int,
             replica_ranks=(), dense_ranks=()) -> float:
        """Gradient all-reduce and optimizer step of what this rank holds (as the simulator):
        each ring at its slowest hop when the ranks it runs over are given."""
        from ..simulate.step import step_tail

        return self.time_scale * step_tail(self.timer, self.timer.model, self.device, self.ring(replica_ranks),
                                           experts_held=experts_held, has_attention=has_attention,
                                           replicas=replicas, attention_dp=attention_dp,
                                           dense_link=self.ring(dense_ranks))

    # -- padding ---------------------------------------------------------------------------
    def now(self) -> float:
        """A time stamp, as :meth:`pad` takes it (the hooks drive an Emulator and a
        :class:`~.meter.BusyMeter` alike)."""
        return time.perf_counter()

    def pad(self, task: str, key: Any, started: float, modelled: float, *, already: float = 0.0,
            earlier: Sequence[tuple[float, float]] = (), done: float | None = None) -> float:
        """Sleep until ``started + modelled - already``; record and warn on overrun.

        ``already`` is task time spent in earlier segments (the task was interrupted), or
        ``earlier`` lists those segments as ``(start, end)`` stamps. ``done``: when the task's
        own work ended, if the caller did something else since inside its modelled time (an
        overrun is the work's, not that). Returns the seconds slept."""
        before = already + sum(e - s for s, e in earlier)
        now = time.perf_counter()
        real = (now if done is None else done) - started + before
        rest = modelled - (now - started + before)
        if rest > 0:
            self._sleep(rest)
        slept = max(rest, 0.0)
        with self._lock:
            st = self.stats[task]
            st.count += 1
            st.real_s += real
            st.modelled_s += modelled
            st.slept_s += slept
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            # (transfers arrive, they are not padded)
            judged = seen > self.warmup_calls and self._steps_done >= (self.warmup_steps or 0)
            if judged:
                self._judged_modelled_s += modelled
            if modelled > 0:
                st.worst_ratio = max(st.worst_ratio, real / modelled)
            if real > modelled and modelled > 0:
                st.overruns += 1
                st.slip_s += real - modelled
                if judged:
                    self._judged_slip_s += real - modelled
                    self._overrun(task, key, real, modelled)
        return slept

    def step_done(self) -> None:
        """A training step ended (its tail padded): past ``warmup_steps`` of them, the
        warning judges the steps' tasks so far."""
        with self._lock:
            self._steps_done += 1
            if self._latest_overrun is not None:
                self._judge(*self._latest_overrun, stacklevel=4)  # the step's caller

    def defer(self, task: str, key: Any, started: float, modelled: float) -> None:
        """Work of ``modelled`` seconds from ``started`` that the device runs while the host
        goes on, as a GPU runs the kernels a host queued: the next task waits for it
        (:meth:`settle`), whatever the host does meanwhile does not. Its real work is done by
        now (an overrun is counted against that, not against the wait)."""
        self.settle()
        self._deferred = (task, key, started, modelled, time.perf_counter())

    def settle(self) -> float:
        """Before a task starts: wait for deferred work to end on the modelled clock (the
        device runs in order). Returns the seconds slept."""
        if self._deferred is None:
            return 0.0
        task, key, started, modelled, done = self._deferred
        self._deferred = None
        return self.pad(task, key, started, modelled, done=done)

    def arrive(self, task: str, key: Any, at: float, modelled: float) -> None:
        """Something of ``modelled`` seconds that arrives at ``at`` (a :meth:`now` stamp): wait
        until then (the zebra exchange pads each transfer at its receiver)."""
        rest = at - time.perf_counter()
        if rest > 0:
            self._sleep(rest)
        with self._lock:
            st = self.stats[task]
            st.count += 1
            st.modelled_s += modelled
            st.slept_s += max(rest, 0.0)

    def transfer_done(self, key: Any, started: float, seconds: float) -> None:
        """An exchange returned (``started`` is when it was called): its modelled time follows
        in full (it returns when the last peer joined: the moment the modelled transfer starts)."""
        self.arrive("transfer", key, time.perf_counter() + seconds, seconds)

    def _overrun(self, task: str, key: Any, real: float, modelled: float) -> None:
        needed = self.time_scale * real / modelled if modelled > 0 else math.inf
        self._needed_scale = max(self._needed_scale, needed)
        if self.warmup_steps is None:
            self._judge(task, key, real, modelled, stacklevel=4)  # the padded task's caller
        else:
            self._latest_overrun = (task, key, real, modelled)

    def _judge(self, task: str, key: Any, real: float, modelled: float, stacklevel: int) -> None:
        if self._warned:
            return
        # one task's hiccup (the OS, the collector) is not a clock that slips: warn once the
        # tasks so far (past their warm-up calls) have run past what a faithful run allows,
        # as summary.json will judge the run
        slip = self._judged_slip_s / self._judged_modelled_s if self._judged_modelled_s > 0 else 0.0
        if slip <= FAITHFUL_SLIP:
            return
        self._warned = True
        msg = (f"emulated {self.device.name}: its tasks so far ran {slip:.1%} past their modelled time (a faithful "
               f"run: slip_fraction <= {FAITHFUL_SLIP:g}); the latest, {task} {key}, took {real * 1e3:.2f} ms of "
               f"real CPU compute against its modelled {modelled * 1e3:.2f} ms at cluster.time_scale="
               f"{self.time_scale:g}: cluster.time_scale >= {math.ceil(self._needed_scale):d} would have covered it "
               f"and every overrun before it (warned once; summary.json's emulation says whether the whole run "
               f"stayed faithful)")
        warnings.warn(msg, EmulationWarning, stacklevel=stacklevel)

    @property
    def needed_time_scale(self) -> float:
        """Smallest time_scale that would have covered every overrun seen after warm-up (0 if none)."""
        return self._needed_scale

    def summary(self) -> dict[str, Any]:
        padded = [s for k, s in self.stats.items() if k != "transfer"]
        tasks = sum(s.count for s in padded)
        overruns = sum(s.overruns for s in padded)
        return {"device": self.device.name, "time_scale": self.time_scale, "token_scale": self.token_scale,
                "needed_time_scale": self._needed_scale, "padded_tasks": tasks, "overruns": overruns,
                "slip_s": sum(s.slip_s for s in padded), "modelled_s": sum(s.modelled_s for s in padded),
                "tasks": {k: v.as_dict() for k, v in self.stats.items()}}


def rank_emulator(cluster: Any, rank: int, workload: EmulatedWorkload, warmup_calls: int = 1,
                  warmup_steps: int | None = None) -> Emulator:
    from ..cluster.devices import get_device

    if not 0 <= rank < cluster.world_size:
        raise ValueError(f"global_rank={rank} is outside cluster '{cluster.name}' of {cluster.world_size} ranks")
    from ..cluster.topology import cluster_topology

    device = get_device(cluster.devices[rank], cluster.custom_devices)
    return Emulator(device, workload.timer, link=cluster.bottleneck_link, time_scale=cluster.time_scale,
                    token_scale=workload.token_scale, warmup_calls=warmup_calls,
                    warmup_steps=warmup_steps, topology=cluster_topology(cluster), rank=rank)
