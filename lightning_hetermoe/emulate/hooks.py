"""The emulated clock installed on a model that runs by itself (expert parallelism, the
profiler): hooks time its tasks and pad them to an :class:`~.clock.Emulator`'s durations.
(The zebra executor runs its tasks itself and pads them directly.)

Concurrency stays real (real processes, real gloo collectives), only the clock is modelled.

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
  the other ranks plus a gloo copy), the modelled transfer time of the rows this rank
  moves off-rank (``max(sent, received)``) is slept.
* **transfer**, data-centric (each layer's weight gathers and gradient reduce-scatters,
  wrapped on the dispatcher's ``weights`` and ``reduce_scatter``): the workload's layer of
  experts moved as the simulator prices it; a gather issued ahead (the prefetch) arrives at
  its issue time plus its modelled time.
* **head** (after the last MoE block: final norm, LM head, loss, and their backward):
  padded when the gradient reaches the last block's output.

The same hooks drive a :class:`~.meter.BusyMeter` on real devices: it pads nothing and
records each task's real span (CUDA events on a GPU), which is how the load monitor sees a
rank's busy time without emulation.

Everything is installed from outside the model: forward (pre-)hooks on the block that
holds each :class:`~lightning_hetermoe.moe.MoELayer` and on its ``experts``, a wrapper on
the dispatcher's ``exchange``, and identity autograd functions that timestamp (and pad)
the backward at task boundaries. :func:`apply_emulation` returns a handle whose
``remove()`` restores the model exactly; applying again replaces the previous install.

**Checkpointed blocks** (the model recomputes each block's forward inside its backward):
the recomputed forward is its tasks' backward work, as the clock prices it (a backward of
``backward_factor + 1`` forwards). Its attention runs inside the block's backward task;
its experts' forward is a segment of the experts' backward task; its two exchanges are
transfers of their own (the simulator's EP graph has them), during which the block's
backward pauses. Nothing of the recompute is padded as a forward.

The emulated GPU runs the configured model in ``CostModel.dtype_bytes`` precision and
recomputes what the run recomputes (:func:`~.clock.emulation_cost_model` takes the timed
model's flags); the simulator must be given the same cost model to predict an emulated run.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch import Tensor, nn

import lightning_hetermoe.comm as comm
from ..backward import inside_backward
from .clock import EmulatedWorkload, Emulator, TaskStats, emulated_workload, rank_emulator
from .meter import BusyMeter

log = logging.getLogger(__name__)

_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, EmulationHandle]" = weakref.WeakKeyDictionary()


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

    __slots__ = ("em", "layer", "fwd_start", "fwd_padded", "fwd_model", "bwd_model", "bwd_segments", "bwd_since",
                 "fwd_end", "head_model", "running")

    def __init__(self, em: Emulator, layer: int, fwd_model: float, bwd_model: float,
                 head_model: float | None = None, running: dict[int, "_BlockCall"] | None = None) -> None:
        self.em, self.layer = em, layer
        self.running = running  # each layer's call whose backward is under way
        self.head_model = head_model  # the last block pads the head (everything after it)
        self.fwd_end: Any = None
        self.fwd_start = em.now()
        self.fwd_padded = False
        self.fwd_model, self.bwd_model = fwd_model, bwd_model
        self.bwd_segments: list[tuple[Any, Any]] = []
        self.bwd_since: Any = None

    # forward: pad the attention task the first time the expert path starts
    def enter_expert_path(self) -> None:
        if not self.fwd_padded:
            self.fwd_padded = True
            self.em.pad("attention", (self.layer, "fwd"), self.fwd_start, self.fwd_model)

    # backward: the block's own work is timed between expert-path segments
    def bwd_start(self) -> None:  # gradient reached the block output
        if self.head_model is not None:  # head forward + loss + head backward ran since fwd_end
            self.em.pad("head", "head", self.fwd_end, self.head_model)
        self.bwd_segments, self.bwd_since = [], self.em.now()
        if self.running is not None:
            self.running[self.layer] = self

    def bwd_pause(self) -> None:  # an expert-path task begins its backward
        if self.bwd_since is not None:
            self.bwd_segments.append((self.bwd_since, self.em.now()))
            self.bwd_since = None

    def bwd_resume(self) -> None:  # an expert-path task finished its backward
        self.bwd_since = self.em.now()

    def bwd_end(self) -> None:  # gradient leaves the block input
        since = self.bwd_since if self.bwd_since is not None else self.em.now()
        self.em.pad("attention", (self.layer, "bwd"), since, self.bwd_model, earlier=self.bwd_segments)
        self.bwd_since = None
        if self.running is not None and self.running.get(self.layer) is self:
            del self.running[self.layer]


class _Recompute:
    """A checkpointed block's forward run again inside ``call``'s backward, timed as the
    simulator's EP graph has it: its attention a task of the forward's time, padded when
    the expert path starts (before the exchange that waits for the other ranks, as in the
    forward), the rest of the block's backward the backward's price less that."""

    __slots__ = ("call", "padded")

    def __init__(self, call: _BlockCall) -> None:
        self.call, self.padded = call, False

    def enter_expert_path(self) -> None:
        """A step of the expert path begins (an exchange, a gather, the experts): the block's
        backward pauses, and the first time the recomputed attention is padded."""
        c = self.call
        c.bwd_pause()
        if not self.padded:
            self.padded = True
            c.em.pad("attention", (c.layer, "recompute"), c.em.now(), c.fwd_model, earlier=c.bwd_segments)
            c.bwd_segments = []
            c.bwd_model = max(c.bwd_model - c.fwd_model, 0.0)

    def bwd_pause(self) -> None:
        self.call.bwd_pause()

    def bwd_resume(self) -> None:
        self.call.bwd_resume()


def _host_counts(em: Emulator | BusyMeter, counts: Tensor) -> list[int]:
    """Each local expert's rows, read on the host only where the clock prices them (an
    emulated rank's, on the CPU). A :class:`BusyMeter` times the real device and models
    nothing: reading them there would be a host sync per layer and micro-batch for nothing."""
    return [int(c) for c in counts.tolist()] if isinstance(em, Emulator) else []


class EmulationHandle:
    """What :func:`apply_emulation` installed; ``remove()`` undoes all of it."""

    def __init__(self, model: nn.Module, emulator: Emulator | BusyMeter) -> None:
        self.model = model
        self.emulator = emulator
        self._hooks: list[Any] = []
        self._exchanges: list[Any] = []  # dispatchers whose exchange we shadowed
        self.removed = False

    @property
    def stats(self) -> dict[str, TaskStats]:
        return getattr(self.emulator, "stats", {})

    def remove(self) -> None:
        if self.removed:
            return
        for h in self._hooks:
            h.remove()
        for disp in self._exchanges:
            for name in ("exchange", "weights", "reduce_scatter"):
                if name in vars(disp):
                    delattr(disp, name)
        self._hooks.clear()
        self._exchanges.clear()
        if _INSTALLED.get(self.model) is self:
            del _INSTALLED[self.model]
        self.removed = True


def _time_experts(handle: EmulationHandle, experts: nn.Module, em: Emulator | BusyMeter, layer_idx: int,
                  current: list, settled: Callable) -> None:
    """The experts of one layer as tasks of their own: the forward (and its recompute)
    padded where it ends, the backward from the gradient reaching their output to its
    leaving their input."""
    state: dict[str, Any] = {}

    def experts_pre(mod, args, kwargs):
        call = current[-1] if current else None
        if isinstance(call, _Recompute):  # the experts' forward again: a task of its own
            call.enter_expert_path()
            state["recompute"] = (em.now(), _host_counts(em, args[2]))
            return None
        if call is not None:
            call.enter_expert_path()
        x, _, counts = args[0], args[1], args[2]
        rec = {"call": call, "t0": em.now(), "counts": _host_counts(em, counts)}
        state["rec"] = rec

        def bwd_in(rec=rec):  # gradient left the experts: the task is over
            modelled = em.experts(rec["counts"], backward=True) - rec.get("recomputed", 0.0)
            em.pad("experts", (layer_idx, "bwd"), rec["bwd_t0"] if "bwd_t0" in rec else em.now(), modelled)
            if rec["call"] is not None:
                rec["call"].bwd_resume()

        return (_mark(x, settled(bwd_in)),) + tuple(args[1:]), kwargs

    def experts_post(mod, args, kwargs, output):
        call = current[-1] if current else None
        if isinstance(call, _Recompute) and "recompute" in state:
            t0, counts = state.pop("recompute")
            modelled = em.experts(counts)
            em.pad("experts", (layer_idx, "recompute"), t0, modelled)
            if "forward" in state:  # paid here, not in the experts' backward
                state["forward"]["recomputed"] = state["forward"].get("recomputed", 0.0) + modelled
            call.bwd_resume()
            return None
        rec = state.pop("rec")
        modelled = em.experts(rec["counts"])
        em.pad("experts", (layer_idx, "fwd"), rec["t0"], modelled)
        if inside_backward() and "forward" in state:
            # recomputed inside the backward (data-centric experts): real, padded work of
            # its own; the experts' backward starts after it
            state["forward"]["bwd_t0"] = em.now()
            return output
        state["forward"] = rec

        def bwd_out(rec=rec):  # gradient reached the experts' output
            if rec["call"] is not None:
                rec["call"].bwd_pause()
            rec["bwd_t0"] = em.now()

        return _mark(output, settled(bwd_out))

    handle._hooks.append(experts.register_forward_pre_hook(experts_pre, with_kwargs=True))
    handle._hooks.append(experts.register_forward_hook(experts_post, with_kwargs=True))


def install(model: nn.Module, emulator: Emulator | BusyMeter, *, head: bool = False) -> EmulationHandle:
    """Install ``emulator``'s clock (or a :class:`BusyMeter`) on every MoE block of
    ``model`` (see module docstring); ``head`` also times the work after the last block (a
    whole LM, not a single block)."""
    previous = _INSTALLED.get(model)
    if previous is not None:
        previous.remove()
    handle = EmulationHandle(model, emulator)
    em = emulator
    from ..model_contract import find_blocks

    blocks = [(block, moe) for _, block, moe in find_blocks(model)]
    current: list[_BlockCall | _Recompute] = []  # stack of block calls in flight (forward, or recomputed)
    running: dict[int, _BlockCall] = {}  # each layer's call whose backward is under way

    def settled(fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` at a backward mark of the forward's graph, once any recompute is over: a
        checkpoint stops recomputing as soon as it has every tensor it dropped, so a
        recomputed block may never reach its forward hook to leave the stack."""
        def run() -> None:
            while current and isinstance(current[-1], _Recompute):
                current.pop()
            fn()
        return run

    for layer_idx, (block, moe) in enumerate(blocks):
        last = head and layer_idx == len(blocks) - 1

        def block_pre(mod, args, kwargs, layer_idx=layer_idx, last=last):
            x = args[0]
            if inside_backward() and layer_idx in running:  # checkpointed: the forward again, in its backward
                current.append(_Recompute(running[layer_idx]))
                return None
            settled(lambda: None)()
            tokens = x.numel() // x.shape[-1]
            call = _BlockCall(em, layer_idx, em.attention(tokens), em.attention(tokens, backward=True),
                              em.head(tokens) if last else None, running)
            current.append(call)
            return (_mark(x, settled(call.bwd_end)),) + tuple(args[1:]), kwargs

        def block_post(mod, args, kwargs, output):
            call = current.pop()
            if isinstance(call, _Recompute):
                return None
            call.enter_expert_path()  # no expert path ran (e.g. empty input): pad here
            call.fwd_end = em.now()
            if isinstance(output, tuple):
                return (_mark(output[0], settled(call.bwd_start)),) + output[1:]
            return _mark(output, settled(call.bwd_start))

        def moe_pre(mod, args, layer_idx=layer_idx):
            call = current[-1] if current else None
            if not isinstance(call, _Recompute) and inside_backward() and layer_idx in running:
                # a block recomputed without its own hooks (Hugging Face's checkpointing calls
                # the layer's forward, not the module): its MoE layer tells
                call = _Recompute(running[layer_idx])
                current.append(call)
            if isinstance(call, _Recompute):
                # the recomputed attention ends here: what follows up to the expert path (the
                # routing, the count exchange that waits for the other ranks) is no task's,
                # as in the forward, where it runs before the attention is padded
                call.bwd_pause()

        handle._hooks.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
        handle._hooks.append(block.register_forward_hook(block_post, with_kwargs=True))
        handle._hooks.append(moe.register_forward_pre_hook(moe_pre))

        _time_experts(handle, moe.experts, em, layer_idx, current, settled)

        disp = moe.dispatcher
        if hasattr(disp, "exchange"):
            _wrap_exchange(handle, moe, disp, layer_idx, current, settled)
        elif hasattr(disp, "weights") and isinstance(em, Emulator):
            _wrap_gathers(handle, disp, layer_idx, current)
    _INSTALLED[model] = handle
    return handle


