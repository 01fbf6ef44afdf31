"""Which link each transfer crosses: the nodes of a cluster, each node's own interconnect
and the network between nodes.

A flat cluster (one ``link`` for every pair) is one node. In a cluster of nodes, two
ranks of one node talk over that node's link (NVLink, PCIe: per GPU, each way), two
ranks of different nodes over the network, whose bandwidth is the node's port (all its
NICs together) and is shared by every GPU of the node that sends off the node at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..distinct import distinct
from .spec import ClusterConfig, LinkConfig, slowest


@dataclass(frozen=True)
class Topology:
    """Per rank its node; per node its link; the network between nodes (None: one node)."""

    node_of: tuple[int, ...]
    links: tuple[LinkConfig, ...]
    network: LinkConfig | None = None
    names: tuple[str, ...] = ()
    # ring_link's answers: a planner's search asks for the same rings (every rank's replicas
    # over the groups) in every layout it prices
    _rings: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    _kinds: list = field(default_factory=list, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.node_of:
            raise ValueError("a topology needs at least one rank")
        if sorted(set(self.node_of)) != list(range(len(self.links))):
            raise ValueError(f"every node needs at least one rank: ranks sit on nodes {sorted(set(self.node_of))}, "
                             f"there are {len(self.links)} nodes")
        if len(self.links) > 1 and self.network is None:
            raise ValueError("a topology of several nodes needs the network between them")

    @classmethod
    def flat(cls, link: LinkConfig, world_size: int) -> "Topology":
        return cls(node_of=(0,) * world_size, links=(link,))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(self.links)

    def node_ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def nodes_of(self, ranks: Iterable[int]) -> set[int]:
        return {self.node_of[r] for r in ranks}

    def ring_link(self, ranks: Sequence[int]) -> LinkConfig:
        """The slowest hop of a ring over ``ranks`` laid out node by node: inside one node
        that node's link; across nodes the slower of the network (each node's port carries
        one hop each way) and the nodes' own links."""
        key = tuple(ranks)
        if key not in self._rings:
            nodes = sorted(self.nodes_of(key)) or [0]
            hops = [self.links[n] for n in nodes]
            if len(nodes) > 1:
                hops.append(self.network)
            self._rings[key] = slowest(hops)
        return self._rings[key]

    def link_kinds(self) -> tuple[np.ndarray, list[LinkConfig]]:
        """Each node's link as an index into the distinct links (thousands of nodes share a
        few kinds: a leg's busiest node per kind is what prices it)."""
        if not self._kinds:  # each node has its own link object: alike where their figures are
            codes, links = distinct(self.links, key=lambda link: (link.bandwidth_gbps, link.latency_us, link.kind))
            self._kinds.append((np.array(codes, dtype=np.intp), links))
        return self._kinds[0]

    def matrix_legs(self, rows: Sequence[Sequence[float]],
                    groups: Sequence[Sequence[int]]) -> list[tuple[float, LinkConfig]]:
        """The busiest rows on each link of one exchange leg: ``rows[s][d]`` are the rows
        member ``s`` of a group sends member ``d``; ``groups`` lists each group's global ranks
        in the same member order (every group is taken to move what this one moves). Inside
        a node, the busiest member's rows to and from the node's other members over the
        node's link; across nodes, each node's rows out or in, every group's together, over
        its network port."""
        n = len(rows)
        nodes = self.num_nodes
        intra = [0.0] * nodes
        out, inn = [0.0] * nodes, [0.0] * nodes
        for ranks in groups:
            at = [self.node_of[r] for r in ranks]
            for s in range(n):
                sent = sum(rows[s][d] for d in range(n) if d != s and at[d] == at[s])
                got = sum(rows[d][s] for d in range(n) if d != s and at[d] == at[s])
                intra[at[s]] = max(intra[at[s]], sent, got)
                out[at[s]] += sum(rows[s][d] for d in range(n) if at[d] != at[s])
                inn[at[s]] += sum(rows[d][s] for d in range(n) if at[d] != at[s])
        legs = [(x, self.links[k]) for k, x in enumerate(intra) if x > 0]
        legs += [(max(o, i), self.network) for o, i in zip(out, inn, strict=True) if max(o, i) > 0]
        return legs


