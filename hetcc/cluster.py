"""The cluster model: devices, the links between them, and the YAML/JSON file describing both.

A cluster file lists nodes (hosts), the devices on each, and the links::

    name: lab                       # optional
    memory_reserve: 0.1             # optional: share of each device's memory the planner leaves free
    nodes:
      - name: node0
        intra_link: {kind: nvlink, bandwidth: 300 GB/s, latency: 2 us}
        devices:
          - {type: A100-80GB, count: 4}           # a100-80gb-0 .. a100-80gb-3
      - name: node1
        intra_link: {kind: pcie, bandwidth: 32 GB/s}
        devices:
          - {type: T4, count: 4, name: t4_, memory: 15 GiB}   # t4_0 .. t4_3, memory overridden
    inter_node_link: {kind: ethernet, bandwidth: 25 Gb/s, latency: 20 us}
    links:                          # optional per-pair overrides: two nodes or two devices
      - {between: [node0, node1], bandwidth: 100 Gb/s}        # unset fields keep the overridden link's
    custom_types:                   # optional: new types, or a preset (`base:`) with changes
      - {name: MyCard, base: A100-40GB, memory: 48 GB}

Device types are presets (``hetcc.presets``, matched ignoring case and dashes) or ``custom_types``; a
custom type needs ``vendor``, ``peak_flops``, ``memory`` and ``memory_bandwidth`` unless it has a
``base``. A device entry expands ``count`` devices (default 1) named ``<type>-<k>`` (k counts that
type across the cluster) or, given ``name``, ``<name><i>`` (``name`` itself when count is 1). Device
entries may override ``memory`` (kept per device) and ``peak_flops`` (per dtype), ``memory_bandwidth``,
``matmul_efficiency``, ``memory_efficiency``, ``kernel_overhead`` (a derived type ``<type>@<first
device>``). Links need ``kind`` and ``bandwidth``; ``latency`` defaults per kind (DEFAULT_LATENCY_S).
A node with several devices needs an ``intra_link``, and every two nodes need ``inter_node_link`` or
a ``links`` entry: hetcc never guesses a link. Pair resolution: device-pair override > the node's
intra_link > node-pair override > inter_node_link.

Quantities are numbers in SI base units (bytes, bytes/s, seconds, FLOP/s) or strings with a unit:
"80 GB" (1e9), "80 GiB" (2**30), "300 GB/s", "25 Gb/s" and "25 Gbps" (bits: /8), "2 us", "0.5 ms",
"312 TFLOP/s". B is bytes, b is bits; memory in bits is rejected as a likely typo.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import yaml

from hetcc.errors import ClusterError
from hetcc.presets import DTYPE_KEYS, PRESETS, VENDOR_EFFICIENCY, VENDORS, DeviceType, get_preset, type_key

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
            raise ClusterError(f"unknown link kind {self.kind!r}{_closest(self.kind, LINK_KINDS)}")

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
                f"no device {name!r} in the cluster{_closest(name, self._by_name)}",
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
        """Build a cluster from a parsed file (see the module docstring); errors name ``source``."""
        return _SpecReader(source).cluster(spec)

    @classmethod
    def from_file(cls, path: object) -> Cluster:
        """Load a ``.yaml``/``.yml``/``.json`` cluster file."""
        return _SpecReader(str(path)).cluster(_load(str(path)))

    def to_spec(self) -> dict[str, object]:
        """A self-contained spec (every type written out, SI numbers) that ``from_spec`` reads back."""
        return _write_spec(self)

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
            raise ClusterError(f"{where}: unknown {what} {name!r}{_closest(name, known)}")


def _closest(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


# ==== cluster files: quantities, reading, writing, printing. Only Cluster's from_spec, from_file,
# to_spec and describe reach below this line (it could move to its own module as one block).
# ---- quantities ------------------------------------------------------------------------------
_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_BYTES = {p + b: f for p, f in (_SI | _BINARY).items() for b in ("B", "byte", "bytes")}
_BITS = {p + b: f / 8 for p, f in (_SI | _BINARY).items() for b in ("b", "bit", "bits")}
_UNITS: dict[str, dict[str, float]] = {
    "bytes": _BYTES,
    "bytes/s": {u + per: f for u, f in (_BYTES | _BITS).items() for per in ("/s", "ps", "/sec")},
    # Divisors, not factors: 2 / 1e6 is exactly the float 2e-6, while 2 * 1e-6 is not.
    "seconds": {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "μs": 1e6, "ns": 1e9},
    # FLOP/s units are matched lower-cased: "TFLOPS", "TFLOP/s" and "tflops" all read as 1e12.
    "flop/s": {p.lower() + f: m for p, m in (_SI | {"E": 1e18}).items() for f in ("flop/s", "flops")},
}
_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s\d].*?)?\s*$")


def parse_quantity(value: object, unit: str) -> float:
    """Read a number (SI base unit) or a string such as "80 GiB", "25 Gb/s", "2 us", "312 TFLOP/s".

    ``unit`` is "bytes", "bytes/s", "seconds" or "flop/s". Sizes and rates must be positive;
    durations may be zero. Raises ClusterError saying what is wrong and how to write it.
    """
    table = _UNITS[unit]
    examples = {"bytes": "80 GB, 80 GiB", "bytes/s": "300 GB/s, 25 Gb/s", "seconds": "2 us, 0.5 ms"}
    how = f"write a number in {unit} or e.g. {examples.get(unit, '312 TFLOP/s')}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ClusterError(f"expected a quantity in {unit}, got {value!r}", hint=how)
    number, suffix = (float(value), None) if not isinstance(value, str) else _split(value, how)
    if suffix:
        key = suffix.lower() if unit == "flop/s" else suffix
        if unit == "bytes" and key in _BITS:
            raise ClusterError(
                f"{value!r} is in bits; memory is given in bytes", hint=f"write {number:g} {key[:-1]}B"
            )
        if key not in table:
            raise ClusterError(f"unknown unit {suffix!r} in {value!r}{_closest(key, table)}", hint=how)
        number = number / table[key] if unit == "seconds" else number * table[key]
    if not math.isfinite(number) or number < 0 or (number == 0 and unit != "seconds"):
        bound = "finite and >= 0" if unit == "seconds" else "finite and positive"
        raise ClusterError(f"{value!r} is not a quantity in {unit} that is {bound}")
    return number


def _split(text: str, how: str) -> tuple[float, str | None]:
    match = _QUANTITY.match(text)
    if not match:
        raise ClusterError(f"cannot read {text!r} as a quantity", hint=how)
    return float(match.group(1)), match.group(2)


def _message(error: ClusterError) -> str:
    """An error's message without its hint line (to re-raise it with a location in front)."""
    return str(error).partition("\n  hint: ")[0]