def installed(model: nn.Module) -> EmulationHandle | None:
    """The emulation handle active on ``model``, if any."""
    return _INSTALLED.get(model)


def _wrap_gathers(handle: EmulationHandle, disp, layer_idx: int, current: list[_BlockCall]) -> None:
    """Data-centric experts: the layer's weight gathers and gradient reduce-scatters are
    transfers of the workload's layer of experts (as the simulator prices them). A forward
    gather was issued ahead (during the previous layer): it arrives at its issue time
    plus its modelled time; so does the backward's (issued once the layer above was
    reduce-scattered; once: a checkpointed block's recompute keeps the layer for its
    experts' own), whose reduce-scatters take their modelled time in full."""
    from ..simulate.datacentric import weight_move_seconds

    em = handle.emulator
    seconds = em.time_scale * weight_move_seconds(em.timer.model, em.timer, em.link, disp.move_fraction)
    scatter_seconds = em.time_scale * weight_move_seconds(em.timer.model, em.timer, em.link, disp.move_fraction,
                                                          grads=True)
    weights, reduce_scatter = disp.weights, disp.reduce_scatter
    parts: dict[str, Any] = {"n": 0, "call": None}

    def gathered(names, tensors):
        parts["n"] = len(names)
        in_backward = inside_backward()
        if current and isinstance(current[-1], _Recompute):  # a checkpointed block's: its attention first
            current[-1].enter_expert_path()
        call = current[-1] if current and not in_backward else None
        if call is not None:
            call.enter_expert_path()
            parts["call"] = call  # whose backward the reduce-scatters interrupt
        started, issued = em.now(), disp.issued_at
        out = weights(names, tensors)
        if not disp.gathered:  # kept from the block's recompute: nothing moved
            return out
        key = (layer_idx, "gather", "bwd" if in_backward else "fwd")
        if disp.ahead and issued is not None:  # issued ahead: it arrives its modelled time after
            em.arrive("transfer", key, issued + seconds, seconds)
        else:
            em.transfer_done(key, started, seconds)
        return out

    def scattered(shard, grad):
        # Autograd may run a weight's reduce-scatter after the gradient left the experts, in
        # the block's own backward: the transfer is not the block's work, so its time is
        # taken out of the attention task (else that task overruns by the transfer's
        # modelled time at every time_scale, and the transfer hides inside its padding).
        call = parts["call"]
        attention_running = call is not None and call.bwd_since is not None
        if attention_running:
            call.bwd_pause()
        started = em.now()
        out = reduce_scatter(shard, grad)
        em.transfer_done((layer_idx, "reduce_scatter"), started, scatter_seconds / max(parts["n"], 1))
        if attention_running:
            call.bwd_resume()
        return out

    disp.weights, disp.reduce_scatter = gathered, scattered
    handle._exchanges.append(disp)


