"""Emulated heterogeneous devices on CPU: real math, modelled clock.

Each process plays the device its cluster config names for its rank. Every compute task
runs its real math on the CPU and is then padded with ``time.sleep`` to the duration the
:class:`~lightning_hetermoe.profile.CostModel` gives for that device, times
``cluster.time_scale``; every token transfer of the expert-parallel all-to-all is padded
to the modelled link time. Concurrency stays real (real processes, real gloo
collectives), only the clock is modelled.

Tasks, per MoE layer, forward and backward:

* **attention** (everything of the layer's block up to the experts: norms, attention,
  residual, router). Forward: from the block's entry to the first step of its expert path
  (the first exchange, or the experts themselves without one); padded right there so a
  slow attention device delays the dispatch, as on real hardware. Backward: the block's
  backward minus its expert path; padded when the gradient leaves the block.
* **experts** (the local experts on the tokens this rank received): padded to
  ``sum_e expert_time(tokens_e)`` over the local experts.
* **transfer** (each ``AllToAllDispatcher.exchange``, dispatch and combine, and their
  backward): after the real collective returns (its wall time is synchronisation with
  the other ranks plus a gloo copy), the modelled transfer time of the bytes this rank
  moves off-rank (``max(sent, received)``, at the cost model's dtype width) is slept.

Everything is installed from outside the model: forward (pre-)hooks on the block that
holds each :class:`~lightning_hetermoe.moe.MoELayer` and on its ``experts``, a wrapper on
the dispatcher's ``exchange``, and identity autograd functions that timestamp (and pad)
the backward at task boundaries. :func:`apply_emulation` returns a handle whose
``remove()`` restores the model exactly; applying again replaces the previous install.

The emulated GPU runs the configured model in ``CostModel.dtype_bytes`` precision and,
since the CPU job does not checkpoint activations, backward = ``backward_factor`` x
forward (``CostModel(activation_checkpointing=False)``): :func:`emulation_cost_model`
is that model, and the simulator must be given the same one to predict an emulated run.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, EmulationHandle]" = weakref.WeakKeyDictionary()
TASKS = ("attention", "experts", "transfer")


def emulation_cost_model(**overrides: Any):
    """The cost model emulated ranks use: no activation checkpointing (the CPU job has none)."""
    from .profile.cost_model import CostModel

    kw = {"activation_checkpointing": False}
    kw.update(overrides)
    return CostModel(**kw)


class EmulationWarning(UserWarning):
    """Real CPU compute took longer than the modelled device time: the clock is not faithful."""


@dataclass
class TaskStats:
    count: int = 0
    real_s: float = 0.0  # real time spent in the task before padding
    modelled_s: float = 0.0  # scaled modelled time (what the task should take)
    slept_s: float = 0.0
    overruns: int = 0  # calls whose real time exceeded the modelled time
    worst_ratio: float = 0.0  # max real / modelled

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class Emulator:
    """The modelled clock of one emulated device: task durations and padding.

    ``device`` is a :class:`~lightning_hetermoe.cluster.devices.DeviceSpec`; ``link`` a
    :class:`~lightning_hetermoe.cluster.LinkConfig`. All durations returned are already
    multiplied by ``time_scale``. ``warmup_calls`` first calls of each task key are not
    warned about (allocator and thread-pool start-up), only counted.
    """

    def __init__(self, device, link, time_scale: float = 1.0, cost_model=None, *, warmup_calls: int = 1,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale={time_scale!r} is invalid: must be > 0")
        self.device = device
        self.link = link
        self.time_scale = float(time_scale)
        self.cost_model = cost_model if cost_model is not None else emulation_cost_model()
        self.warmup_calls = warmup_calls
        self._sleep = sleep
        self.stats: dict[str, TaskStats] = {t: TaskStats() for t in TASKS}
        self._seen: dict[Any, int] = {}
        self._warned = False
        self._needed_scale = 0.0
        self._lock = threading.Lock()

    # -- modelled durations (scaled) ---------------------------------------------------
    def attention_s(self, *, tokens: int, seq_len: int, d_model: int, n_heads: int, num_experts: int,
                    backward: bool = False) -> float:
        return self.time_scale * self.cost_model.attention_time(
            self.device, tokens=tokens, seq_len=seq_len, d_model=d_model, n_heads=n_heads,
            num_experts=num_experts, backward=backward)

    def experts_s(self, counts: list[int], *, d_model: int, d_ff: int, activation: str,
                  backward: bool = False) -> float:
        """All local experts, one MLP per expert on its own token count."""
        return self.time_scale * sum(
            self.cost_model.expert_time(self.device, tokens=int(c), d_model=d_model, d_ff=d_ff,
                                        activation=activation, backward=backward)
            for c in counts if c > 0)

    def transfer_s(self, nbytes: float) -> float:
        return self.time_scale * self.cost_model.comm_time(nbytes, self.link)

    # -- padding -----------------------------------------------------------------------
    def pad(self, task: str, key: Any, started: float, modelled: float, *, already: float = 0.0) -> float:
        """Sleep until ``started + modelled - already``; record and warn on overrun.

        ``already`` is task time spent in earlier segments (the task was interrupted).
        Returns the seconds slept."""
        real = time.perf_counter() - started + already
        rest = modelled - real
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
            if modelled > 0:
                st.worst_ratio = max(st.worst_ratio, real / modelled)
            if real > modelled and modelled > 0:
                st.overruns += 1
                if seen > self.warmup_calls:
                    self._overrun(task, key, real, modelled)
        return slept

    def sleep_for(self, task: str, key: Any, seconds: float) -> None:
        """A transfer: the modelled time is slept in full after the real collective."""
        if seconds > 0:
            self._sleep(seconds)
        with self._lock:
            st = self.stats[task]
            st.count += 1
            st.modelled_s += seconds
            st.slept_s += seconds

    def _overrun(self, task: str, key: Any, real: float, modelled: float) -> None:
        needed = self.time_scale * real / modelled if modelled > 0 else math.inf
        self._needed_scale = max(self._needed_scale, needed)
        if self._warned:
            return
        self._warned = True
        msg = (f"emulated {self.device.name}: real CPU compute of {task} {key} took {real * 1e3:.2f} ms, more than its "
               f"modelled {modelled * 1e3:.2f} ms at cluster.time_scale={self.time_scale:g}; the emulated clock is "
               f"not faithful: set cluster.time_scale >= {math.ceil(needed):d} (warned once)")
        log.warning(msg)
        warnings.warn(msg, EmulationWarning, stacklevel=3)

    @property
    def needed_time_scale(self) -> float:
        """Smallest time_scale that would have covered every overrun seen after warm-up (0 if none)."""
        return self._needed_scale

    def summary(self) -> dict[str, Any]:
        return {"device": self.device.name, "time_scale": self.time_scale,
                "needed_time_scale": self._needed_scale,
                "tasks": {k: v.as_dict() for k, v in self.stats.items()}}


# -- backward boundary markers ----------------------------------------------------------
class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``fn()`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, fn, x):  # noqa: D401
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return None, grad


def _mark(x: Tensor, fn: Callable[[], None]) -> Tensor:
    if torch.is_grad_enabled() and isinstance(x, Tensor) and x.requires_grad:
        return _Mark.apply(fn, x)
    return x


class _BlockCall:
    """The attention task of one forward call of one block, forward and backward."""

    __slots__ = ("em", "layer", "fwd_start", "fwd_padded", "fwd_model", "bwd_model", "bwd_acc", "bwd_since")

    def __init__(self, em: Emulator, layer: int, fwd_model: float, bwd_model: float) -> None:
        self.em, self.layer = em, layer
        self.fwd_start = time.perf_counter()
        self.fwd_padded = False
        self.fwd_model, self.bwd_model = fwd_model, bwd_model
        self.bwd_acc = 0.0
        self.bwd_since: float | None = None

    # forward: pad the attention task the first time the expert path starts
    def enter_expert_path(self) -> None:
        if not self.fwd_padded:
            self.fwd_padded = True
            self.em.pad("attention", (self.layer, "fwd"), self.fwd_start, self.fwd_model)

    # backward: the block's own work is timed between expert-path segments
    def bwd_start(self) -> None:  # gradient reached the block output
        self.bwd_acc, self.bwd_since = 0.0, time.perf_counter()

    def bwd_pause(self) -> None:  # an expert-path task begins its backward
        if self.bwd_since is not None:
            self.bwd_acc += time.perf_counter() - self.bwd_since
            self.bwd_since = None

    def bwd_resume(self) -> None:  # an expert-path task finished its backward
        self.bwd_since = time.perf_counter()

    def bwd_end(self) -> None:  # gradient leaves the block input
        since = self.bwd_since if self.bwd_since is not None else time.perf_counter()
        self.em.pad("attention", (self.layer, "bwd"), since, self.bwd_model, already=self.bwd_acc)
        self.bwd_since = None


class EmulationHandle:
    """What :func:`apply_emulation` installed; ``remove()`` undoes all of it."""

    def __init__(self, model: nn.Module, emulator: Emulator) -> None:
        self.model = model
        self.emulator = emulator
        self._hooks: list[Any] = []
        self._exchanges: list[Any] = []  # dispatchers whose exchange we shadowed
        self.removed = False

    @property
    def stats(self) -> dict[str, TaskStats]:
        return self.emulator.stats

    def remove(self) -> None:
        if self.removed:
            return
        for h in self._hooks:
            h.remove()
        for disp in self._exchanges:
            if "exchange" in vars(disp):
                del disp.exchange
        self._hooks.clear()
        self._exchanges.clear()
        if _INSTALLED.get(self.model) is self:
            del _INSTALLED[self.model]
        self.removed = True


def install(model: nn.Module, emulator: Emulator, *, n_heads: int | None = None) -> EmulationHandle:
    """Install ``emulator``'s clock on every MoE block of ``model`` (see module docstring)."""
    previous = _INSTALLED.get(model)
    if previous is not None:
        previous.remove()
    handle = EmulationHandle(model, emulator)
    em = emulator
    from .contract import describe_model, find_blocks

    blocks = [(block, moe) for _, block, moe in find_blocks(model)]
    heads = n_heads if n_heads is not None else describe_model(model).n_heads
    current: list[_BlockCall] = []  # stack of block calls in flight (forward)

    for layer_idx, (block, moe) in enumerate(blocks):
        num_experts = moe.num_experts

        def block_pre(mod, args, kwargs, layer_idx=layer_idx, heads=heads, num_experts=num_experts):
            x = args[0]
            seq_len = x.shape[-2] if x.dim() >= 3 else x.shape[0]
            tokens = x.numel() // x.shape[-1]
            fwd = em.attention_s(tokens=tokens, seq_len=seq_len, d_model=x.shape[-1], n_heads=heads,
                                 num_experts=num_experts)
            bwd = em.attention_s(tokens=tokens, seq_len=seq_len, d_model=x.shape[-1], n_heads=heads,
                                 num_experts=num_experts, backward=True)
            call = _BlockCall(em, layer_idx, fwd, bwd)
            current.append(call)
            return (_mark(x, call.bwd_end),) + tuple(args[1:]), kwargs

        def block_post(mod, args, kwargs, output):
            call = current.pop()
            call.enter_expert_path()  # no expert path ran (e.g. empty input): pad here
            if isinstance(output, tuple):
                return (_mark(output[0], call.bwd_start),) + output[1:]
            return _mark(output, call.bwd_start)

        handle._hooks.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
        handle._hooks.append(block.register_forward_hook(block_post, with_kwargs=True))

        experts = moe.experts
        state: dict[str, Any] = {}

        def experts_pre(mod, args, kwargs, layer_idx=layer_idx, state=state):
            call = current[-1] if current else None
            if call is not None:
                call.enter_expert_path()
            x, _, counts = args[0], args[1], args[2]
            rec = {"call": call, "t0": time.perf_counter(), "counts": [int(c) for c in counts.tolist()]}
            state["rec"] = rec

            def bwd_in(rec=rec):  # gradient left the experts: the task is over
                counts = rec["counts"]
                modelled = em.experts_s(counts, d_model=mod.d_model, d_ff=mod.d_ff, activation=mod.activation,
                                        backward=True)
                em.pad("experts", (layer_idx, "bwd"), rec.get("bwd_t0", time.perf_counter()), modelled)
                if rec["call"] is not None:
                    rec["call"].bwd_resume()

            return (_mark(x, bwd_in),) + tuple(args[1:]), kwargs

        def experts_post(mod, args, kwargs, output, layer_idx=layer_idx, state=state):
            rec = state.pop("rec")
            modelled = em.experts_s(rec["counts"], d_model=mod.d_model, d_ff=mod.d_ff, activation=mod.activation)
            em.pad("experts", (layer_idx, "fwd"), rec["t0"], modelled)

            def bwd_out(rec=rec):  # gradient reached the experts' output
                if rec["call"] is not None:
                    rec["call"].bwd_pause()
                rec["bwd_t0"] = time.perf_counter()

            return _mark(output, bwd_out)

        handle._hooks.append(experts.register_forward_pre_hook(experts_pre, with_kwargs=True))
        handle._hooks.append(experts.register_forward_hook(experts_post, with_kwargs=True))

        disp = moe.dispatcher
        if hasattr(disp, "exchange"):
            _wrap_exchange(handle, moe, disp, layer_idx, current)
    _INSTALLED[model] = handle
    return handle