# ---- reading a spec --------------------------------------------------------------------------
_TOP_KEYS = ("name", "memory_reserve", "nodes", "inter_node_link", "links", "custom_types")
_NODE_KEYS = ("name", "intra_link", "devices")
_LINK_KEYS = ("kind", "bandwidth", "latency")
# File key -> (DeviceType field, quantity unit or None for a fraction in (0, 1]).
_TYPE_FIELDS = {
    "memory_bandwidth": ("memory_bandwidth_bps", "bytes/s"),
    "matmul_efficiency": ("matmul_efficiency", None),
    "memory_efficiency": ("memory_efficiency", None),
    "kernel_overhead": ("kernel_overhead_s", "seconds"),
}
_DEVICE_KEYS = ("type", "count", "name", "memory", "peak_flops", *_TYPE_FIELDS)
_CUSTOM_KEYS = ("name", "base", "vendor", "memory", "peak_flops", *_TYPE_FIELDS)


class _SpecReader:
    """Turns a parsed cluster file into a Cluster; every error names the source and the field path."""

    def __init__(self, source: str):
        self.source = source
        self.custom: dict[str, DeviceType] = {}  # type_key(name) -> type
        self.default_name_counts: dict[str, int] = {}  # type slug -> devices named after it so far
        self.device_paths: dict[str, str] = {}  # device name -> entry that made it

    def fail(self, path: str, reason: str, hint: str | None = None) -> NoReturn:
        raise ClusterError(f"{self.source}: {path + ': ' if path else ''}{reason}", hint=hint)

    def cluster(self, spec: object) -> Cluster:
        spec = self.mapping(spec, "", _TOP_KEYS, required=("nodes",))
        for i, entry in enumerate(self.items(spec.get("custom_types", []), "custom_types")):
            self.custom_type(entry, f"custom_types[{i}]")
        devices: list[Device] = []
        intra: dict[str, Link] = {}
        for i, node in enumerate(self.items(spec["nodes"], "nodes", nonempty=True)):
            self.node(node, f"nodes[{i}]", devices, intra)
        inter = self.link(spec["inter_node_link"], "inter_node_link") if "inter_node_link" in spec else None
        pairs = self.overrides(spec.get("links", []), devices, intra, inter)
        reserve, name = self.reserve(spec), self.cluster_name(spec)
        try:
            return Cluster(
                devices, intra_links=intra, inter_node_link=inter, node_pair_links=pairs[0],
                device_pair_links=pairs[1], memory_reserve=reserve, name=name,
            )  # fmt: skip
        except ClusterError as error:
            raise ClusterError(f"{self.source}: {_message(error)}", hint=error.hint) from None

    # ---- structure -----------------------------------------------------------------------------
    def mapping(self, obj: object, path: str, keys: Sequence[str], required: Sequence[str] = ()) -> Mapping:
        if not isinstance(obj, Mapping):
            self.fail(path, f"expected a mapping with keys {', '.join(keys)}; got {type(obj).__name__}")
        for key in obj:
            if key not in keys:
                where = f"{path}.{key}" if path else str(key)
                self.fail(where, f"unknown key{_closest(key, keys)}", hint=f"valid keys: {', '.join(keys)}")
        for key in required:
            if key not in obj:
                self.fail(path, f"missing required key {key!r}")
        return obj

    def items(self, obj: object, path: str, nonempty: bool = False) -> list:
        if not isinstance(obj, list) or (nonempty and not obj):
            self.fail(path, f"expected a {'non-empty ' if nonempty else ''}list; got {obj!r}")
        return obj

    def string(self, obj: object, path: str) -> str:
        if not isinstance(obj, str) or not obj.strip():
            self.fail(path, f"expected a non-empty string; got {obj!r}")
        return obj

    def quantity(self, value: object, unit: str, path: str) -> float:
        try:
            return parse_quantity(value, unit)
        except ClusterError as error:
            self.fail(path, _message(error), hint=error.hint)

    def fraction(self, value: object, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            self.fail(path, f"expected a number in (0, 1]; got {value!r}")
        return float(value)

    def cluster_name(self, spec: Mapping) -> str | None:
        return self.string(spec["name"], "name") if "name" in spec else None

    def reserve(self, spec: Mapping) -> float:
        value = spec.get("memory_reserve", DEFAULT_MEMORY_RESERVE)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            self.fail("memory_reserve", f"expected a fraction in [0, 1); got {value!r}")
        return float(value)

    # ---- types and devices ---------------------------------------------------------------------
    def lookup_type(self, name: object, path: str) -> DeviceType:
        name = self.string(name, path)
        if type_key(name) in self.custom:
            return self.custom[type_key(name)]
        try:
            return get_preset(name)
        except ClusterError:
            known = {type_key(n): n for n in PRESETS} | {k: t.name for k, t in self.custom.items()}
            match = difflib.get_close_matches(type_key(name), list(known), n=1, cutoff=0.5)
            closest = f"; closest is {known[match[0]]!r}" if match else ""
            hint = f"presets: {', '.join(PRESETS)}; or define it under custom_types"
            self.fail(path, f"unknown device type {name!r}{closest}", hint=hint)

    def type_changes(self, entry: Mapping, path: str, base: DeviceType | None) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        if "peak_flops" in entry:
            peaks = self.mapping(entry["peak_flops"], f"{path}.peak_flops", DTYPE_KEYS)
            given = {k: self.quantity(v, "flop/s", f"{path}.peak_flops.{k}") for k, v in peaks.items()}
            changes["peak_flops"] = dict(base.peak_flops if base else {}) | given
        for key, (field, unit) in _TYPE_FIELDS.items():
            if key in entry:
                where = f"{path}.{key}"
                changes[field] = (
                    self.quantity(entry[key], unit, where) if unit else self.fraction(entry[key], where)
                )
        return changes

    def custom_type(self, obj: object, path: str) -> None:
        entry = self.mapping(obj, path, _CUSTOM_KEYS, required=("name",))
        name = self.string(entry["name"], f"{path}.name")
        if type_key(name) in self.custom:
            self.fail(f"{path}.name", f"custom type {name!r} is defined twice")
        base = self.lookup_type(entry["base"], f"{path}.base") if "base" in entry else None
        changes = self.type_changes(entry, path, base) | {"name": name}
        if "memory" in entry:
            changes["memory_bytes"] = int(self.quantity(entry["memory"], "bytes", f"{path}.memory"))
        if "vendor" in entry:
            changes["vendor"] = entry["vendor"]
            if entry["vendor"] not in VENDORS:
                self.fail(
                    f"{path}.vendor", f"unknown vendor {entry['vendor']!r}; one of {', '.join(VENDORS)}"
                )
        if base is None:
            missing = [k for k in ("vendor", "peak_flops", "memory", "memory_bandwidth") if k not in entry]
            if missing:
                self.fail(
                    path,
                    f"custom type {name!r} lacks {', '.join(missing)}",
                    hint="give them, or start from a preset: base: <preset>",
                )
        try:
            made = (
                base.replace(**changes)
                if base
                else DeviceType(**(VENDOR_EFFICIENCY[changes["vendor"]] | changes))
            )
        except ClusterError as error:
            self.fail(path, _message(error))
        self.custom[type_key(name)] = made

    def node(self, obj: object, path: str, devices: list[Device], intra: dict[str, Link]) -> None:
        entry = self.mapping(obj, path, _NODE_KEYS, required=("name", "devices"))
        name = self.string(entry["name"], f"{path}.name")
        if any(d.node == name for d in devices):
            self.fail(
                f"{path}.name", f"node {name!r} is listed twice", hint="give every node a distinct name"
            )
        if "intra_link" in entry:
            intra[name] = self.link(entry["intra_link"], f"{path}.intra_link")
        for j, device in enumerate(self.items(entry["devices"], f"{path}.devices", nonempty=True)):
            devices += self.device_entry(device, f"{path}.devices[{j}]", name)

    def device_entry(self, obj: object, path: str, node: str) -> list[Device]:
        entry = self.mapping(obj, path, _DEVICE_KEYS, required=("type",))
        base = self.lookup_type(entry["type"], f"{path}.type")
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            self.fail(f"{path}.count", f"expected a positive integer; got {count!r}")
        names = self.device_names(entry, base, count, path)
        dtype = base
        if changes := self.type_changes(entry, path, base):
            try:
                dtype = base.replace(name=f"{base.name}@{names[0]}", **changes)
            except ClusterError as error:
                self.fail(path, _message(error))
        memory = int(self.quantity(entry["memory"], "bytes", f"{path}.memory")) if "memory" in entry else None
        return [Device(n, dtype, node, memory_override_bytes=memory) for n in names]

    def device_names(self, entry: Mapping, base: DeviceType, count: int, path: str) -> list[str]:
        if "name" in entry:
            prefix = self.string(entry["name"], f"{path}.name")
            names = [prefix] if count == 1 else [f"{prefix}{i}" for i in range(count)]
        else:
            slug, first = base.name.lower(), self.default_name_counts.get(base.name.lower(), 0)
            names = [f"{slug}-{first + i}" for i in range(count)]
            self.default_name_counts[slug] = first + count
        for name in names:
            if name in self.device_paths:
                self.fail(path, f"device name {name!r} is already used by {self.device_paths[name]}",
                          hint="give the entry a distinct `name:` prefix")  # fmt: skip
            self.device_paths[name] = path
        return names

    # ---- links ---------------------------------------------------------------------------------
    def link(self, obj: object, path: str) -> Link:
        return self.make_link(self.mapping(obj, path, _LINK_KEYS, required=("kind", "bandwidth")), path, None)

    def make_link(self, entry: Mapping, path: str, base: Link | None) -> Link:
        """A Link from ``entry``, taking fields it leaves out from ``base`` (the link it overrides)."""
        fields = dataclasses.asdict(base) if base else {}
        if "kind" in entry:
            if entry["kind"] not in LINK_KINDS:
                self.fail(f"{path}.kind", f"unknown link kind {entry['kind']!r}{_closest(entry['kind'], LINK_KINDS)}",
                          hint=f"kinds: {', '.join(LINK_KINDS)}")  # fmt: skip
            fields["kind"] = entry["kind"]
        if "bandwidth" in entry:
            fields["bandwidth_bps"] = self.quantity(entry["bandwidth"], "bytes/s", f"{path}.bandwidth")
        if "latency" in entry:
            fields["latency_s"] = self.quantity(entry["latency"], "seconds", f"{path}.latency")
        elif "kind" in entry and (base is None or base.kind != entry["kind"]):
            fields["latency_s"] = DEFAULT_LATENCY_S[entry["kind"]]
        if "kind" not in fields or "bandwidth_bps" not in fields:
            self.fail(path, "no link to inherit from here: give kind and bandwidth")
        return Link(**fields)

    def overrides(
        self, obj: object, devices: list[Device], intra: dict[str, Link], inter: Link | None
    ) -> tuple[dict[PairKey, Link], dict[PairKey, Link]]:
        """Node-pair then device-pair overrides (a device pair may refine its nodes' override)."""
        by_name, nodes = {d.name: d for d in devices}, {d.node for d in devices}
        entries = []
        for i, entry in enumerate(self.items(obj, "links")):
            path = f"links[{i}]"
            entry = self.mapping(entry, path, ("between", *_LINK_KEYS), required=("between",))
            if not any(key in entry for key in _LINK_KEYS):
                self.fail(path, "an override needs at least one of kind, bandwidth, latency")
            pair, is_device = self.endpoints(entry["between"], f"{path}.between", nodes, by_name)
            entries.append((is_device, pair, entry, path))
        node_pairs: dict[PairKey, Link] = {}
        device_pairs: dict[PairKey, Link] = {}
        for is_device, (a, b), entry, path in sorted(entries, key=lambda e: e[0]):
            if is_device:
                na, nb = by_name[a].node, by_name[b].node
                base = intra.get(na) if na == nb else _pair_get(node_pairs, na, nb) or inter
            else:
                base = inter
            table = device_pairs if is_device else node_pairs
            if _pair_get(table, a, b):
                self.fail(path, f"a second override for {a!r} and {b!r}")
            table[(a, b)] = self.make_link(entry, path, base)
        return node_pairs, device_pairs

    def endpoints(
        self, obj: object, path: str, nodes: set[str], devices: Mapping[str, Device]
    ) -> tuple[PairKey, bool]:
        """Check ``between: [x, y]``: two devices or two distinct nodes. Returns the pair and is-device."""
        if not isinstance(obj, list) or len(obj) != 2 or not all(isinstance(x, str) for x in obj):
            self.fail(path, f"expected two node or device names; got {obj!r}")
        kinds = []
        for i, name in enumerate(obj):
            if name in nodes and name in devices:
                self.fail(f"{path}[{i}]", f"{name!r} is both a node and a device; rename one")
            if name not in nodes and name not in devices:
                self.fail(
                    f"{path}[{i}]", f"unknown device or node {name!r}{_closest(name, [*nodes, *devices])}"
                )
            kinds.append(name in devices)
        if kinds[0] != kinds[1]:
            self.fail(path, f"{obj} mixes a node and a device; give two nodes or two devices")
        if obj[0] == obj[1]:
            self.fail(path, f"{obj[0]!r} linked to itself; a node's own link is its intra_link")
        return (obj[0], obj[1]), kinds[0]


def _pair_get(table: Mapping[PairKey, Link], a: str, b: str) -> Link | None:
    return table.get((a, b)) or table.get((b, a))


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load(path: str) -> object:
    """Parse a .yaml/.yml/.json file; syntax errors name the file and line."""
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ClusterError(f"{path}: a cluster file must end in .yaml, .yml or .json")
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ClusterError(f"{path}: cannot read the cluster file: {error.strerror or error}") from None
    try:
        return json.loads(text) if suffix == ".json" else yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506
    except json.JSONDecodeError as error:
        raise ClusterError(
            f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ClusterError(
            f"{path}: invalid YAML{where}: {getattr(error, 'problem', None) or error}"
        ) from None


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
