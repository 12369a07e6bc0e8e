"""The cluster model: which link joins any pair of devices, at what bandwidth and latency.

A ``Cluster`` is built from ``Device`` and ``Link`` records, or from a YAML/JSON cluster file
(``Cluster.from_file``; the format, its reader and its writer live in ``hetcc.hardware.cluster_file``).
Pair resolution: device-pair override > the node's intra_link > node-pair override > inter_node_link;
hetcc never guesses a link, so construction fails when some pair of devices has none
(``hetcc.hardware.parts.ClusterParts`` checks that).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.cluster_file import read_file, read_spec, write_spec
from hetcc.hardware.parts import DEFAULT_MEMORY_RESERVE, ClusterParts, Device, Link, PairKey
from hetcc.hardware.presets import DeviceType

# What link(a, a) answers: a tensor that stays on its device moves for free.
SAME_DEVICE = Link(math.inf, 0.0, "self")

DeviceRef = str | Device


class Cluster:
    """Devices plus links; answers the link, bandwidth and latency of any pair of devices.

    Built from ``Device``/``Link`` records, a cluster file (``from_file``/``from_spec``) or ``ClusterParts``
    (``from_parts``); ``parts`` holds the checked records it was built from.
    """

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
        self.parts = ClusterParts(
            devices, dict(intra_links or {}), inter_node_link, dict(node_pair_links or {}),
            dict(device_pair_links or {}), memory_reserve, name,
        )  # fmt: skip
        self.name, self.memory_reserve = name, memory_reserve
        self.devices, self.nodes = self.parts.devices, self.parts.nodes
        self.intra_links, self.inter_node_link = self.parts.intra_links, inter_node_link
        self._by_name = {d.name: d for d in self.devices}
        self._node_pairs = {frozenset(k): v for k, v in self.parts.node_pair_links.items()}
        self._device_pairs = {frozenset(k): v for k, v in self.parts.device_pair_links.items()}

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
        return self.parts.types

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
        assert found is not None, "ClusterParts checked that every pair has a link"
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

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_parts(cls, parts: ClusterParts) -> Cluster:
        """The cluster ``parts`` describe (what ``hetcc.hardware.cluster_file`` reads a file into)."""
        return cls(
            parts.devices, intra_links=parts.intra_links, inter_node_link=parts.inter_node_link,
            node_pair_links=parts.node_pair_links, device_pair_links=parts.device_pair_links,
            memory_reserve=parts.memory_reserve, name=parts.name,
        )  # fmt: skip

    @classmethod
    def from_spec(cls, spec: Mapping[str, object], source: str = "<spec>") -> Cluster:
        """Build a cluster from a parsed file (format: ``hetcc.hardware.cluster_file``); errors name ``source``.

        Relative ``calibration`` paths in ``spec`` are taken from the current directory.
        """
        return cls.from_parts(read_spec(spec, source))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Cluster:
        """Load a ``.yaml``/``.yml``/``.json`` cluster file (format: ``hetcc.hardware.cluster_file``)."""
        return cls.from_parts(read_file(path))

    def to_spec(self) -> dict[str, object]:
        """A self-contained spec (every type written out, SI numbers) that ``from_spec`` reads back."""
        return write_spec(self.parts)

    def replace_types(self, types: Mapping[str, DeviceType]) -> Cluster:
        """A copy whose devices of type ``name`` get ``types[name]`` instead (e.g. calibrated types).

        Links, names, memory overrides and the reserve are kept. Every key must name a type of this
        cluster, so a misspelt name fails instead of silently changing nothing.
        """
        return Cluster.from_parts(self.parts.replace_types(types))

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


# ---- printing --------------------------------------------------------------------------------
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
    lines += [f"  {a} <-> {b}: {_format_link(link)}" for (a, b), link, _ in cluster.parts.pair_overrides()]
    return "\n".join(lines)