def installed(model: nn.Module) -> EmulationHandle | None:
    """The emulation handle active on ``model``, if any."""
    return _INSTALLED.get(model)


def _wrap_exchange(handle: EmulationHandle, moe, disp, layer_idx: int, current: list[_BlockCall]) -> None:
    em = handle.emulator
    original = disp.exchange  # bound method

    def exchange(x: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        call = current[-1] if current else None
        if call is not None:
            call.enter_expert_path()
        me = getattr(disp, "rank", 0)
        remote_rows = max(sum(send_splits) - send_splits[me], sum(recv_splits) - recv_splits[me])
        nbytes = remote_rows * x.shape[-1] * em.cost_model.dtype_bytes
        seconds = em.transfer_s(nbytes)

        def bwd_in():  # the backward collective returned: pad its transfer, block resumes
            em.sleep_for("transfer", (layer_idx, "bwd"), seconds)
            if call is not None:
                call.bwd_resume()

        def bwd_out():  # gradient reached the exchange output: block work pauses
            if call is not None:
                call.bwd_pause()

        out = original(_mark(x, bwd_in), send_splits, recv_splits)
        em.sleep_for("transfer", (layer_idx, "fwd"), seconds)
        return _mark(out, bwd_out)

    disp.exchange = exchange
    handle._exchanges.append(disp)


def apply_emulation(model: nn.Module, cluster, global_rank: int, *, cost_model=None,
                    warmup_calls: int = 1) -> EmulationHandle:
    """Make this process play ``cluster.devices[global_rank]`` (see module docstring).

    ``model`` is the LightningModule (or any module) after the strategy has sliced its
    experts and swapped its dispatchers. Returns an :class:`EmulationHandle`; calling again
    on the same model replaces the earlier install instead of stacking a second one."""
    from .cluster.devices import get_device
    from .config import from_cfg
    from .cluster import ClusterConfig

    cluster = from_cfg(ClusterConfig, cluster)
    if not 0 <= global_rank < cluster.world_size:
        raise ValueError(f"global_rank={global_rank} is outside cluster '{cluster.name}' of {cluster.world_size} ranks")
    device = get_device(cluster.devices[global_rank], cluster.custom_devices)
    emulator = Emulator(device, cluster.link, cluster.time_scale, cost_model, warmup_calls=warmup_calls)
    handle = install(model, emulator)
    log.info(f"emulation: rank {global_rank} plays {device.name} at time_scale={cluster.time_scale:g}")
    return handle


def emulation_timer(cluster, model_cfg, seq_len: int):
    """The task timer of an emulated cluster (what its ranks pad to)."""
    from .profile.timer import make_timer

    return make_timer(model_cfg, seq_len, cost=emulation_cost_model())


class EmulatedClock:
    """One emulated device's clock for the zebra executor: modelled seconds x time_scale."""

    def __init__(self, cluster, rank: int, timer) -> None:
        from .cluster.devices import get_device

        self.device = get_device(cluster.devices[rank], cluster.custom_devices)
        self.timer, self.scale, self.link = timer, cluster.time_scale, cluster.link

    def attention(self, tokens: float, backward: bool = False) -> float:
        return self.scale * self.timer.attention(self.device, tokens, backward)

    def head(self, tokens: float, forward_only: bool = False) -> float:
        h = self.timer.head(self.device, tokens)
        return self.scale * (h / 3.0 if forward_only else h)

    def experts(self, counts, backward: bool = False) -> float:
        return self.scale * sum(self.timer.expert(self.device, c, backward) for c in counts if c > 0)

    def transfer(self, rows: float) -> float:
        d = self.timer.model.d_model
        return self.scale * self.timer.comm(rows * d * self.timer.cost.dtype_bytes, self.link)
