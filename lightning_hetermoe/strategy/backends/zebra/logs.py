"""``self.log`` inside a zebra step: one call per step, as under DDP.

The user's step runs once per micro-batch, so each ``self.log`` is called ``R`` times. The
calls are held back and replayed once at the end of the step with the rank's value:
micro-batch values weighted by their size for ``reduce_fx="mean"`` (the default; by their
real tokens where ragged batches were padded, since a micro-batch's mean is over its real
tokens), summed
for ``"sum"``, the extreme for ``"max"``/``"min"``, the last value otherwise. The replay
goes through Lightning's own ``log``, so ``sync_dist`` reduces over the attention ranks and
epoch aggregation sees the rank's whole share as the batch size.

Evaluation steps (validation, test) go one further: the attention ranks compute every
rank's rows, so no rank can log the value of its own rows as under DDP. Every rank logs
the step's value over the global batch instead (:meth:`MicrobatchLogs.replay_global`),
with the global batch as its size: expert ranks answer the metrics Lightning asks of every
rank (``trainer.test``'s results, a monitored ``val_loss``), and any reduction over ranks,
or none, gives the epoch's value over the whole data set, as one process computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import lightning_hetermoe.comm as comm
from . import fibers


def _reduce_name(fx: Any) -> str:
    if isinstance(fx, str):
        return {"avg": "mean"}.get(fx.lower(), fx.lower())  # as Lightning reads it
    return {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}.get(fx, "other")


SHARED = ("mean", "sum", "max", "min")  # kinds whose value over several ranks is known
_SIMPLE = (bool, int, float, str, type(None))


@dataclass
class Logged:
    """One name's calls in this rank's step, reduced over its micro-batches."""

    name: str
    kind: str  # mean | sum | max | min | other
    value: Any  # a float64 tensor where every value was a number, else the last value logged
    numeric: bool
    dtype: torch.dtype  # what Lightning is handed
    weight: int  # the mean's weight: rows of the micro-batches that logged it (real tokens, where padded)
    batch_size: int | None  # what Lightning weighs the value by in the epoch
    args: tuple
    kwargs: dict

    def portable(self) -> dict:
        """Host metadata the other ranks log this name by (picklable: no process groups, no
        callables)."""
        kwargs = {k: v for k, v in self.kwargs.items() if isinstance(v, _SIMPLE)}
        if "reduce_fx" in self.kwargs:
            kwargs["reduce_fx"] = self.kind
        args = self.args if all(isinstance(a, _SIMPLE) for a in self.args) else ()
        return {"name": self.name, "kind": self.kind, "numeric": self.numeric, "dtype": self.dtype,
                "weight": self.weight, "batch_size": self.batch_size or 0, "args": args, "kwargs": kwargs}


class MicrobatchLogs:
    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: list[tuple[str, Any, tuple, dict, int]] = []

    def __enter__(self) -> "MicrobatchLogs":
        self.original = self.module.log
        self.module.__dict__["log"] = self._log  # instance attribute: log_dict goes through it too
        return self

    def __exit__(self, *exc: Any) -> None:
        self.module.__dict__.pop("log", None)

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        fiber = fibers.current()
        if fiber is None:
            return self.original(name, value, *args, **kwargs)
        if isinstance(value, torch.Tensor):
            value = value.detach()
        self.calls.append((name, value, args, kwargs, fiber.mb))

    def reduced(self, sizes: list[int], tokens: list[int] | None = None) -> list[Logged]:
        """This rank's value of every name logged in the step. ``sizes``: rows per micro-batch;
        ``tokens``: its real tokens, where ragged batches were padded (a micro-batch's mean is
        over its real tokens: means weigh by them)."""
        by_name: dict[str, list[tuple[Any, tuple, dict, int]]] = {}
        for name, value, args, kwargs, mb in self.calls:
            by_name.setdefault(name, []).append((value, args, kwargs, mb))
        self.calls.clear()
        device = getattr(self.module, "device", torch.device("cpu"))
        return [_reduce(name, calls, sizes, tokens, device) for name, calls in by_name.items()]

    def replay(self, sizes: list[int], tokens: list[int] | None = None) -> None:
        """Log this rank's values (a training step: every attention rank its share)."""
        for item in self.reduced(sizes, tokens):
            self._emit(item.name, _local_value(item), item.batch_size, item.args, item.kwargs)

    def replay_global(self, mine: list[Logged], everyone: list[list[dict]], device: torch.device) -> list[str]:
        """Log every name's value over the global batch on this rank (an evaluation step).
        ``mine``: this rank's :meth:`reduced` values; ``everyone``: every rank's
        :meth:`Logged.portable` descriptions, in rank order (the same on every rank, so every
        rank issues the same collectives). What cannot be combined over ranks (a torchmetrics
        Metric, ``reduce_fx`` other than mean/sum/max/min) is logged as in training: those
        names are returned (the same on every rank), for the epoch's end to share."""
        shared: dict[str, list[dict]] = {}
        for described in everyone:
            for d in described:
                if d["numeric"] and d["kind"] in SHARED:
                    shared.setdefault(d["name"], []).append(d)
        local = {item.name: item for item in mine}
        for item in mine:
            if item.name not in shared:
                self._emit(item.name, _local_value(item), item.batch_size, item.args, item.kwargs)
        names = sorted(shared)
        totals = _combine(names, shared, local, device)
        for name in names:
            first, item = shared[name][0], local.get(name)
            batch = sum(d["batch_size"] for d in shared[name]) or None
            args, kwargs = (item.args, item.kwargs) if item is not None else (first["args"], first["kwargs"])
            self._emit(name, totals[name].to(first["dtype"]), batch, args, kwargs)
        return sorted({d["name"] for described in everyone for d in described} - set(shared))

    def _emit(self, name: str, value: Any, batch_size: int | None, args: tuple, kwargs: dict) -> None:
        kwargs = dict(kwargs)
        kwargs["batch_size"] = batch_size
        self.original(name, value, *args, **kwargs)