def _every_members_splits(group, send_splits: list[int]) -> list[list[int]]:
    """``rows[s][d]``: what each member of ``group`` sends each (one host all-gather, on an
    emulated run whose exchange crosses nodes only; every member reaches it in the same
    order, right before the exchange itself)."""
    mine = torch.tensor(send_splits, dtype=torch.long)
    outs = [torch.empty_like(mine) for _ in group.ranks]
    comm.host_all_gather(group, outs, mine, what="emulate.ep_splits")
    return [o.tolist() for o in outs]


def _wrap_exchange(handle: EmulationHandle, moe, disp, layer_idx: int, current: list[_BlockCall],
                   settled: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    em = handle.emulator
    original = disp.exchange  # bound method

    def exchange(x: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        call = current[-1] if current else None
        ranks = disp.group.ranks
        rows = _every_members_splits(disp.group, send_splits) if em.needs_matrix(ranks) else None
        seconds = em.exchange_seconds(ranks, send_splits, recv_splits, rows)
        if isinstance(call, _Recompute):  # a transfer of its own inside the block's backward
            call.enter_expert_path()
            started = em.now()
            out = original(x, send_splits, recv_splits)
            em.transfer_done((layer_idx, "recompute"), started, seconds)
            call.bwd_resume()
            return out
        if call is not None:
            call.enter_expert_path()

        bwd = {}

        def bwd_in():  # the backward collective returned: pad its transfer, block resumes
            em.transfer_done((layer_idx, "bwd"), bwd.pop("t0") if "t0" in bwd else em.now(), seconds)
            if call is not None:
                call.bwd_resume()

        def bwd_out():  # gradient reached the exchange output: block work pauses
            if call is not None:
                call.bwd_pause()
            bwd["t0"] = em.now()

        started = em.now()
        out = original(_mark(x, settled(bwd_in)), send_splits, recv_splits)
        em.transfer_done((layer_idx, "fwd"), started, seconds)
        return _mark(out, settled(bwd_out))

    disp.exchange = exchange
    handle._exchanges.append(disp)


def apply_emulation(model: nn.Module, cluster, global_rank: int, *, seq_len: int | None = None,
                    workload: EmulatedWorkload | None = None, warmup_calls: int = 1) -> EmulationHandle:
    """Make this process play ``cluster.devices[global_rank]`` (see module docstring).

    ``model`` is the LightningModule (or any module) after the strategy has sliced its
    experts and swapped its dispatchers; ``workload`` is the clock (default: the model run
    at ``seq_len`` tokens per sequence, or ``cluster.emulate_workload``). Returns an :class:`EmulationHandle`; calling again on
    the same model replaces the earlier install instead of stacking a second one."""
    from ..cluster import ClusterConfig
    from ..configs import from_cfg
    from ..model_contract import describe_model

    cluster = from_cfg(ClusterConfig, cluster)
    if workload is None:
        if seq_len is None:
            raise ValueError("apply_emulation needs the run's seq_len (tokens per sequence) or a workload")
        workload = emulated_workload(cluster, describe_model(model), seq_len)
    emulator = rank_emulator(cluster, global_rank, workload, warmup_calls)
    handle = install(model, emulator, head=True)
    log.info(f"emulation: rank {global_rank} plays {emulator.device.name} at time_scale={cluster.time_scale:g}")
    return handle
