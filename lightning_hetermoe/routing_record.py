"""A run's measured routing, kept as a file so that a plan can be made at it.

The load monitor writes one at the end of fit (``expert_load.json``); ``recipes/plan.py
plan.expert_load=<path>`` plans and predicts at its shares instead of even routing, so
that a cluster is sized for the imbalance a model really routes with, not the best case.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .configs import ConfigError, ModelConfig
from .serialization import JsonDataclass

FILE_NAME = "expert_load.json"


@dataclass
class RoutingRecord(JsonDataclass):
    """Each MoE layer's share of its kept routing choices per expert (``mean_share[l][e]``,
    each layer summing to 1), over ``steps`` optimizer steps of the model named ``model``,
    each step ``choices_per_step`` kept choices a layer (tokens x top-k, the global batch's:
    few make a noisy share). ``source``: where a run found it, said when it plans at it
    (``None``: the file or record its ``strategy expert_load`` gave)."""

    model: str
    mean_share: list[list[float]]
    steps: int
    choices_per_step: float
    source: str | None = None

    def __post_init__(self) -> None:
        rows = self.mean_share
        if not rows or any(not row for row in rows) or len({len(row) for row in rows}) != 1:
            raise ValueError(f"mean_share must be one non-empty row per layer, every row as long "
                             f"(got {[len(row) for row in rows]})")
        for l, row in enumerate(rows):
            if any(not math.isfinite(s) or s < 0 for s in row) or abs(sum(row) - 1.0) > 1e-6:
                raise ValueError(f"mean_share[{l}] must be shares >= 0 summing to 1 (got sum {sum(row):.6g})")

    @property
    def shape(self) -> tuple[int, int]:
        """``(layers, experts)``."""
        return len(self.mean_share), len(self.mean_share[0])

    def hottest_over_mean(self) -> float:
        """:func:`hottest_over_mean` of the record's shares."""
        return hottest_over_mean(self.mean_share)


def hottest_over_mean(load: list[list[float]] | None) -> float:
    """The busiest expert's share over the mean share in the most uneven layer of ``load``
    (per layer each expert's share; ``None``: even routing, 1.0), as a run's
    ``expert_load_max_over_mean`` counts it."""
    return max(max(row) * len(row) for row in load) if load else 1.0


def load_record(source: "str | Path | RoutingRecord | dict", field: str) -> RoutingRecord:
    """A record from ``source`` (a path, a record or its dict); every failure a
    :class:`ConfigError` naming ``field`` and what would be valid."""
    if isinstance(source, RoutingRecord):
        return source
    if isinstance(source, dict):
        try:
            return RoutingRecord.from_dict(source)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{field}: not a routing record ({err})") from None
    p = Path(str(source))
    if not p.is_file():
        raise ConfigError(f"{field}={str(source)!r}: no such file; give the {FILE_NAME} a training run wrote "
                          f"(ExpertLoadMonitor, beside its plots), or null for even routing")
    try:
        return RoutingRecord.from_dict(json.loads(p.read_text()))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{field}={str(source)!r} is not a routing record ({err}); give the {FILE_NAME} a "
                          f"training run wrote, or null for even routing") from None


def check_shape(record: RoutingRecord, model: ModelConfig, field: str) -> RoutingRecord:
    """``record``, if it has ``model``'s MoE layers and experts per layer; else a
    :class:`ConfigError` naming ``field`` and both shapes."""
    want = (model.n_layers, model.moe.num_experts)
    if record.shape != want:
        raise ConfigError(f"{field} holds {record.shape[0]} layers x {record.shape[1]} experts (model "
                          f"{record.model!r}); model {model.name!r} has {want[0]} x {want[1]}: measure the routing "
                          f"on a model of this shape, or null for even routing")
    return record


def read_routing(path: str | Path, model: ModelConfig, field: str) -> RoutingRecord:
    """The record at ``path``, checked against ``model`` (the same MoE layers and experts per
    layer)."""
    return check_shape(load_record(path, field), model, f"{field}={str(path)!r}")
