"""torchmetrics objects sync over the ranks that update them.

A ``torchmetrics.Metric`` gathers its state over its ``process_group`` (the whole world unless
told otherwise) when it computes: Lightning computes a logged one at the epoch's end
(``self.log("val_ppl", self.val_ppl)``). Under zebra and distep only the attention ranks run
the user's steps, so only they update and compute it, and a gather over the world waited for
expert ranks that never came (the job hung at the first validation). Here each metric in the
module is pointed at the ranks that log (the backend's ``metrics_group``, the group
``self.log(sync_dist=True)`` reduces over); on a rank that logs nothing a metric computes its
own state without a gather, so a hook that every rank runs (``on_validation_epoch_end``
calling ``compute()``) does not hang either. Where every rank runs the steps (ep,
data-centric) the metrics are left as they are: the world, as under DDP.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def sync_metrics_over(module: nn.Module, group: Any) -> None:
    """Point every torchmetrics ``Metric`` in ``module`` at ``group`` (``None``: leave them
    with the world; ``False``: this rank logs nothing, no gather)."""
    if group is None:
        return
    from torchmetrics import Metric

    for metric in (m for m in module.modules() if isinstance(m, Metric)):
        if group is False:
            metric.distributed_available_fn = _never
        else:
            metric.process_group = group


def _never() -> bool:
    return False
