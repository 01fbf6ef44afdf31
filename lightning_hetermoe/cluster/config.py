"""Cluster config: maps one-to-one onto ``conf/cluster/*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..config import ConfigError, from_cfg, workload_model
from .devices import PRECISIONS, DeviceSpec, custom_spec, get_device


@dataclass
class LinkConfig:
    """The network between ranks, as the cost model and the emulator see it."""

    bandwidth_gbps: float = 100.0
    latency_us: float = 10.0

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ConfigError(f"cluster.link.bandwidth_gbps={self.bandwidth_gbps!r} is invalid: must be > 0")
        if self.latency_us < 0:
            raise ConfigError(f"cluster.link.latency_us={self.latency_us!r} is invalid: must be >= 0")


@dataclass
class ClusterConfig:
    """One device name per global rank, in rank order.

    ``emulate: true`` makes each CPU process play its named device (real math, modelled
    clock, scaled by ``time_scale``). ``emulate_workload: {model: d1, seq_len: 16384}``
    times every emulated task as the matching task of that workload (a ``conf/model`` name
    or model fields), in the workload's ``precision`` (default ``16-mixed``, as the paper
    trained; the CPU run's own precision does not change the emulated GPUs' clock); see
    :mod:`lightning_hetermoe.emulate.clock`. ``custom_devices``
    defines devices the registry does not know, by the fields of ``DeviceSpec``.
    """

    name: str = "cpu2"
    devices: list[str] = field(default_factory=lambda: ["cpu", "cpu"])
    emulate: bool = False
    time_scale: float = 1.0
    link: LinkConfig = field(default_factory=LinkConfig)
    custom_devices: dict[str, Any] = field(default_factory=dict)
    emulate_workload: dict[str, Any] | None = None
    # Every device's memory times this (planning, data-centric shares and each rank's
    # budget): an emulated GPU gets a memory as small as its clock is slow; null: as built.
    memory_scale: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.link, dict):
            self.link = LinkConfig(**self.link)
        self.devices = list(self.devices)
        if not self.devices:
            raise ConfigError("cluster.devices is empty: name one device per rank, e.g. [a40, a40, v100]")
        if self.time_scale <= 0:
            raise ConfigError(f"cluster.time_scale={self.time_scale!r} is invalid: must be > 0")
        m = self.memory_scale
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0):
            raise ConfigError(f"cluster.memory_scale={m!r} is invalid: must be a number > 0 (or null: each device's "
                              f"own memory)")
        self.specs()  # every name must resolve, emulated or not
        if self.emulate_workload is not None:
            self._check_workload()

    def _check_workload(self) -> None:
        w = dict(self.emulate_workload)
        unknown = sorted(set(w) - {"model", "seq_len", "precision"})
        if unknown or "model" not in w or "seq_len" not in w:
            raise ConfigError(f"cluster.emulate_workload={w!r} is invalid: give model (a conf/model name or model "
                              f"fields), seq_len and optionally precision" + (f"; unknown {unknown}" if unknown else ""))
        w.setdefault("precision", "16-mixed")
        if w["precision"] not in PRECISIONS:
            raise ConfigError(f"cluster.emulate_workload.precision={w['precision']!r} is invalid: must be one of "
                              f"{PRECISIONS}")
        if not isinstance(w["seq_len"], int) or isinstance(w["seq_len"], bool) or w["seq_len"] < 1:
            raise ConfigError(f"cluster.emulate_workload.seq_len={w['seq_len']!r} is invalid: must be an integer >= 1")
        if not self.emulate:
            raise ConfigError("cluster.emulate_workload is set but cluster.emulate is false: the workload clock only "
                              "times emulated ranks")
        workload_model(w["model"])
        self.emulate_workload = w

    def specs(self) -> list:
        """One :class:`~.devices.DeviceSpec` per rank; names the bad field if one does not resolve."""
        for name, body in dict(self.custom_devices or {}).items():
            try:
                custom_spec(str(name).lower(), body, where=f"cluster.custom_devices.{name}")
            except ValueError as err:
                raise ConfigError(str(err)) from None
        specs = []
        for i, name in enumerate(self.devices):
            try:
                spec = get_device(name, self.custom_devices)
            except ValueError as err:
                raise ConfigError(f"cluster.devices[{i}]={name!r} is invalid: {err}") from None
            if self.memory_scale is not None:
                spec = replace(spec, memory_gb=spec.memory_gb * self.memory_scale,
                               reserved_gb=spec.reserved_gb * self.memory_scale)
            specs.append(spec)
        return specs

    @property
    def world_size(self) -> int:
        return len(self.devices)


def resolve_cluster(cluster_cfg: Any) -> list[DeviceSpec]:
    """One :class:`DeviceSpec` per rank, in rank order, from a ClusterConfig (or its dict)."""
    if not isinstance(cluster_cfg, ClusterConfig):
        cluster_cfg = from_cfg(ClusterConfig, cluster_cfg)
    return cluster_cfg.specs()
