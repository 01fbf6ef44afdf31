"""The cluster as the planner sees it: its devices in rank order and what their transfers
cross, from a cluster config, a dict or a list of device names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cluster.devices import DeviceSpec, get_device
from ..cluster.spec import ClusterConfig, LinkConfig, resolve_cluster
from ..cluster.topology import Topology, cluster_topology
from ..configs import ConfigError, from_cfg


@dataclass
class ClusterView:
    name: str
    devices: list[DeviceSpec]
    # what transfers cross: a flat cluster is one node
    topology: Topology


def as_cluster(cluster: Any) -> ClusterView:
    """ClusterConfig / dict / list of device names or specs -> name, specs, link."""
    if isinstance(cluster, ClusterView):
        return cluster
    if isinstance(cluster, (list, tuple)):
        if not cluster:
            raise ValueError("empty cluster: name at least one device")
        devs = [get_device(d) for d in cluster]
        return ClusterView("custom", devs, Topology.flat(LinkConfig(), len(devs)))
    if isinstance(cluster, str):  # (not a list of one name per character)
        raise ConfigError(f"cluster={cluster!r} is invalid: expected a ClusterConfig, its dict, or a list of device "
                          f"names such as ['a40', 'v100'] (a Hydra recipe's cluster=<name> loads "
                          f"conf/cluster/<name>.yaml into one)")
    if not isinstance(cluster, ClusterConfig):
        cluster = from_cfg(ClusterConfig, cluster)
    return ClusterView(cluster.name, resolve_cluster(cluster), cluster_topology(cluster))