def cluster_topology(cluster: ClusterConfig) -> Topology:
    """The topology a cluster config describes (a flat device list: one node).

    Where the cluster mixes vendors, the device path ends at a vendor's GPUs: each node is
    split into one island per vendor, and every transfer between islands (another vendor
    on the node, or another node) is priced at the slower of the network and the
    host-staged path (``host_staged``: what comm does between vendors). Pessimistic for
    two nodes of one vendor, which NCCL would join at the network's own speed."""
    nodes = cluster.nodes or [None]
    links = [node.link if node is not None else cluster.link for node in nodes]
    names = [(node.name or "") if node is not None else "" for node in nodes]
    node_of = [n for n, node in enumerate(nodes) for _ in (node.devices if node is not None else cluster.devices)]
    vendors = [spec.vendor for spec in cluster.specs()]
    if len(set(vendors)) == 1:
        if len(links) == 1:
            return Topology.flat(links[0], cluster.world_size)
        return Topology(node_of=tuple(node_of), links=tuple(links), network=cluster.network, names=tuple(names))
    islands = list(dict.fromkeys(zip(node_of, vendors)))
    staged = LinkConfig(kind="host_staged")
    return Topology(node_of=tuple(islands.index(key) for key in zip(node_of, vendors)),
                    links=tuple(links[n] for n, _ in islands),
                    network=slowest([cluster.network, staged]) if cluster.network is not None else staged,
                    names=tuple(f"{names[n] or f'node{n}'}/{v}" for n, v in islands))


def as_topology(link_or_topology: LinkConfig | Topology | None, world_size: int) -> Topology:
    """What the simulator prices transfers with: a bare link is one node of ``world_size``."""
    if isinstance(link_or_topology, Topology):
        if link_or_topology.world_size < world_size:
            raise ValueError(f"the topology has {link_or_topology.world_size} ranks, the step needs {world_size}")
        return link_or_topology
    return Topology.flat(link_or_topology if link_or_topology is not None else LinkConfig(), world_size)


def intra_link_kind(device_name: str, compute_capability: tuple[int, int]) -> str:
    """A node's link guessed from its GPUs' name as the driver reports it: SXM boards talk
    over their generation's NVLink, PCIe cards over their generation's PCIe. Hopper's SXM
    parts do not say "SXM": the H100 SXM5 reports "H100 80GB HBM3" (the PCIe card "H100
    PCIe", the bridged pair "H100 NVL"), the H200 SXM plain "H200" (the PCIe card "H200
    NVL"); Blackwell's B200 comes only on NVLink boards, the MI300X only on Infinity Fabric
    ones (ROCm reports its gfx version as the capability, so the name decides)."""
    name = device_name.upper()
    major = compute_capability[0]
    if "MI300" in name:
        return "xgmi3"
    if re.search(r"\bB[12]00\b", name):
        return "nvlink5"
    hopper_sxm = ("H100" in name and "HBM3" in name) or (re.search(r"\bH200\b", name) and "NVL" not in name)
    if "SXM" in name or "DGX" in name or "HGX" in name or hopper_sxm:
        return "nvlink4" if major >= 9 else "nvlink3" if major >= 8 else "nvlink2"
    return "pcie5" if major >= 9 else "pcie4" if major >= 8 else "pcie3"


def topology_from_hosts(hosts: Sequence[str], device_names: Sequence[str],
                        capabilities: Sequence[tuple[int, int]], network: LinkConfig | None = None) -> Topology:
    """Nodes from each rank's hostname (ranks of one host are one node, in the order hosts
    first appear), each node's link from its first GPU; the network is unknowable from
    inside a process: 100 Gbit/s Ethernet unless given (name the cluster in a config with
    ``nodes`` and ``network`` to plan for the real one)."""
    if not (len(hosts) == len(device_names) == len(capabilities)) or not hosts:
        raise ValueError("topology_from_hosts: one hostname, device name and capability per rank")
    order = list(dict.fromkeys(hosts))
    node_of = tuple(order.index(h) for h in hosts)
    first = [node_of.index(n) for n in range(len(order))]
    links = tuple(LinkConfig(kind=intra_link_kind(device_names[r], tuple(capabilities[r]))) for r in first)
    return Topology(node_of=node_of, links=links,
                    network=(network or LinkConfig(kind="ethernet100")) if len(order) > 1 else None,
                    names=tuple(order))
