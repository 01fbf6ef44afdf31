"""Cluster config: maps one-to-one onto ``conf/cluster/*.yaml``."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace
from typing import Any

from ..configs import ConfigError, from_cfg, workload_model
from .devices import PRECISIONS, DeviceSpec, custom_spec, get_device


# Named links: bandwidth per GPU and direction in Gbit/s (datasheet figures), latency in
# microseconds (a small collective's start-up, the order NCCL reaches). NVLink and PCIe
# join a node's GPUs; the rest are a node's port onto the network between nodes.
KNOWN_LINKS: dict[str, tuple[float, float]] = {
    "nvlink2": (1200.0, 2.0),   # V100 SXM2: 6 links x 25 GB/s each way
    "nvlink3": (2400.0, 2.0),   # A100: 12 links x 25 GB/s
    "nvlink4": (3600.0, 2.0),   # H100: 18 links x 25 GB/s
    "nvlink5": (7200.0, 2.0),   # B200: 18 links x 50 GB/s
    "xgmi3": (3584.0, 2.0),     # MI300X: a 64 GB/s Infinity Fabric link to each of 7 peers
    "pcie3": (126.0, 5.0),      # x16, 15.75 GB/s
    "pcie4": (252.0, 5.0),      # x16, 31.5 GB/s
    "pcie5": (504.0, 5.0),      # x16, 63 GB/s
    "ethernet25": (25.0, 20.0),
    "ethernet100": (100.0, 10.0),
    "ib_edr": (100.0, 5.0),
    "ib_hdr": (200.0, 5.0),
    "ib_ndr": (400.0, 5.0),
    # between GPUs of two vendors: a copy to host memory, gloo, a copy back (two PCIe 4
    # crossings and a TCP transport in series; gloo's start-up is tens of microseconds)
    "host_staged": (100.0, 50.0),
}


@dataclass
class LinkConfig:
    """A link as the cost model and the emulator see it: ``kind`` names one of
    :data:`KNOWN_LINKS`; ``bandwidth_gbps`` / ``latency_us`` given beside it override its
    figures; neither: 100 Gbit/s and 10 us."""

    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    kind: str | None = None
    # the field errors name (not a field of the YAML)
    where: InitVar[str] = "cluster.link"

    def __post_init__(self, where: str) -> None:
        if self.kind is not None:
            key = str(self.kind).lower()
            if key not in KNOWN_LINKS:
                raise ConfigError(f"{where}.kind={self.kind!r} is invalid: must be one of {sorted(KNOWN_LINKS)} (or "
                                  f"give bandwidth_gbps and latency_us)")
            self.kind = key
            bw, lat = KNOWN_LINKS[key]
        else:
            bw, lat = 100.0, 10.0
        self.bandwidth_gbps = bw if self.bandwidth_gbps is None else self.bandwidth_gbps
        self.latency_us = lat if self.latency_us is None else self.latency_us
        for key, ok in (("bandwidth_gbps", _number(self.bandwidth_gbps) and self.bandwidth_gbps > 0),
                        ("latency_us", _number(self.latency_us) and self.latency_us >= 0)):
            if not ok:
                raise ConfigError(f"{where}.{key}={getattr(self, key)!r} is invalid: must be a number "
                                  f"{'> 0' if key == 'bandwidth_gbps' else '>= 0'}")

    @classmethod
    def build(cls, value: Any, where: str) -> "LinkConfig":
        """From YAML: a kind's name, a dict of fields, or a LinkConfig."""
        if isinstance(value, LinkConfig):
            return value
        if isinstance(value, str):
            value = {"kind": value}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} is invalid: give a link kind ({', '.join(sorted(KNOWN_LINKS))}) "
                              f"or {{bandwidth_gbps: ..., latency_us: ...}}")
        unknown = sorted(set(value) - {"bandwidth_gbps", "latency_us", "kind"})
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; valid fields are ['bandwidth_gbps', 'kind', "
                              f"'latency_us']")
        return cls(**value, where=where)

    def describe(self) -> str:
        name = f"{self.kind}, " if self.kind else ""
        return f"{name}{self.bandwidth_gbps:g} Gbit/s, {self.latency_us:g} us"


def slowest(links: Any) -> LinkConfig:
    """The least bandwidth and the most latency of ``links`` (one of them where it has both)."""
    links = list(links)
    bw, lat = min(x.bandwidth_gbps for x in links), max(x.latency_us for x in links)
    both = [x for x in links if x.bandwidth_gbps == bw and x.latency_us == lat]
    return both[0] if both else LinkConfig(bandwidth_gbps=bw, latency_us=lat)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class NodeConfig:
    """One machine: its devices (one per rank, in rank order) and the link between them."""

    devices: list[str] = field(default_factory=list)
    link: Any = None
    name: str | None = None


