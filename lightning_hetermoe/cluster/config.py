"""Cluster config: maps one-to-one onto ``conf/cluster/*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError


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
    clock, scaled by ``time_scale``). ``custom_devices`` defines devices the registry does
    not know, by the fields of ``DeviceSpec``.
    """

    name: str = "cpu2"
    devices: list[str] = field(default_factory=lambda: ["cpu", "cpu"])
    emulate: bool = False
    time_scale: float = 1.0
    link: LinkConfig = field(default_factory=LinkConfig)
    custom_devices: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.link, dict):
            self.link = LinkConfig(**self.link)
        self.devices = list(self.devices)
        if not self.devices:
            raise ConfigError("cluster.devices is empty: name one device per rank, e.g. [a40, a40, v100]")
        if self.time_scale <= 0:
            raise ConfigError(f"cluster.time_scale={self.time_scale!r} is invalid: must be > 0")
        self.specs()  # every name must resolve, emulated or not

    def specs(self) -> list:
        """One :class:`~.devices.DeviceSpec` per rank; names the bad field if one does not resolve."""
        from .devices import custom_spec, get_device

        for name, body in dict(self.custom_devices or {}).items():
            try:
                custom_spec(str(name).lower(), body, where=f"cluster.custom_devices.{name}")
            except ValueError as err:
                raise ConfigError(str(err)) from None
        specs = []
        for i, name in enumerate(self.devices):
            try:
                specs.append(get_device(name, self.custom_devices))
            except ValueError as err:
                raise ConfigError(f"cluster.devices[{i}]={name!r} is invalid: {err}") from None
        return specs

    @property
    def world_size(self) -> int:
        return len(self.devices)
