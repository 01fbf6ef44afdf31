"""The clock a run is planned, emulated and predicted with, and the timing of its steps.

* **Whose time.** An emulated cluster's workload clock (``cluster.emulate_workload``), a
  measured profile (``profile=``), or the cost model of the model actually run.
* **Predictions.** The simulator's step time for what the backend runs (its plan, or the
  EP layout), with even routing or with measured loads, and with another placement than
  the current one (what the rebalancer compares candidates by).
* **Step timing.** Wall time per optimizer step, the step's tail padded to its modelled
  time under emulation, and the busy split of ranks whose tasks the emulated clock or a
  :class:`~lightning_hetermoe.emulate.BusyMeter` times (expert parallelism).

Callbacks and recipes read it through ``HeterMoEStrategy.clock``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..cluster import ClusterConfig, DeviceSpec
from ..configs import ModelConfig
from ..routing_record import hottest_over_mean
from .backends.base import Simulated, TailShape


class RunClock:
    def __init__(self, cluster: ClusterConfig | None, profile: Any, rank: int) -> None:
        self.cluster, self.profile, self.rank = cluster, profile, rank
        self.model: ModelConfig | None = None  # the model the clock times (the workload's under emulation)
        self.seq_len = 0  # the clock's tokens per sequence
        self.run_seq_len = 0  # the run's own tokens per sequence
        self.per_rank = 0  # sequences per rank per step
        self.world_size = 1
        self.timer: Any = None
        self.optimizer: Any = None  # the run's optim config (None: priced as unfused AdamW)
        self.weight_averages = 0  # copies of the weights the run keeps on the device (weight averaging)
        self.workload: Any = None  # EmulatedWorkload under emulation
        self.emulator: Any = None  # this rank's emulated clock
        self.meter: Any = None  # BusyMeter on real devices, when a monitor asked for busy time
        self.devices: list[DeviceSpec] = []
        # which link each transfer crosses: the cluster config's, or detected from the
        # ranks' hostnames on GPUs without one (None: one node on the default link)
        self.topology: Any = None
        # the routing the predictions assume, measured at set-up on a few sampled global
        # batches through the freshly initialised routers (None: even): each batch's, per
        # layer each expert's share, and their pooled shares (what the planner searches at)
        self.batch_loads: list[list[list[float]]] | None = None
        self.expert_load: list[list[float]] | None = None
        # where that routing came from, as summary.json says it
        self.routing_source = "even routing"
        self.prediction: dict[str, Any] | None = None
        self.last_step_s: float | None = None
        self._step_started: float | None = None
        self._step_stamp: Any = None  # the meter's stamp at the step's start (a CUDA event on a GPU)
        # the step on the device's clock (the clock self-timed tasks are on): stopwatch, start, end
        self._device_step: tuple[Any, Any, Any] | None = None
        self._device_step_s: float | None = None
        # fixed once the clock is bound: asked again by every prediction (a rebalancer asks many)
        self._links: Any = None
        self._bound: float | None = None
        self._busy_mark: dict[str, float] | None = None
        self._last_busy: dict[str, float] | None = None

    # -- binding to a run ---------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.timer is not None

    def bind(self, run_model: ModelConfig, per_rank: int, seq_len: int, world_size: int,
             devices: list[DeviceSpec], precision: str = "32-true", optimizer: Any = None,
             weight_averages: int = 0) -> None:
        """Fix the clock to the run's model, batch shape and precision (once, at the first
        set-up). An emulated cluster's clock runs the workload's own precision.
        ``optimizer``: the run's ``optim`` config, whose state EP's and data-centric's
        predictions price and whose step's traffic every prediction's tail does (``None``:
        unfused AdamW), beside ``weight_averages`` copies of the weights kept on the device
        (Lightning's weight averaging). An emulated cluster's clock is its workload's (the
        pack's default step)."""
        from ..emulate import emulated_workload, rank_emulator
        from ..profile.cost_model import CostModel, optimizer_step_traffic, tf32_allowed
        from ..profile.timer import make_timer

        self.per_rank, self.run_seq_len, self.world_size, self.devices = per_rank, seq_len, world_size, devices
        self.optimizer, self.weight_averages = optimizer, weight_averages
        self._links = self._bound = None
        if self.cluster is not None and self.cluster.emulate:
            self.workload = emulated_workload(self.cluster, run_model, seq_len)
            self.model, self.seq_len, self.timer = self.workload.model, self.workload.seq_len, self.workload.timer
            # the strategy tells it of steps: its first (the run's timing warm-up) is not judged
            self.emulator = rank_emulator(self.cluster, self.rank, self.workload, warmup_steps=1)
        else:
            self.model, self.seq_len = run_model, seq_len
            cost = CostModel(precision=precision, tf32=tf32_allowed(precision),
                             optimizer_bytes_per_param=optimizer_step_traffic(optimizer))
            self.timer = make_timer(run_model, seq_len, self.profile, cost)

    def install(self, module: torch.nn.Module, device: torch.device, measure_busy: bool) -> Any:
        """Hooks on a model that runs its own tasks (expert parallelism, one device): the
        emulated clock pads them, or a :class:`BusyMeter` times them on the real device when
        a monitor asked for busy time. Returns the handle to remove them, or ``None``."""
        from ..emulate import BusyMeter, install

        if self.emulator is not None:
            return install(module, self.emulator, head=True)
        if measure_busy:
            self.meter = self.meter or BusyMeter(device)
            return install(module, self.meter, head=True)
        return None

    @property
    def token_scale(self) -> float:
        """Clock tokens per real token (1 unless a workload clock stands for larger sequences)."""
        return self.workload.token_scale if self.workload is not None else 1.0

    @property
    def tokens_per_step(self) -> int:
        """Tokens of a global batch, at the clock's sequence length."""
        return self.per_rank * self.world_size * self.seq_len

    @property
    def time_scale(self) -> float:
        return self.cluster.time_scale if self.cluster is not None and self.cluster.emulate else 1.0

    # -- predictions --------------------------------------------------------------------
    def links(self) -> Any:
        """The topology the predictions price transfers with."""
        from ..cluster.topology import Topology, cluster_topology

        if self.topology is not None and self.cluster is None:
            return self.topology  # detected after binding: not cached
        if self._links is None:
            self._links = cluster_topology(self.cluster) if self.cluster is not None else \
                Topology.flat(ClusterConfig().link, max(self.world_size, len(self.devices), 1))
        return self._links

    def loads(self, expert_load: list[list[float]] | None = None,
              batch_loads: list[list[list[float]]] | None = None) -> list[list[list[float]] | None]:
        """The routings a prediction averages over: ``expert_load`` alone if given, else
        ``batch_loads`` (each batch's), else the batches measured at set-up, else even
        routing (``[None]``)."""
        if expert_load is not None:
            return [expert_load]
        return list(batch_loads or self.batch_loads or [self.expert_load])

    def step_time(self, sim: Simulated, expert_load: list[list[float]] | None = None,
                  batch_loads: list[list[list[float]]] | None = None) -> float:
        """The simulator's device seconds per step for ``sim``: the mean over the routings of
        :meth:`loads` of the step at each (a step's time follows its own batch's routing, and
        the busiest expert's share is higher batch by batch than pooled). Without a plan
        the batch is the run's, every rank's sequences in one micro-batch."""
        steps = self.step_times(sim, expert_load, batch_loads)
        return sum(steps) / len(steps)

    def step_times(self, sim: Simulated, expert_load: list[list[float]] | None = None,
                   batch_loads: list[list[list[float]]] | None = None) -> list[float]:
        """:meth:`step_time` routing by routing."""
        from ..simulate import predict_step

        return [predict_step(sim.schedule, self.devices, self.model, self.links(), self.timer, plan=sim.plan,
                             seq_len=self.seq_len, total_seqs=self.per_rank * self.world_size, num_microbatches=1,
                             placement=sim.placement, ep_size=sim.ep_size, expert_load=load,
                             replica_dispatch=sim.replica_dispatch, optimizer=self.optimizer,
                             weight_averages=self.weight_averages).step_time
                for load in self.loads(expert_load, batch_loads)]

    def ep_step_times(self, schedule: str) -> dict[int, float]:
        """:meth:`step_time` of EP at each group size (``expert_parallel_size``) a run can be
        set to, largest first (:func:`~lightning_hetermoe.simulate.ep_groups.ep_group_sizes`).
        A group smaller than the world counts only where each rank holds its experts and
        its share of the batch in one micro-batch, as the EP backend runs it (each holds
        more experts than in one world-wide group, which is always priced, as before)."""
        from ..simulate import ep_setup
        from ..simulate.ep_groups import ep_group_sizes

        times: dict[int, float] = {}
        for k in ep_group_sizes(self.links(), self.world_size):
            if k < self.world_size:
                try:  # the layout alone (its fewest micro-batches), nothing simulated
                    fits = ep_setup(self.devices, self.model, seq_len=self.seq_len,
                                    total_seqs=self.per_rank * self.world_size, link=self.links(), timer=self.timer,
                                    balanced=schedule == "ep_balanced", ep_size=k, optimizer=self.optimizer,
                                    weight_averages=self.weight_averages).num_microbatches == 1
                except ValueError:
                    fits = False
                if not fits:
                    continue
            times[k] = self.step_time(Simulated(schedule, ep_size=k))
        return times

    def predict(self, sim: Simulated, expert_load: list[list[float]] | None = None,
                batch_loads: list[list[list[float]]] | None = None) -> dict[str, Any] | None:
        """The predicted step of this very run, in wall seconds (scaled like the emulated
        clock), at the routings of :meth:`loads`; ``None`` without a cluster config (no
        device names to predict for)."""
        if self.cluster is None or not self.bound:
            return None
        from ..simulate.bound import throughput_bound

        steps = self.step_times(sim, expert_load, batch_loads)
        step = sum(steps) / len(steps)
        if self._bound is None:
            self._bound = throughput_bound(self.devices, self.timer, self.model, self.seq_len, self.tokens_per_step)
        bound = self._bound
        tokens = self.tokens_per_step * (sim.plan.waves if sim.plan is not None else 1)  # a plan's step is its waves
        # how far one step strays from the mean by its batch's routing alone (standard
        # deviation over the mean): a run timed over few steps is that far off by chance
        spread = (sum((t - step) ** 2 for t in steps) / len(steps)) ** 0.5 / step if step > 0 else 0.0
        return {"schedule": sim.schedule, "step_time_s": step * self.time_scale, "device_step_time_s": step,
                "step_time_batch_spread": spread,
                # each routing's step (each held-out batch's, or each measured step's)
                "step_times_s": [t * self.time_scale for t in steps],
                "workload_tokens_per_step": tokens,
                # what no schedule beats on these devices, and this run's predicted share of it
                "bound_tokens_per_s": bound,
                "fraction_of_bound": tokens / step / bound if step > 0 and bound > 0 else None,
                "expert_load_max_over_mean": max_over_mean(self.loads(expert_load, batch_loads)),
                "routing": "as given" if expert_load is not None or batch_loads else self.routing_source}

    def expert_seconds(self, device: DeviceSpec, tokens: float) -> float:
        """One expert on ``tokens`` (clock tokens) on ``device``."""
        return self.timer.expert(device, tokens) if tokens > 0 else 0.0

    def expert_bytes(self) -> float:
        """Bytes to move one expert copy: weights and optimizer state, at the clock's sizes."""
        from ..profile.memory import MemoryModel

        memory = MemoryModel.for_optimizer(self.model, self.optimizer, self.weight_averages)
        return memory.expert_params() * memory.bytes_per_param

    def speed_shares(self, total: int) -> list[int]:
        """Sequences per rank in proportion to each device's attention speed (``ep_balanced``)."""
        from ..simulate.schedules import ep_balanced_shares, ep_speed

        return ep_balanced_shares(total, [ep_speed(d, self.timer, self.model, self.seq_len) for d in self.devices])

    # -- steps --------------------------------------------------------------------------
    def step_started(self, device: torch.device | None = None) -> None:
        from ..emulate.meter import Stopwatch

        if self._step_started is not None:
            return  # gradient accumulation: the optimizer step began with its first batch
        self._step_started = time.perf_counter()
        watch = Stopwatch(device if device is not None else "cpu")
        self._device_step = (watch, watch.now(), None)
        if self.emulator is not None:
            self._busy_mark = {k: v.modelled_s for k, v in self.emulator.stats.items()}
        elif self.meter is not None:
            self.meter.reset()  # validation since the last step is not this step's work
            self._step_stamp = self.meter.now()

    def step_ended(self, tail_started: float | None, tail: TailShape) -> None:
        """After the optimizer: pad the tail (emulation; a carried one when the next step's
        first task starts), record the step's time and busy split."""
        if tail_started is not None and self.emulator is not None:
            modelled = self.emulator.tail(experts_held=tail.experts_held, has_attention=tail.has_attention,
                                          replicas=tail.replicas, attention_dp=tail.attention_dp,
                                          replica_ranks=tail.replica_ranks, dense_ranks=tail.dense_ranks)
            if tail.carried:  # the next step's first task waits for it, the host does not
                self.emulator.defer("tail", "tail", tail_started, modelled)
            else:
                self.emulator.pad("tail", "tail", tail_started, modelled)
        if self.emulator is not None:
            self.emulator.step_done()
        if self._step_started is None:
            return
        self.last_step_s = time.perf_counter() - self._step_started
        self._step_started = None
        if self._device_step is not None:
            watch, start, _ = self._device_step
            self._device_step, self._device_step_s = (watch, start, watch.now()), None
        if self.meter is not None and self.emulator is None and self._step_stamp is not None:
            # busy spans are device time: the step they are set against is too
            self.last_step_s = self.meter.elapsed_since(self._step_stamp)
            self._step_stamp = None
        if self.emulator is not None and self._busy_mark is not None:
            now = {k: v.modelled_s for k, v in self.emulator.stats.items()}
            d = {k: now[k] - self._busy_mark.get(k, 0.0) for k in now}
            self._last_busy = {"attention": d["attention"] + d["head"] + d["tail"], "experts": d["experts"],
                               "comm": d["transfer"]}
        elif self.meter is not None:
            d = self.meter.take()
            self._last_busy = {"attention": d["attention"] + d["head"], "experts": d["experts"],
                               "comm": d["transfer"]}

    def device_step_s(self) -> float | None:
        """The last step on the device's clock (CUDA events on a GPU, the host clock on the
        CPU), the clock self-timed tasks are on. Read when asked: one sync on the step's end
        event, free once the step's own host sync passed it."""
        if self._device_step_s is None and self._device_step is not None and self._device_step[2] is not None:
            watch, start, end = self._device_step
            watch.sync(end)
            self._device_step_s = watch.seconds(start, end)
        return self._device_step_s

    def busy(self) -> dict[str, float] | None:
        """The last step's busy split from the emulated clock or the meter, idle included."""
        if self.last_step_s is None or self._last_busy is None:
            return None
        busy = dict(self._last_busy)
        busy["idle"] = max(self.last_step_s - busy["attention"] - busy["experts"] - busy["comm"], 0.0)
        return busy

    def emulation_summary(self) -> dict[str, Any] | None:
        return self.emulator.summary() if self.emulator is not None else None


def max_over_mean(loads: list[list[list[float]] | None]) -> float:
    """The busiest expert's share over the mean share, in its layer, of each routing in
    ``loads`` (``None``: even, 1), averaged: how uneven a step's own routing is."""
    worst = [hottest_over_mean(load) for load in loads]
    return sum(worst) / len(worst)
