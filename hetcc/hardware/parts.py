"""What a cluster is made of: devices placed on nodes, the links between them, and ``ClusterParts``, the
whole as plain records, checked to form a cluster.

Cluster files are read into and written from ``ClusterParts`` (``hetcc.hardware.cluster_file``), and the
model (``hetcc.hardware.cluster.Cluster``) answers queries over them; the records live here so that both
use them without importing each other. hetcc never guesses a link: parts in which some pair of devices
has none are rejected.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.presets import DeviceType

LINK_KINDS = ("nvlink", "xgmi", "pcie", "infiniband", "ethernet", "loopback")
# Typical one-way latency of a small message, used when a link gives no `latency`.
DEFAULT_LATENCY_S = {
    "nvlink": 2e-6, "xgmi": 2e-6, "pcie": 5e-6, "infiniband": 5e-6, "ethernet": 30e-6, "loopback": 20e-6,
}  # fmt: skip
DEFAULT_MEMORY_RESERVE = 0.1

PairKey = tuple[str, str]


@dataclass(frozen=True)
class Link:
    """A point-to-point connection: bandwidth (bytes/s), per-message latency (s) and its kind."""

    bandwidth_bps: float
    latency_s: float
    kind: str

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ClusterError(f"{self.kind} link: bandwidth must be positive, got {self.bandwidth_bps!r}")
        if not 0 <= self.latency_s < math.inf:
            raise ClusterError(f"{self.kind} link: latency must be >= 0, got {self.latency_s!r}")
        if self.kind not in LINK_KINDS + ("self",):
            raise ClusterError(f"unknown link kind {self.kind!r}{did_you_mean(self.kind, LINK_KINDS)}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link: latency + bytes / bandwidth."""
        return self.latency_s + nbytes / self.bandwidth_bps


@dataclass(frozen=True)
class Device:
    """One device: its unique name, type, host (node), and its position in the cluster and the node."""

    name: str
    type: DeviceType
    node: str
    index: int = 0  # position among the cluster's devices (set by ClusterParts)
    local_index: int = 0  # position among its node's devices: the device ordinal on that host
    memory_override_bytes: int | None = None

    @property
    def memory_bytes(self) -> int:
        """The device's memory: its override if it has one, else its type's."""
        return self.type.memory_bytes if self.memory_override_bytes is None else self.memory_override_bytes

    @property
    def vendor(self) -> str:
        """Its type's vendor: "nvidia", "amd" or "cpu"."""
        return self.type.vendor


@dataclass(frozen=True)
class ClusterParts:
    """A cluster as records: its devices (numbered here, in order) and its links.

    A pair of devices is joined by its ``device_pair_links`` entry, else (same node) its node's
    ``intra_links`` entry, else its nodes' ``node_pair_links`` entry, else ``inter_node_link``.
    Construction checks the whole: unique device and type names, known names in every link, and a
    link for every pair of devices.
    """

    devices: Sequence[Device]
    intra_links: Mapping[str, Link]  # node -> link between its devices
    inter_node_link: Link | None
    node_pair_links: Mapping[PairKey, Link]
    device_pair_links: Mapping[PairKey, Link]
    memory_reserve: float  # share of each device's memory the planner leaves free
    name: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", _numbered(self.devices))
        _check_names(self)
        _check_links(self)

    @property
    def nodes(self) -> dict[str, tuple[Device, ...]]:
        """Node name -> its devices, both in order of first appearance."""
        nodes: dict[str, tuple[Device, ...]] = {}
        for d in self.devices:
            nodes[d.node] = nodes.get(d.node, ()) + (d,)
        return nodes

    @property
    def types(self) -> tuple[DeviceType, ...]:
        """The distinct device types, in order of first appearance."""
        return tuple(dict.fromkeys(d.type for d in self.devices))

    def pair_overrides(self) -> list[tuple[PairKey, Link, bool]]:
        """Explicit per-pair links as ``((a, b), link, is_device_pair)``: node pairs first, each sorted."""
        rows = [(tuple(sorted(k)), v, False) for k, v in self.node_pair_links.items()]
        rows += [(tuple(sorted(k)), v, True) for k, v in self.device_pair_links.items()]
        return sorted(rows, key=lambda row: (row[2], row[0]))  # type: ignore[return-value]

    def replace_types(self, types: Mapping[str, DeviceType]) -> ClusterParts:
        """A copy whose devices of type ``name`` get ``types[name]`` instead (e.g. calibrated types).

        Every key must name a type of these parts, so a misspelt name fails instead of silently
        changing nothing.
        """
        names = [t.name for t in self.types]
        for name in types:
            if name not in names:
                raise ClusterError(f"replace_types: no device type {name!r} in the cluster{did_you_mean(name, names)}",
                                   hint=f"types: {', '.join(names)}")  # fmt: skip
        devices = [dataclasses.replace(d, type=types.get(d.type.name, d.type)) for d in self.devices]
        return dataclasses.replace(self, devices=devices)