def _reduce(name: str, calls: list[tuple[Any, tuple, dict, int]], sizes: list[int],
            tokens: list[int] | None, device: torch.device) -> Logged:
    _, args, kwargs, _ = calls[-1]
    kind = _reduce_name(kwargs.get("reduce_fx", "mean"))
    values = [v for v, _, _, _ in calls]
    counts = [max(sizes[mb], 0) for _, _, _, mb in calls]
    weights = counts if tokens is None else [tokens[mb] for _, _, _, mb in calls]
    given = [kw.get("batch_size") for _, _, kw, _ in calls]
    batch_size = sum(b for b in given if b) if all(given) else sum(counts) or None
    first = values[0]
    dtype = first.dtype if isinstance(first, torch.Tensor) else torch.float32
    if not all(isinstance(v, (torch.Tensor, int, float)) for v in values):
        # a torchmetrics Metric and the like: it aggregates itself
        return Logged(name, kind, values[-1], False, dtype, sum(weights), batch_size, args, kwargs)
    # on the module's device: a number (or a CPU tensor) logged with sync_dist is reduced over
    # the metrics group, whose device backend (NCCL) takes no CPU tensor
    stacked = torch.stack([_on_device(v, device) for v in values])
    if kind == "mean":
        # the weights are host numbers: copied from pinned memory, not blocking (a plain copy
        # of a host list is a host sync per logged name on a GPU)
        w = comm.to_device(torch.tensor(weights, dtype=torch.float64, device="cpu"), device)
        value = (stacked * w).sum() / max(sum(weights), 1)
    elif kind == "sum":
        value = stacked.sum()
    elif kind == "max":
        value = stacked.max()
    elif kind == "min":
        value = stacked.min()
    else:
        value = stacked[-1]
    return Logged(name, kind, value, True, dtype, sum(weights), batch_size, args, kwargs)


def _on_device(value: Any, device: torch.device) -> torch.Tensor:
    """A logged value as float64 on ``device`` without a host sync: a host value (a number, a
    one-element CPU tensor: Lightning logs scalars) filled in there by a device op rather
    than copied over (a blocking copy on a GPU), a device tensor converted in place."""
    if not isinstance(value, torch.Tensor):
        return torch.full((), value, dtype=torch.float64, device=device)
    if value.device.type == "cpu" and device.type != "cpu" and value.numel() == 1:
        return torch.full(value.shape, value.item(), dtype=torch.float64, device=device)  # host memory: no sync
    return value.to(device=device, dtype=torch.float64)


def _local_value(item: Logged) -> Any:
    return item.value.to(item.dtype) if item.numeric else item.value


def _combine(names: list[str], shared: dict[str, list[dict]], local: dict[str, Logged],
             device: torch.device) -> dict[str, torch.Tensor]:
    """Every name's value over all ranks: a mean weighted by rows (real tokens, where ragged
    batches were padded: each rank's ``Logged.weight``), a sum, an extreme; two
    device all-reduces over the world (sums; maxima, minima negated), skipped where no name
    needs one."""
    kinds = {n: shared[n][0]["kind"] for n in names}
    summed = [n for n in names if kinds[n] in ("mean", "sum")]
    extreme = [n for n in names if kinds[n] in ("max", "min")]
    sums = torch.zeros(len(summed), dtype=torch.float64, device=device)
    for k, n in enumerate(summed):
        if n in local:
            sums[k] = local[n].value * (local[n].weight if kinds[n] == "mean" else 1)
    peaks = torch.full((len(extreme),), float("-inf"), dtype=torch.float64, device=device)
    for k, n in enumerate(extreme):
        if n in local:
            peaks[k] = local[n].value if kinds[n] == "max" else -local[n].value
    if summed:
        comm.all_reduce(comm.world(), sums, what="zebra.metrics")
    if extreme:
        comm.all_reduce(comm.world(), peaks, what="zebra.metrics", op=dist.ReduceOp.MAX)
    out = {}
    for k, n in enumerate(summed):
        weight = sum(d["weight"] for d in shared[n])
        out[n] = sums[k] / max(weight, 1) if kinds[n] == "mean" else sums[k]
    for k, n in enumerate(extreme):
        out[n] = peaks[k] if kinds[n] == "max" else -peaks[k]
    return out
