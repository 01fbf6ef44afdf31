"""``ExpertRebalancer``: re-place experts from measured loads while training runs.

Right after ``warmup_steps`` and every ``every_n_steps`` after that, rank 0 takes the
:class:`~.load_monitor.ExpertLoadMonitor`'s moving average of each expert's share and the
devices' per-token expert cost (the run's own clock: cost model, profile or emulated
workload), and computes a new placement with
:func:`lightning_hetermoe.plan.rebalance.rebalance`: the predicted maximum per-holder
*time* of every layer's expert phase is minimised (tokens x the device's cost), and experts
too hot for any single holder get copies (``redundant_experts`` > 0, expert parallelism).
That start is then refined one move at a time while the simulator, fed the measured loads,
predicts a faster step (so transfers and the schedule count, not only the expert phase).
Under local-first dispatch a copy serves its own holder's tokens, however slow the holder;
so each candidate with copies is also priced with routes that split a copied expert's
tokens over its copies by the holders' time (the fast holder takes part of the slow one's
share: local first, then the least loaded), and the placement carries them when they win.
Under zebra the same search may move experts onto attention ranks: Asym-EA re-run with
measured times.

It applies the placement only if the predicted gain per step, priced at each of the recent
steps' own routings (up to ``RECENT_STEPS`` since the last check; the search itself prices
at the moving average), is at least ``min_gain`` of the step and, over ``amortize_steps``
steps (how long a placement is expected to last), outweighs the migration (every moved
copy's weights and optimizer state over the link). Every rank then moves experts in place
(:meth:`HeterMoEStrategy.move_experts`): weights and every optimizer tensor travel with
their expert. What moved, the predicted gain and the measured migration time go to the
loggers (``rebalance/...``) and to ``decisions``.

The placement is part of the callback's state: a run resumed on the same world and devices
moves back to it; on another mix it starts from the plan.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L

from ..configs import ConfigError
from ..placement import Placement
from ..plan.rebalance import balanced_routes, rebalance, refine
from .load_monitor import ExpertLoadMonitor

log = logging.getLogger(__name__)
POLICIES = ("time", "eplb")
RECENT_STEPS = 16  # the most recent steps whose own routings price a move's gain


class ExpertRebalancer(L.Callback):
    """Re-places experts from the measured loads (an :class:`ExpertLoadMonitor` among the
    callbacks) after ``warmup_steps`` and every ``every_n_steps``, where the predicted gain
    is at least ``min_gain`` of a step and pays for the move within ``amortize_steps``;
    ``redundant_experts`` copies of the hottest under expert parallelism. See the module
    docstring."""

    def __init__(self, every_n_steps: int = 50, warmup_steps: int = 10, policy: str = "time",
                 redundant_experts: int = 0, capacity_slack: float = 2.0, min_gain: float = 0.02,
                 amortize_steps: int | None = 500) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"ExpertRebalancer policy={policy!r} is invalid: must be one of {POLICIES}")
        for name, value, least in (("every_n_steps", every_n_steps, 1), ("warmup_steps", warmup_steps, 0),
                                   ("redundant_experts", redundant_experts, 0), ("capacity_slack", capacity_slack, 1),
                                   ("min_gain", min_gain, 0), ("amortize_steps", amortize_steps, 1)):
            if value is not None and value < least:  # (amortize_steps=None: over every_n_steps)
                raise ConfigError(f"ExpertRebalancer {name}={value!r} is invalid: must be >= {least}")
        self.every_n_steps, self.warmup_steps, self.policy = every_n_steps, warmup_steps, policy
        self.redundant, self.capacity_slack, self.min_gain = redundant_experts, capacity_slack, min_gain
        self.amortize_steps = amortize_steps
        self.decisions: list[dict[str, Any]] = []
        self._saved: dict[str, Any] | None = None
        self._checked = -1

    # -- wiring -----------------------------------------------------------------------------
    def _monitor(self, trainer) -> ExpertLoadMonitor:
        for cb in trainer.callbacks:
            if isinstance(cb, ExpertLoadMonitor):
                return cb
        raise ConfigError("ExpertRebalancer needs an ExpertLoadMonitor among the trainer's callbacks: it balances "
                          "the loads the monitor measures")

    def setup(self, trainer, pl_module, stage: str) -> None:
        from ..strategy import HeterMoEStrategy

        if not isinstance(trainer.strategy, HeterMoEStrategy):
            raise ConfigError("ExpertRebalancer works with HeterMoEStrategy (strategy='hetermoe'), which places "
                              "experts")
        self._monitor(trainer)
        self._trainer = trainer

    def on_fit_start(self, trainer, pl_module) -> None:
        # the strategy has chosen what runs by now (mode="auto" resolves at its set-up)
        if trainer.strategy.schedule in ("zebra", "distep") and self.redundant:
            raise ConfigError("ExpertRebalancer redundant_experts > 0 (expert copies) needs expert parallelism; zebra "
                              "and distep move whole experts only")

    def _signature(self, trainer) -> dict[str, Any]:
        return {"mode": trainer.strategy.schedule, "world": trainer.world_size, "holders": trainer.strategy.holders()}

    def on_train_start(self, trainer, pl_module) -> None:
        self._checked = trainer.global_step
        saved = self._saved
        if saved is not None and saved.get("signature") == self._signature(trainer):
            placement = Placement(saved["placement"], saved.get("routes"))
            if placement != trainer.strategy.placement:
                trainer.strategy.move_experts(placement)  # the rebalanced placement comes back

    # -- the check ------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._checked or step < self.warmup_steps or (step - self.warmup_steps) % self.every_n_steps:
            return
        self._checked = step
        self._monitor(trainer).flush(trainer, pl_module)  # this step's routing too (every rank: they are summed)
        decision = self.decide(trainer) if trainer.global_rank == 0 else None
        decision = trainer.strategy.broadcast(decision, src=0)
        if decision is None:
            return
        if decision["apply"]:
            t0 = time.perf_counter()
            moved = trainer.strategy.move_experts(Placement(decision["placement"], decision.get("routes")))
            decision["migration_s"] = time.perf_counter() - t0
            decision["moved"] = moved
        decision["step"] = step
        self.decisions.append({k: v for k, v in decision.items() if k not in ("placement", "routes")})
        if trainer.global_rank == 0:
            metrics = {"rebalance/applied": float(decision["apply"]), "rebalance/moves": float(decision["moves"]),
                       "rebalance/predicted_gain_s": decision["predicted_gain_s"],
                       "rebalance/migration_s": decision.get("migration_s", 0.0)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            done = f"moved {decision['moves']} expert copies" + (" and routed copies" if decision.get("routed") else "")
            log.info(f"rebalance at step {step}: {done if decision['apply'] else 'kept the placement'}, "
                     f"predicted step {decision['predicted_before_s'] * 1e3:.1f} -> "
                     f"{decision['predicted_after_s'] * 1e3:.1f} ms/step")

    def decide(self, trainer) -> dict[str, Any] | None:
        """Rank 0: the placement to move to, and whether moving pays.

        Candidates start from a per-layer time-balanced packing (copies only for experts
        above a fair share, and, with copies allowed, every redundant slot spent) and from
        EPLB's packing (same budget of copies); the fastest by the simulator (measured
        loads, the run's replica dispatch: transfers and the schedule count, not only the
        expert phase) is refined one move at a time. Where copies exist under local-first
        dispatch on one EP group, every candidate is also priced with routes: each copied
        expert's tokens split over its copies to balance the holders' expert time
        (:func:`~lightning_hetermoe.plan.rebalance.balanced_routes`), and the faster of the
        two is what the candidate scores.
        ``policy="eplb"`` takes EPLB's packing as it is (the baseline)."""
        monitor = self._monitor(trainer)
        share = monitor.load_share()
        strategy = trainer.strategy
        clock = strategy.clock
        if share is None or not clock.bound or monitor.last_counts is None or strategy.cluster is None:
            return None
        from ..cluster.devices import get_device

        specs = [get_device(name, strategy.cluster.custom_devices) for name in strategy.holders()]
        # routed choices per layer, of one group of holders (the monitor counts the world's;
        # groups alike, each routes its share: one EP group of ep_size ranks, one ZP group)
        tokens = float(monitor.last_counts.sum(1).double().mean()) * clock.token_scale * len(specs) / trainer.world_size

        def cost(h: int, t: float) -> float:
            return clock.expert_seconds(specs[h], t)

        routing = strategy.copy_routing() if self.redundant else None
        nodes = routing[2] if routing else None
        tried: dict[str, tuple[float, Placement]] = {}
        layer_routes: dict[tuple[int, str], list] = {}  # a refinement step changes one layer

        def routes_of(l: int, layer: list[list[int]]) -> list:
            key = (l, repr(layer))
            if key not in layer_routes:
                layer_routes[key] = balanced_routes(layer, [x * tokens for x in share[l]], cost, routing[1], nodes)
            return layer_routes[key]

        def best(held: list[list[list[int]]]) -> tuple[float, Placement]:
            """The faster of ``held`` under the run's rule alone and, where copies may be
            routed (local first), with each copied expert's tokens balanced over its copies."""
            key = repr(held)
            if key not in tried:
                options = [Placement(held)]
                if routing and routing[0] == "local_first" and options[0].replicated:
                    options.append(Placement(held, [routes_of(l, layer) for l, layer in enumerate(held)]))
                tried[key] = min(((strategy.predict(p, share)["device_step_time_s"], p) for p in options),
                                 key=lambda x: x[0])
            return tried[key]

        def score(held: list[list[list[int]]]) -> float:
            return best(held)[0]

        placed = strategy.placement
        current = placed.to_lists()
        E, H = len(share[0]), len(specs)
        redundant = self.redundant
        if strategy.schedule in ("zebra", "distep"):
            # expert ranks trade experts; attention ranks may take more (Asym-EA, measured)
            M = len(strategy.plan.zp_groups[0].attention_ranks)
            held = [max(len(row[h]) for row in current) for h in range(H)]
            capacity = [held[h] + 2 if h < M else math.ceil(E / max(H - M, 1) * self.capacity_slack)
                        for h in range(H)]
            redundant = 0
        else:
            capacity = [math.ceil(E / H * self.capacity_slack) + redundant] * H
        eplb, *_ = rebalance(share, tokens, current, cost, capacity, redundant, "eplb")
        if self.policy == "eplb":
            chosen = Placement(eplb)
            t_new = strategy.predict(chosen, share)["device_step_time_s"]
        else:
            # with copies, also every redundant slot spent: a copy keeps its holder's own
            # tokens at home (local-first dispatch), which the fair-share rule does not weigh
            starts = [eplb] + [rebalance(share, tokens, current, cost, capacity, redundant, policy)[0]
                               for policy in (("time", "time_fill") if redundant else ("time",))]
            new, t_new = refine(min(starts, key=score), score, capacity)
            chosen = best(new)[1]
        # The search prices candidates at the moving average of the routing (one simulation
        # each); whether the move pays is priced at the recent steps' own routings, step by
        # step, as the set-up's prediction is: a step's time follows its own batch's routing,
        # and the zebra step is not linear in it (A40+V100 under zebra, two hot experts: a
        # move the average priced 2.8% faster was 0.1% at each timed step's routing, and
        # measured 1.3% slower)
        # (a step is recorded: last_counts was checked above)
        recent = monitor.step_shares(skip=0, last=min(self.every_n_steps, RECENT_STEPS))

        def at_steps(p: Placement) -> float:
            return strategy.predict(p, None, recent)["device_step_time_s"]

        t_now = at_steps(placed)  # with the routes it runs
        t_new = at_steps(chosen) if chosen != placed else t_now
        if t_new >= t_now * (1 - 1e-9):
            chosen, t_new = placed, t_now
        moves = chosen.moved_copies(placed)
        migration = clock.timer.comm(clock.expert_bytes() * moves, strategy.cluster.bottleneck_link) if moves else 0.0
        gain = t_now - t_new
        horizon = self.amortize_steps or self.every_n_steps
        # new routes alone move no weights: they apply at no migration cost
        apply = chosen != placed and gain > 0 and gain >= self.min_gain * t_now and gain * horizon > migration
        return {"apply": bool(apply), "placement": chosen.to_lists(), "routes": chosen.routes_lists(),
                "moves": moves, "routed": chosen.routes is not None, "predicted_before_s": t_now,
                "predicted_after_s": t_new, "predicted_gain_s": gain, "migration_cost_s": migration}

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        saved = self._saved
        placement = trainer.strategy.placement if trainer is not None else None
        if placement is not None:
            saved = {"placement": placement.to_lists(), "routes": placement.routes_lists(),
                     "signature": self._signature(trainer)}
        return {"saved": saved, "decisions": self.decisions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = state.get("saved")
        self.decisions = list(state.get("decisions", []))

