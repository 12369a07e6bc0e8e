"""The cluster model: devices, the links between them, and how any pair of devices is connected.

A ``Cluster`` is built from a YAML/JSON file (``Cluster.from_file``; the format and its reader live in
``hetcc.hardware.cluster_file``) or directly from ``Device`` and ``Link`` records. Pair resolution:
device-pair override > the node's intra_link > node-pair override > inter_node_link; hetcc never
guesses a link, so construction fails when some pair of devices has none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.presets import DeviceType
from hetcc.hardware.quantities import (
    parse_quantity as parse_quantity,  # re-exported: cluster files' unit reader
)

LINK_KINDS = ("nvlink", "xgmi", "pcie", "infiniband", "ethernet", "loopback")
# Typical one-way latency of a small message, used when a link gives no `latency`.
DEFAULT_LATENCY_S = {
    "nvlink": 2e-6, "xgmi": 2e-6, "pcie": 5e-6, "infiniband": 5e-6, "ethernet": 30e-6, "loopback": 20e-6,
}  # fmt: skip
DEFAULT_MEMORY_RESERVE = 0.1


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


# What link(a, a) answers: a tensor that stays on its device moves for free.
SAME_DEVICE = Link(math.inf, 0.0, "self")


@dataclass(frozen=True)
class Device:
    """One device: its unique name, type, host (node), and its position in the cluster and the node."""

    name: str
    type: DeviceType
    node: str
    index: int = 0  # position in Cluster.devices (set by Cluster)
    local_index: int = 0  # position among its node's devices: the device ordinal on that host
    memory_override_bytes: int | None = None

    @property
    def memory_bytes(self) -> int:
        return self.type.memory_bytes if self.memory_override_bytes is None else self.memory_override_bytes

    @property
    def vendor(self) -> str:
        return self.type.vendor


DeviceRef = str | Device
PairKey = tuple[str, str]


class Cluster:
    """Devices plus links; answers bandwidth/latency for any pair. Build with ``from_file``/``from_spec``."""

    def __init__(
        self,
        devices: Sequence[Device],
        *,
        intra_links: Mapping[str, Link] | None = None,
        inter_node_link: Link | None = None,
        node_pair_links: Mapping[PairKey, Link] | None = None,
        device_pair_links: Mapping[PairKey, Link] | None = None,
        memory_reserve: float = DEFAULT_MEMORY_RESERVE,
        name: str | None = None,
    ):
        self.name = name
        self.devices = _numbered(devices)
        self._by_name = {d.name: d for d in self.devices}
        self.nodes: dict[str, tuple[Device, ...]] = {}
        for d in self.devices:
            self.nodes[d.node] = self.nodes.get(d.node, ()) + (d,)
        self.intra_links = dict(intra_links or {})
        self.inter_node_link = inter_node_link
        self._node_pairs = {frozenset(k): v for k, v in (node_pair_links or {}).items()}
        self._device_pairs = {frozenset(k): v for k, v in (device_pair_links or {}).items()}
        self.memory_reserve = memory_reserve
        self._validate(node_pair_links or {}, device_pair_links or {})

    # ---- queries -----------------------------------------------------------------------------
    def device(self, ref: DeviceRef) -> Device:
        """The device called ``ref`` (a name, or a Device of this cluster)."""
        name = ref.name if isinstance(ref, Device) else ref
        try:
            return self._by_name[name]
        except KeyError:
            raise ClusterError(
                f"no device {name!r} in the cluster{did_you_mean(name, self._by_name)}",
                hint=f"devices: {', '.join(self._by_name)}",
            ) from None

    @property
    def types(self) -> tuple[DeviceType, ...]:
        """The distinct device types, in order of first appearance."""
        return tuple(dict.fromkeys(d.type for d in self.devices))

    def link(self, a: DeviceRef, b: DeviceRef) -> Link:
        """The link from a to b: device-pair override > intra-node > node-pair override > inter-node."""
        da, db = self.device(a), self.device(b)
        if da.name == db.name:
            return SAME_DEVICE
        found = self._device_pairs.get(frozenset((da.name, db.name)))
        if found is None and da.node == db.node:
            found = self.intra_links.get(da.node)
        if found is None and da.node != db.node:
            found = self._node_pairs.get(frozenset((da.node, db.node)), self.inter_node_link)
        assert found is not None, "validated in __init__"
        return found

    def bandwidth(self, a: DeviceRef, b: DeviceRef) -> float:
        """Bytes/s between two devices (infinite for a device and itself)."""
        return self.link(a, b).bandwidth_bps

    def latency(self, a: DeviceRef, b: DeviceRef) -> float:
        """Seconds of per-message latency between two devices (0 for a device and itself)."""
        return self.link(a, b).latency_s

    def bandwidth_matrix_bps(self) -> list[list[float]]:
        """``[i][j]`` = bytes/s from devices[i] to devices[j] (inf on the diagonal), for the planner."""
        return [[self.bandwidth(a, b) for b in self.devices] for a in self.devices]

    def latency_matrix_s(self) -> list[list[float]]:
        """``[i][j]`` = seconds of latency from devices[i] to devices[j] (0 on the diagonal)."""
        return [[self.latency(a, b) for b in self.devices] for a in self.devices]

    def usable_memory_bytes(self, ref: DeviceRef) -> int:
        """Memory the planner may fill on a device: its memory less the reserve share."""
        return int(self.device(ref).memory_bytes * (1.0 - self.memory_reserve))

    def pair_overrides(self) -> list[tuple[PairKey, Link, bool]]:
        """Explicit per-pair links as ``((a, b), link, is_device_pair)``, in a stable order."""
        rows = [(tuple(sorted(k)), v, False) for k, v in self._node_pairs.items()]
        rows += [(tuple(sorted(k)), v, True) for k, v in self._device_pairs.items()]
        return sorted(rows, key=lambda row: (row[2], row[0]))  # type: ignore[return-value]

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: Mapping[str, object], source: str = "<spec>") -> Cluster:
        """Build a cluster from a parsed file (format: ``hetcc.hardware.cluster_file``); errors name ``source``.

        Relative ``calibration`` paths in ``spec`` are taken from the current directory.
        """
        from hetcc.hardware.cluster_file import read_spec

        return read_spec(spec, source)

    @classmethod
    def from_file(cls, path: object) -> Cluster:
        """Load a ``.yaml``/``.yml``/``.json`` cluster file (format: ``hetcc.hardware.cluster_file``)."""
        from hetcc.hardware.cluster_file import read_file

        return read_file(path)

    def to_spec(self) -> dict[str, object]:
        """A self-contained spec (every type written out, SI numbers) that ``from_spec`` reads back."""
        return _write_spec(self)

    def replace_types(self, types: Mapping[str, DeviceType]) -> Cluster:
        """A copy whose devices of type ``name`` get ``types[name]`` instead (e.g. calibrated types).

        Links, names, memory overrides and the reserve are kept. Every key must name a type of this
        cluster, so a misspelt name fails instead of silently changing nothing.
        """
        names = [t.name for t in self.types]
        for name in types:
            if name not in names:
                raise ClusterError(f"replace_types: no device type {name!r} in the cluster{did_you_mean(name, names)}",
                                   hint=f"types: {', '.join(names)}")  # fmt: skip
        devices = [dataclasses.replace(d, type=types.get(d.type.name, d.type)) for d in self.devices]
        overrides = self.pair_overrides()
        return Cluster(
            devices, intra_links=self.intra_links, inter_node_link=self.inter_node_link,
            node_pair_links={pair: link for pair, link, is_device in overrides if not is_device},
            device_pair_links={pair: link for pair, link, is_device in overrides if is_device},
            memory_reserve=self.memory_reserve, name=self.name,
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.to_spec() == other.to_spec()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        counts = ", ".join(f"{sum(d.type == t for d in self.devices)}× {t.name}" for t in self.types)
        label = f"{self.name!r}: " if self.name else ""
        nodes = f"{len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''}"
        return f"Cluster({label}{len(self.devices)} devices on {nodes}: {counts})"

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """A readable table of devices and links."""
        return _describe(self)

    # ---- validation --------------------------------------------------------------------------
    def _validate(self, node_pairs: Mapping[PairKey, Link], device_pairs: Mapping[PairKey, Link]) -> None:
        if not self.devices:
            raise ClusterError("a cluster needs at least one device")
        if not 0 <= self.memory_reserve < 1:
            raise ClusterError(f"memory_reserve must be in [0, 1), got {self.memory_reserve!r}")
        _check_unique([d.name for d in self.devices], "device")
        _check_unique([t.name for t in self.types], "device type")
        _check_known(self.intra_links, self.nodes, "intra_links", "node")
        for pair in node_pairs:
            _check_known(pair, self.nodes, f"node pair {list(pair)}", "node")
            if pair[0] == pair[1]:
                raise ClusterError(
                    f"node pair {list(pair)}: a node with itself; give it an intra_link instead"
                )
        for pair in device_pairs:
            _check_known(pair, self._by_name, f"device pair {list(pair)}", "device")
        for node, members in self.nodes.items():
            if len(members) > 1 and node not in self.intra_links:
                raise ClusterError(
                    f"node {node!r} has {len(members)} devices but no intra_link",
                    hint="give the node an intra_link, e.g. {kind: pcie, bandwidth: 32 GB/s}",
                )
        if self.inter_node_link is None:
            self._check_node_pairs_linked()

    def _check_node_pairs_linked(self) -> None:
        names = list(self.nodes)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if frozenset((a, b)) in self._node_pairs or self._all_device_pairs_linked(a, b):
                    continue
                raise ClusterError(
                    f"nodes {a!r} and {b!r} have no link between them",
                    hint=f"add inter_node_link, or a links entry {{between: [{a}, {b}], kind: ..., bandwidth: ...}}",
                )

    def _all_device_pairs_linked(self, a: str, b: str) -> bool:
        pairs = (frozenset((x.name, y.name)) for x in self.nodes[a] for y in self.nodes[b])
        return all(p in self._device_pairs for p in pairs)


def _numbered(devices: Iterable[Device]) -> tuple[Device, ...]:
    """Devices with ``index`` = position and ``local_index`` = position within the node."""
    seen_per_node: dict[str, int] = {}
    out = []
    for i, d in enumerate(devices):
        local = seen_per_node.get(d.node, 0)
        seen_per_node[d.node] = local + 1
        out.append(dataclasses.replace(d, index=i, local_index=local))
    return tuple(out)


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


# ---- writing and printing --------------------------------------------------------------------
def _type_spec(t: DeviceType) -> dict[str, Any]:
    return {
        "name": t.name, "vendor": t.vendor, "peak_flops": dict(t.peak_flops), "memory": t.memory_bytes,
        "memory_bandwidth": t.memory_bandwidth_bps, "matmul_efficiency": t.matmul_efficiency,
        "memory_efficiency": t.memory_efficiency, "kernel_overhead": t.kernel_overhead_s,
    }  # fmt: skip


def _link_spec(link: Link) -> dict[str, Any]:
    return {"kind": link.kind, "bandwidth": link.bandwidth_bps, "latency": link.latency_s}


def _device_spec(d: Device) -> dict[str, Any]:
    memory = {} if d.memory_override_bytes is None else {"memory": d.memory_override_bytes}
    return {"name": d.name, "type": d.type.name, **memory}


def _write_spec(cluster: Cluster) -> dict[str, Any]:
    """A self-contained spec: every type written out in SI numbers, so reading it needs no presets."""
    spec: dict[str, Any] = {"name": cluster.name} if cluster.name else {}
    spec["memory_reserve"] = cluster.memory_reserve
    spec["custom_types"] = [_type_spec(t) for t in cluster.types]
    spec["nodes"] = []
    for node, members in cluster.nodes.items():
        intra = cluster.intra_links.get(node)
        link = {"intra_link": _link_spec(intra)} if intra else {}
        spec["nodes"].append({"name": node, **link, "devices": [_device_spec(d) for d in members]})
    if cluster.inter_node_link:
        spec["inter_node_link"] = _link_spec(cluster.inter_node_link)
    overrides = cluster.pair_overrides()
    if overrides:
        spec["links"] = [{"between": list(pair), **_link_spec(link)} for pair, link, _ in overrides]
    return spec


def _format_link(link: Link) -> str:
    bps = link.bandwidth_bps
    return f"{link.kind} {bps / 1e9:g} GB/s ({bps * 8 / 1e9:g} Gb/s), {link.latency_s * 1e6:g} us"


def _describe(cluster: Cluster) -> str:
    def tflops(t: DeviceType, key: str) -> str:
        return f"{t.peak_flops[key] / 1e12:g}" if key in t.peak_flops else "-"

    rows = [("device", "type", "vendor", "node", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "mem GB/s")]
    for d in cluster.devices:
        t = d.type
        rows.append((d.name, t.name, d.vendor, d.node, f"{d.memory_bytes / 2**30:.1f} GiB",
                     tflops(t, "bf16"), tflops(t, "fp32"), f"{t.memory_bandwidth_bps / 1e9:g}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{cluster!r}, memory reserve {cluster.memory_reserve:.0%}"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += ["links:"] + [
        f"  within {node}: {_format_link(link)}" for node, link in cluster.intra_links.items()
    ]
    if cluster.inter_node_link:
        lines.append(f"  between nodes: {_format_link(cluster.inter_node_link)}")
    lines += [f"  {a} <-> {b}: {_format_link(link)}" for (a, b), link, _ in cluster.pair_overrides()]
    return "\n".join(lines)
