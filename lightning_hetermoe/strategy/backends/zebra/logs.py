"""``self.log`` inside a zebra step: one call per step, as under DDP.

The user's step runs once per micro-batch, so each ``self.log`` is called ``R`` times. The
calls are held back and replayed once at the end of the step with the rank's value:
micro-batch values weighted by their size for ``reduce_fx="mean"`` (the default), summed
for ``"sum"``, the extreme for ``"max"``/``"min"``, the last value otherwise. The replay
goes through Lightning's own ``log``, so ``sync_dist`` reduces over the attention ranks and
epoch aggregation sees the rank's whole share as the batch size.
"""

from __future__ import annotations

from typing import Any

import torch

from . import fibers


def _reduce_name(fx: Any) -> str:
    if isinstance(fx, str):
        return fx
    return {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}.get(fx, "other")


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

    def replay(self, sizes: list[int], tokens: list[int] | None = None) -> None:
        """``sizes``: sequences per micro-batch; ``tokens``: its real tokens, where ragged
        batches were padded (a micro-batch's mean is over its real tokens: means weigh by them)."""
        by_name: dict[str, list[tuple[Any, tuple, dict, int]]] = {}
        for name, value, args, kwargs, mb in self.calls:
            by_name.setdefault(name, []).append((value, args, kwargs, mb))
        self.calls.clear()
        for name, calls in by_name.items():
            _, args, kwargs, _ = calls[-1]
            kind = _reduce_name(kwargs.get("reduce_fx", "mean"))
            values = [v for v, _, _, _ in calls]
            counts = [max(sizes[mb], 0) for _, _, _, mb in calls]
            weights = counts if tokens is None else [tokens[mb] for _, _, _, mb in calls]
            if not all(isinstance(v, (torch.Tensor, int, float)) for v in values):
                value = values[-1]  # a torchmetrics Metric and the like: it aggregates itself
            else:
                # where the logged tensors live (the device), numbers join them there
                device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
                stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
                if kind == "mean":
                    w = torch.tensor(weights, dtype=torch.float64, device=device)
                    value = (stacked * w).sum() / w.sum().clamp(min=1)
                elif kind == "sum":
                    value = stacked.sum()
                elif kind == "max":
                    value = stacked.max()
                elif kind == "min":
                    value = stacked.min()
                else:
                    value = stacked[-1]
                first = values[0]
                value = value.to(first.dtype if isinstance(first, torch.Tensor) else torch.float32)
            given = [kw.get("batch_size") for _, _, kw, _ in calls]
            kwargs = dict(kwargs)
            kwargs["batch_size"] = sum(b for b in given if b) if all(given) else sum(counts) or None
            self.original(name, value, *args, **kwargs)