@dataclass
class ClusterConfig:
    """One device name per global rank, in rank order, as a flat list joined by ``link``
    or as ``nodes`` (each with its devices and its own link) joined by ``network``.

    ``emulate: true`` makes each CPU process play its named device (real math, modelled
    clock, scaled by ``time_scale``). ``emulate_workload: {model: d1, seq_len: 16384}``
    times every emulated task as the matching task of that workload (a ``conf/model`` name
    or model fields), in the workload's ``precision`` (default ``16-mixed``, as the paper
    trained; the CPU run's own precision does not change the emulated GPUs' clock); see
    :mod:`lightning_hetermoe.emulate.clock`. ``custom_devices``
    defines devices the registry does not know, by the fields of ``DeviceSpec``.
    """

    name: str = "cpu2"
    # null with nodes (each node names its own); a flat list: [cpu, cpu]
    devices: list[str] | None = None
    emulate: bool = False
    time_scale: float = 1.0
    # a flat cluster's one link; null with nodes (each node has its own, and the network)
    link: Any = None
    # several machines: [{name: ..., devices: [...], link: nvlink2 | {bandwidth_gbps: ...}}, ...]
    nodes: list[Any] | None = None
    # between nodes: each node's port (all its NICs), e.g. ib_hdr or {bandwidth_gbps: 200}
    network: Any = None
    custom_devices: dict[str, Any] = field(default_factory=dict)
    emulate_workload: dict[str, Any] | None = None
    # Every device's memory times this (planning, data-centric shares and each rank's
    # budget): an emulated GPU gets a memory as small as its clock is slow; null: as built.
    memory_scale: float | None = None

    def __post_init__(self) -> None:
        if self.nodes:
            self._build_nodes()
        else:
            if self.nodes is not None:
                raise ConfigError("cluster.nodes is empty: list nodes, each with devices and a link, or give a flat "
                                  "devices list")
            if self.network is not None:
                raise ConfigError("cluster.network is set but cluster.nodes is not: the network joins nodes (a flat "
                                  "cluster has one link)")
            self.link = LinkConfig() if self.link is None else LinkConfig.build(self.link, "cluster.link")
            self.devices = ["cpu", "cpu"] if self.devices is None else self.devices
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

    def _build_nodes(self) -> None:
        if not isinstance(self.nodes, (list, tuple)):
            raise ConfigError(f"cluster.nodes={self.nodes!r} is invalid: must be a list of nodes")
        if self.link is not None:
            raise ConfigError("cluster.link is the link of a flat cluster: with nodes, give each node its link "
                              "(nodes[i].link) and the network between them (cluster.network)")
        nodes = []
        for i, node in enumerate(self.nodes):
            where = f"cluster.nodes[{i}]"
            if isinstance(node, NodeConfig):
                node = {"devices": node.devices, "link": node.link, "name": node.name}
            if not isinstance(node, dict):
                raise ConfigError(f"{where}={node!r} is invalid: a node is {{devices: [...], link: ...}}")
            unknown = sorted(set(node) - {"devices", "link", "name"})
            if unknown:
                raise ConfigError(f"{where}: unknown field(s) {unknown}; valid fields are ['devices', 'link', 'name']")
            devices = list(node.get("devices") or [])
            if not devices:
                raise ConfigError(f"{where}.devices is empty: name one device per GPU of the node")
            if node.get("link") is None:
                raise ConfigError(f"{where}.link is missing: name its kind ({', '.join(sorted(KNOWN_LINKS))}) or give "
                                  f"{{bandwidth_gbps: ..., latency_us: ...}}")
            nodes.append(NodeConfig(devices=devices, link=LinkConfig.build(node["link"], f"{where}.link"),
                                    name=node.get("name")))
        self.nodes = nodes
        flat = [d for node in nodes for d in node.devices]
        if self.devices is not None and list(self.devices) != flat:
            raise ConfigError(f"cluster.devices={list(self.devices)} disagrees with its nodes' devices {flat}: give "
                              f"the devices in nodes only")
        self.devices = flat
        if len(nodes) > 1 and self.network is None:
            raise ConfigError(f"cluster.network is missing: {len(nodes)} nodes need the network between them (a kind, "
                              f"e.g. ib_hdr, or {{bandwidth_gbps: ..., latency_us: ...}})")
        if self.network is not None:
            self.network = LinkConfig.build(self.network, "cluster.network")

    @property
    def num_nodes(self) -> int:
        return len(self.nodes) if self.nodes else 1

    @property
    def bottleneck_link(self) -> LinkConfig:
        """The slowest link any transfer may cross: the one link of a flat cluster, else the
        slower of the network and the nodes' own links (for prices that ignore placement)."""
        if not self.nodes:
            return self.link
        return slowest([n.link for n in self.nodes] + ([self.network] if self.network is not None else []))

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