def _numbered(devices: Iterable[Device]) -> tuple[Device, ...]:
    """Devices with ``index`` = position and ``local_index`` = position within the node."""
    seen_per_node: dict[str, int] = {}
    out = []
    for i, d in enumerate(devices):
        local = seen_per_node.get(d.node, 0)
        seen_per_node[d.node] = local + 1
        out.append(dataclasses.replace(d, index=i, local_index=local))
    return tuple(out)


def _check_names(parts: ClusterParts) -> None:
    """At least one device, the reserve a share, and device, type and link endpoint names that add up."""
    if not parts.devices:
        raise ClusterError("a cluster needs at least one device")
    if not 0 <= parts.memory_reserve < 1:
        raise ClusterError(f"memory_reserve must be in [0, 1), got {parts.memory_reserve!r}")
    _check_unique([d.name for d in parts.devices], "device")
    _check_unique([t.name for t in parts.types], "device type")
    nodes, devices = parts.nodes, {d.name: d for d in parts.devices}
    _check_known(parts.intra_links, nodes, "intra_links", "node")
    for pair in parts.node_pair_links:
        _check_known(pair, nodes, f"node pair {list(pair)}", "node")
        if pair[0] == pair[1]:
            raise ClusterError(f"node pair {list(pair)}: a node with itself; give it an intra_link instead")
    for pair in parts.device_pair_links:
        _check_known(pair, devices, f"device pair {list(pair)}", "device")


def _check_links(parts: ClusterParts) -> None:
    """Every pair of devices has a link: within a node, between nodes, or given per pair."""
    nodes = parts.nodes
    for node, members in nodes.items():
        if len(members) > 1 and node not in parts.intra_links:
            raise ClusterError(
                f"node {node!r} has {len(members)} devices but no intra_link",
                hint="give the node an intra_link, e.g. {kind: pcie, bandwidth: 32 GB/s}",
            )
    if parts.inter_node_link is not None:
        return
    node_pairs = {frozenset(k) for k in parts.node_pair_links}
    device_pairs = {frozenset(k) for k in parts.device_pair_links}
    names = list(nodes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            linked = frozenset((a, b)) in node_pairs or all(
                frozenset((x.name, y.name)) in device_pairs for x in nodes[a] for y in nodes[b]
            )
            if not linked:
                raise ClusterError(
                    f"nodes {a!r} and {b!r} have no link between them",
                    hint=f"add inter_node_link, or a links entry {{between: [{a}, {b}], kind: ..., bandwidth: ...}}",
                )


def _check_unique(names: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ClusterError(f"two {what}s are named {name!r}", hint=f"give every {what} a distinct name")
        seen.add(name)


def _check_known(names: Iterable[str], known: Mapping[str, object], where: str, what: str) -> None:
    for name in names:
        if name not in known:
            raise ClusterError(f"{where}: unknown {what} {name!r}{did_you_mean(name, known)}")
