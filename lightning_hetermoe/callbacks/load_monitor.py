"""``ExpertLoadMonitor``: how the experts and the ranks are loaded, step by step.

* **Expert load.** Every MoE layer's kept routing choices per expert, summed over the
  global batch of each optimizer step (all micro-batches, accumulation batches and ranks;
  a forward hook reads them from the layer's ``MoEAux``). A moving average of each
  expert's share is what :class:`~.rebalancer.ExpertRebalancer` balances. A step's counts
  reach the host while the next step runs, are summed over the ranks while the one after
  runs, and are recorded at its end (at the end of training, before a checkpoint, and when
  the rebalancer looks, at once): reading them at once would make the host wait for the
  whole step's device work every step, and waiting for their sum at once would hold every
  rank at the step's end until the slowest got there (a barrier per step: under zebra on
  the emulated clock, the attention ranks through the expert ranks' optimizer step).
* **Rank load.** Each rank's time in the step, split into attention, experts,
  communication and idle (:meth:`HeterMoEStrategy.rank_busy`: the zebra executor's trace,
  the emulated clock, or under EP on real devices each task's measured span, CUDA events
  on a GPU).
* **Balancing bias.** For routers with ``expert_bias`` (aux-loss-free balancing), each
  layer's bias spread (max - min).
* **Imbalance.** Per layer the busiest expert against the mean (1.0 is perfect), and the
  slowest rank with its margin over the mean busy time.

Every ``log_every_n_steps`` the figures go to the trainer's loggers under ``moe_load/...``
and ``rank_busy/...`` (names that read well in TensorBoard and CSV). At the end of fit the
global rank 0 writes ``expert_load.png`` (layer x expert load over steps),
``rank_utilisation.png`` and ``expert_load.json`` (each expert's share over the steps after
the first: a :class:`~lightning_hetermoe.routing_record.RoutingRecord`, what
``recipes/plan.py plan.expert_load=...`` plans at) into ``output_dir`` (default: the
trainer's ``default_root_dir``); ``plots=False`` writes none of them.
The monitor has a ``state_dict``, so a resumed run keeps its averages and history.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

import lightning_hetermoe.comm as comm
from ..configs import ConfigError
from ..model_contract import moe_layers
from ..moe.expert_bias import is_first_training_forward
from ..routing_record import FILE_NAME as ROUTING_FILE
from ..routing_record import RoutingRecord

BUSY_KINDS = ("attention", "experts", "comm", "idle")
# The recorded steps a resumed run plans at (:meth:`ExpertLoadMonitor.saved_routing`): the
# routing keeps moving as the model trains, so the newest steps, not the whole run's mean
RESUME_STEPS = 64


class ExpertLoadMonitor(L.Callback):
    """Logs each expert's share of the routing and each rank's busy time every
    ``log_every_n_steps`` optimizer steps, keeps a moving average of the shares
    (``ema_decay``) for :class:`ExpertRebalancer`, and at the end of fit (unless
    ``plots=False``) writes ``expert_load.json`` and its figures into ``output_dir`` (the
    trainer's ``default_root_dir`` where not given). See the module docstring."""

    def __init__(self, log_every_n_steps: int = 10, ema_decay: float = 0.9, plots: bool = True,
                 output_dir: str | None = None, history: int = 10000) -> None:
        if log_every_n_steps < 1:
            raise ConfigError(f"ExpertLoadMonitor log_every_n_steps={log_every_n_steps} is invalid: must be >= 1")
        if not 0 <= ema_decay < 1:
            raise ConfigError(f"ExpertLoadMonitor ema_decay={ema_decay} is invalid: must be in [0, 1)")
        self.log_every_n_steps, self.ema_decay, self.plots = log_every_n_steps, ema_decay, plots
        self.output_dir, self.max_history = output_dir, history
        self.ema: torch.Tensor | None = None  # [L, E] moving average of each expert's share
        self.history: list[list[list[int]]] = []  # per step, [L][E] tokens
        self.busy_history: list[list[dict[str, float] | None]] = []  # per logged step, per rank
        self.last_counts: torch.Tensor | None = None
        self._step_counts: torch.Tensor | None = None
        self._layers = 0
        self._hooks: list[Any] = []
        self._seen_step = -1
        # the last step's counts on their way to the host, its step and busy split
        self._queued: tuple[comm.HostCopy | None, int, dict[str, float] | None] | None = None
        # the step before: its counts being summed over the ranks, its step and busy split
        self._summing: tuple[comm.Pending | None, torch.Tensor, int, dict[str, float] | None] | None = None

    # -- collection -----------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()
        if hasattr(trainer.strategy, "measure_busy"):
            trainer.strategy.measure_busy = True  # before the strategy's set-up: EP ranks on real devices time their tasks
        layers = [layer for _, layer in moe_layers(pl_module)]
        if not layers:
            return
        self._layers = len(layers)
        self._step_counts = None  # on the layers' device, made at the first forward
        self._queued = self._summing = None

        def hook(l: int):
            def record(module, args, output):
                aux = module.aux_of(output)
                if aux is not None and is_first_training_forward(module):
                    counts = aux.tokens_per_expert.detach()
                    if self._step_counts is None:
                        self._step_counts = counts.new_zeros(self._layers, counts.shape[0])
                    # stays on the device: one copy to the host per step, not one per layer
                    self._step_counts[l] += counts

            return record

        self._hooks = [layer.register_forward_hook(hook(l)) for l, layer in enumerate(layers)]

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step  # a step ends when the global step moves on

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._hooks or trainer.global_step == self._seen_step:
            return  # no MoE layer, or still accumulating gradients
        step = self._seen_step = trainer.global_step
        busy = self._busy(trainer) if step % self.log_every_n_steps == 0 else None  # this step's, read now
        # This step's counts start for the host now and are read at the end of the next step,
        # long arrived: reading them here would make the host wait for the whole step's
        # device work (a sync per step) before it could queue the next step's. Their sum over
        # the ranks is waited for a step later still, when it is long in: a blocking sum here
        # would be a barrier at every step's end.
        copy = comm.HostCopy(self._step_counts) if self._step_counts is not None else None
        self._step_counts = None
        previous, self._queued = self._queued, (copy, step, busy)
        if previous is not None:
            self._record(trainer)
            self._summing = self._sum(pl_module, *previous)

    def on_train_end(self, trainer, pl_module) -> None:
        self.flush(trainer, pl_module)

    def flush(self, trainer, pl_module) -> None:
        """Record the last step, whose counts are otherwise read at the end of the next one
        (every rank calls it at the same point: the counts are summed over the ranks)."""
        self._record(trainer)
        queued, self._queued = self._queued, None
        if queued is not None:
            self._summing = self._sum(pl_module, *queued)
            self._record(trainer)

    def _sum(self, pl_module, copy: comm.HostCopy | None, step: int, busy: dict[str, float] | None
             ) -> tuple[comm.Pending | None, torch.Tensor, int, dict[str, float] | None]:
        """Start summing a step's counts over the ranks (every rank's share of the global batch)."""
        E = next(layer for _, layer in moe_layers(pl_module)).num_experts
        # a rank that routes nothing (an expert rank) adds zeros
        counts = copy.get() if copy is not None else torch.zeros(self._layers, E, dtype=torch.long, device="cpu")
        pending = None
        if dist.is_available() and dist.is_initialized():
            pending = comm.host_all_reduce(comm.world(), counts, what="monitor.counts", async_op=True)
        return pending, counts, step, busy

    def _record(self, trainer) -> None:
        """Record the step whose counts are being summed, once the sum is in."""
        summing, self._summing = self._summing, None
        if summing is None:
            return
        pending, counts, step, busy = summing
        if pending is not None:
            pending.wait()
        self.last_counts = counts
        share = counts.double() / counts.sum(1, keepdim=True).clamp(min=1)
        self.ema = share if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * share
        self.history.append(counts.tolist())
        del self.history[:-self.max_history]
        if step % self.log_every_n_steps == 0:
            self._log(trainer, counts, step, busy)

    @staticmethod
    def _busy(trainer) -> dict[str, float] | None:
        return trainer.strategy.rank_busy() if hasattr(trainer.strategy, "rank_busy") else None

    def _log(self, trainer, counts: torch.Tensor, step: int, busy: dict[str, float] | None) -> None:
        if dist.is_available() and dist.is_initialized():
            everyone = comm.gather_objects(comm.world(), busy, what="monitor.busy")
        else:
            everyone = [busy]
        self.busy_history.append(everyone)
        if trainer.global_rank != 0:
            return
        metrics = self.figures(counts, everyone)
        metrics.update(self.bias_figures(trainer.lightning_module))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self.last_metrics = metrics

    # -- figures --------------------------------------------------------------------------
    @staticmethod
    def figures(counts: torch.Tensor, busy: list[dict[str, float] | None]) -> dict[str, float]:
        out: dict[str, float] = {}
        per_layer = counts.double()
        ratio = per_layer.max(1).values / per_layer.mean(1).clamp(min=1e-12)
        for l, r in enumerate(ratio.tolist()):
            out[f"moe_load/layer{l}_max_over_mean"] = r
        out["moe_load/max_over_mean"] = float(ratio.max())
        out["moe_load/tokens"] = float(per_layer.sum())
        if any(b is not None for b in busy):
            totals = []
            for r, b in enumerate(busy):
                if b is None:
                    continue
                for k in BUSY_KINDS:
                    out[f"rank_busy/rank{r}_{k}_s"] = b[k]
                totals.append((b["attention"] + b["experts"] + (b["comm"] if b["idle"] > 0 else 0.0), r))
            mean = sum(t for t, _ in totals) / len(totals)
            worst, rank = max(totals)
            out["rank_busy/slowest_rank"] = float(rank)
            out["rank_busy/slowest_margin"] = worst / mean - 1 if mean > 0 else 0.0
        return out

    @staticmethod
    def bias_figures(module: Any) -> dict[str, float]:
        """Per layer, the spread of the routers' aux-loss-free balancing bias (max - min):
        how far routing had to be pushed to even the load."""
        out = {}
        for l, (_, layer) in enumerate(moe_layers(module)):
            bias = getattr(layer.router, "expert_bias", None)
            if bias is not None:
                out[f"moe_load/layer{l}_bias_spread"] = float(bias.max() - bias.min())
        return out

    def load_share(self) -> list[list[float]] | None:
        """Moving average of each expert's share of its layer's routing, ``[L][E]``."""
        return None if self.ema is None else self.ema.tolist()

    def mean_share(self, skip: int = 1, last: int | None = None) -> list[list[float]] | None:
        """Each expert's share of its layer's routing over the recorded steps (after ``skip``;
        only the ``last`` of them if given)."""
        counts = self._counts(skip, last)
        return None if counts is None else _pooled_shares(counts)

    def step_shares(self, skip: int = 1, last: int | None = None) -> list[list[list[float]]] | None:
        """Each recorded step's own routing (after ``skip``; only the ``last`` of them if
        given), per layer each expert's share: ``[step][layer][expert]``."""
        counts = self._counts(skip, last)
        return None if counts is None else (counts / counts.sum(2, keepdim=True).clamp(min=1)).tolist()

    def routing_record(self, pl_module: Any, skip: int = 1) -> RoutingRecord:
        """The recorded steps' routing (after ``skip``) as a file's record."""
        cfg = getattr(pl_module, "model_cfg", None)
        return self._record_of(getattr(cfg, "name", type(pl_module).__name__), skip)

    def _record_of(self, model: str, skip: int = 1, last: int | None = None) -> RoutingRecord:
        counts = self._counts(skip, last)
        if counts is None:
            raise ValueError("ExpertLoadMonitor: no step recorded yet")
        return RoutingRecord(model=model, mean_share=_pooled_shares(counts), steps=int(counts.shape[0]),
                             choices_per_step=float(counts[:, 0].sum(1).mean()))

    @classmethod
    def saved_routing(cls, checkpoint: dict[str, Any] | str | Path, model: str, last: int = RESUME_STEPS
                      ) -> RoutingRecord | None:
        """The routing of the ``last`` steps a monitor recorded before ``checkpoint`` was saved
        (Lightning's checkpoint dict, or the path of a checkpoint file or sharded directory,
        read without its tensors), as a record a resumed run plans at
        (``HeterMoEStrategy(expert_load=...)``): where the routing had got to, not where a
        fresh router starts. ``None`` where the checkpoint holds no monitor's state, or no
        step whose every layer kept a choice."""
        if not isinstance(checkpoint, dict):
            from ..ckpt.loading import checkpoint_state

            checkpoint = checkpoint_state(checkpoint)
        state = (checkpoint.get("callbacks") or {}).get(cls.__qualname__)  # Lightning's default state_key
        if not isinstance(state, dict) or not state.get("history"):
            return None
        monitor = cls(plots=False)
        monitor.load_state_dict(state)
        try:
            record = monitor._record_of(model, last=last)
        except ValueError:  # a layer without a kept choice: no shares to plan at
            return None
        record.source = f"the checkpoint's last {record.steps} recorded steps"
        return record

    def _counts(self, skip: int, last: int | None = None) -> torch.Tensor | None:
        """The recorded steps' tokens ``[S, L, E]`` after the first ``skip`` (all of them where
        no more were recorded), only the ``last`` of them if given (a long history is not
        copied for a few steps)."""
        steps = self.history[skip:] or self.history
        if last is not None:
            steps = steps[-last:]
        return torch.tensor(steps, dtype=torch.float64, device="cpu") if steps else None

    # -- plots ----------------------------------------------------------------------------
    def on_fit_end(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A fit that fails or is interrupted (Ctrl-C) keeps the routing its steps had, as far
        as they were summed (no collective here: the peers may be gone); writing it never
        hides the exception."""
        try:
            self._write(trainer, pl_module)
        except Exception as err:
            rank_zero_warn(f"ExpertLoadMonitor: the routing so far was not written: {err}")

    def _write(self, trainer, pl_module) -> None:
        """Rank 0 writes ``expert_load.json`` and the figures of the steps recorded."""
        if not self.plots or trainer.global_rank != 0 or not self.history:
            return
        out = Path(self.output_dir or trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        try:
            self.routing_record(pl_module).to_json(str(out / ROUTING_FILE))
        except ValueError as err:  # a layer that kept no choice has no shares: the plots still tell
            rank_zero_warn(f"ExpertLoadMonitor: {ROUTING_FILE} not written: {err}")
        self.plot_load(out / "expert_load.png")
        if any(any(b is not None for b in step) for step in self.busy_history):
            self.plot_busy(out / "rank_utilisation.png")

    def plot_load(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        steps = torch.tensor(self.history, dtype=torch.float64, device="cpu")  # [S, L, E]
        share = steps / steps.sum(2, keepdim=True).clamp(min=1)
        S, L, E = share.shape
        image = share.permute(1, 2, 0).reshape(L * E, S).numpy()  # rows: (layer, expert)
        fig, ax = plt.subplots(figsize=(10, 0.25 * L * E + 1.5))
        im = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks([l * E + E / 2 - 0.5 for l in range(L)], [f"layer {l}" for l in range(L)])
        for l in range(1, L):
            ax.axhline(l * E - 0.5, color="white", lw=0.8)
        ax.set_xlabel("optimizer step")
        ax.set_title(f"share of each layer's routing per expert (even: {1 / E:.3f})")
        fig.colorbar(im, ax=ax, fraction=0.03)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def plot_busy(self, path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        ranks = max(len(step) for step in self.busy_history)
        totals = {k: [0.0] * ranks for k in BUSY_KINDS}
        for step in self.busy_history:
            for r, b in enumerate(step):
                for k in BUSY_KINDS:
                    totals[k][r] += (b or {}).get(k, 0.0)
        fig, ax = plt.subplots(figsize=(1.2 * ranks + 3, 3.5))
        bottom = [0.0] * ranks
        colours = {"attention": "#4c72b0", "experts": "#dd8452", "comm": "#937860", "idle": "#dddddd"}
        for k in BUSY_KINDS:
            if k == "comm":
                continue  # comm overlaps compute under zebra: shown as a line, not stacked
            ax.bar(range(ranks), totals[k], bottom=bottom, color=colours[k], label=k)
            bottom = [b + v for b, v in zip(bottom, totals[k])]
        ax.plot(range(ranks), totals["comm"], "o", color=colours["comm"], label="comm")
        for r in range(ranks):
            busy = totals["attention"][r] + totals["experts"][r]
            ax.text(r, bottom[r], f"{busy / bottom[r]:.0%}" if bottom[r] else "", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_ylabel("seconds (logged steps)")
        ax.set_title("per-rank time: compute busy % on top")
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    # -- resume ---------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # The checkpoint holds the step just taken too (Lightning read state_dict() before
        # this hook, on every rank, as it calls this one). Not in a save this rank makes alone
        # while it handles an error: the flush sums over every rank, and the save is not made.
        if getattr(trainer.strategy, "saving_alone", False):
            return
        if self._queued is not None or self._summing is not None:
            self.flush(trainer, pl_module)
            checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"ema": None if self.ema is None else self.ema.tolist(), "history": self.history,
                "busy_history": self.busy_history, "seen_step": self._seen_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = None if state.get("ema") is None else torch.tensor(state["ema"], dtype=torch.float64, device="cpu")
        self.history = list(state.get("history", []))
        self.busy_history = list(state.get("busy_history", []))
        self._seen_step = state.get("seen_step", -1)


def _pooled_shares(counts: torch.Tensor) -> list[list[float]]:
    """Steps' tokens ``[S, L, E]`` pooled: each expert's share of its layer's, ``[L][E]``."""
    total = counts.sum(0)
    return (total / total.sum(1, keepdim=True).clamp(min=1)).tolist()
