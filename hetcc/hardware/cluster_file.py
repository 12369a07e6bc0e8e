"""Cluster files: reading a YAML/JSON cluster description into a ``Cluster``.

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
    calibration: cpu.yaml           # optional: `hetcc calibrate` file(s), relative to this file; or a list

Device types are presets (``hetcc.hardware.presets``, matched ignoring case and dashes) or ``custom_types``; a
custom type needs ``vendor``, ``peak_flops``, ``memory`` and ``memory_bandwidth`` unless it has a
``base``. A device entry expands ``count`` devices (default 1) named ``<type>-<k>`` (k counts that
type across the cluster) or, given ``name``, ``<name><i>`` (``name`` itself when count is 1). Device
entries may override ``memory`` (kept per device) and ``peak_flops`` (per dtype), ``memory_bandwidth``,
``matmul_efficiency``, ``memory_efficiency``, ``kernel_overhead`` (a derived type ``<type>@<first
device>``). Links need ``kind`` and ``bandwidth``; ``latency`` defaults per kind (DEFAULT_LATENCY_S).
A node with several devices needs an ``intra_link``, and every two nodes need ``inter_node_link`` or
a ``links`` entry. A ``calibration`` file replaces the efficiency profile of the device type it names
(``hetcc.hardware.calibration.apply``); naming a type the cluster lacks is an error. Quantities are numbers in
SI base units or strings with a unit ("80 GiB", "25 Gb/s", "2 us"; see ``hetcc.hardware.quantities``).
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.cluster import (
    DEFAULT_LATENCY_S,
    DEFAULT_MEMORY_RESERVE,
    LINK_KINDS,
    Cluster,
    Device,
    Link,
    PairKey,
)
from hetcc.hardware.presets import (
    DTYPE_KEYS,
    PRESETS,
    VENDOR_EFFICIENCY,
    VENDORS,
    DeviceType,
    get_preset,
    type_key,
)
from hetcc.hardware.quantities import load_file, parse_quantity


def read_spec(spec: object, source: str = "<spec>", base_dir: pathlib.Path | None = None) -> Cluster:
    """Build a cluster from a parsed file; errors name ``source``. Relative calibration paths start at
    ``base_dir`` (default: the current directory)."""
    return _SpecReader(source, base_dir or pathlib.Path()).cluster(spec)


def read_file(path: object) -> Cluster:
    """Load a ``.yaml``/``.yml``/``.json`` cluster file."""
    path = pathlib.Path(str(path))
    return read_spec(load_file(path, "cluster file"), str(path), path.parent)


def _message(error: ClusterError) -> str:
    """An error's message without its hint line (to re-raise it with a location in front)."""
    return str(error).partition("\n  hint: ")[0]


# ---- reading a spec --------------------------------------------------------------------------
_TOP_KEYS = ("name", "memory_reserve", "nodes", "inter_node_link", "links", "custom_types", "calibration")
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

    def __init__(self, source: str, base_dir: pathlib.Path):
        self.source = source
        self.base_dir = base_dir  # where relative calibration paths start
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
            cluster = Cluster(
                devices, intra_links=intra, inter_node_link=inter, node_pair_links=pairs[0],
                device_pair_links=pairs[1], memory_reserve=reserve, name=name,
            )  # fmt: skip
        except ClusterError as error:
            raise ClusterError(f"{self.source}: {_message(error)}", hint=error.hint) from None
        return self.calibrated(cluster, spec["calibration"]) if "calibration" in spec else cluster

    def calibrated(self, cluster: Cluster, obj: object) -> Cluster:
        """``cluster`` with the calibration file(s) under ``calibration`` applied to their types."""
        from hetcc.hardware.calibration import (  # it imports hetcc.hardware.cluster
            Calibration,
            apply_to_cluster,
        )

        single = isinstance(obj, str)
        paths = [obj] if single else self.items(obj, "calibration", nonempty=True)
        calibrations = []
        for i, entry in enumerate(paths):
            where = "calibration" if single else f"calibration[{i}]"
            path = self.base_dir / pathlib.Path(self.string(entry, where)).expanduser()
            try:
                calibrations.append(Calibration.load(path))
            except ClusterError as error:
                self.fail(where, _message(error), hint=error.hint)
        try:
            return apply_to_cluster(cluster, calibrations)
        except ClusterError as error:
            self.fail("calibration", _message(error), hint=error.hint)

    # ---- structure -----------------------------------------------------------------------------
    def mapping(self, obj: object, path: str, keys: Sequence[str], required: Sequence[str] = ()) -> Mapping:
        if not isinstance(obj, Mapping):
            self.fail(path, f"expected a mapping with keys {', '.join(keys)}; got {type(obj).__name__}")
        for key in obj:
            if key not in keys:
                where = f"{path}.{key}" if path else str(key)
                self.fail(
                    where, f"unknown key{did_you_mean(key, keys)}", hint=f"valid keys: {', '.join(keys)}"
                )
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
                self.fail(f"{path}.kind", f"unknown link kind {entry['kind']!r}{did_you_mean(entry['kind'], LINK_KINDS)}",
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
                    f"{path}[{i}]", f"unknown device or node {name!r}{did_you_mean(name, [*nodes, *devices])}"
                )
            kinds.append(name in devices)
        if kinds[0] != kinds[1]:
            self.fail(path, f"{obj} mixes a node and a device; give two nodes or two devices")
        if obj[0] == obj[1]:
            self.fail(path, f"{obj[0]!r} linked to itself; a node's own link is its intra_link")
        return (obj[0], obj[1]), kinds[0]


def _pair_get(table: Mapping[PairKey, Link], a: str, b: str) -> Link | None:
    return table.get((a, b)) or table.get((b, a))
