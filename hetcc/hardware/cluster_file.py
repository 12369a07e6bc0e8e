"""Cluster files: the format, reading a YAML/JSON file into ``ClusterParts`` (``Cluster.from_file``
builds the cluster from them) and writing parts back as a self-contained spec (``Cluster.to_spec``).

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

Device types are presets (``hetcc.hardware.presets``, matched ignoring case and punctuation, with aliases
such as ``H100``) or ``custom_types``; a custom type needs ``vendor``, ``peak_flops``, ``memory`` and ``memory_bandwidth`` unless it has a
``base``. A device entry expands ``count`` devices (default 1) named ``<type>-<k>`` (k counts that
type across the cluster) or, given ``name``, ``<name><i>`` (``name`` itself when count is 1). Device
entries may override ``memory`` (kept per device) and ``peak_flops`` (per dtype), ``memory_bandwidth``,
``matmul_efficiency``, ``memory_efficiency``, ``kernel_overhead`` and the host costs ``host_op``,
``host_backward_op``, ``host_fused_op``, ``host_fused_backward_op`` (a derived type ``<type>@<first
device>``). Links need ``kind`` and ``bandwidth``; ``latency`` defaults per kind
(``hetcc.hardware.parts.DEFAULT_LATENCY_S``).
A node with several devices needs an ``intra_link``, and every two nodes need ``inter_node_link`` or
a ``links`` entry. A ``calibration`` file replaces the efficiency profile of the device type it names
(``hetcc.hardware.calibration.apply``); naming a type the cluster lacks is an error. Quantities are numbers in
SI base units or strings with a unit ("80 GiB", "25 Gb/s", "2 us"; see ``hetcc.hardware.quantities``).

The format is declared below in ``hetcc.hardware.schema`` records, so an error names the file, the field
path, the reason and the closest valid name; what the records cannot say (type names, device names,
which link an override inherits from) ``_Builder`` checks with the same locations.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.calibration import Calibration, apply_to_cluster
from hetcc.hardware.parts import (
    DEFAULT_LATENCY_S,
    DEFAULT_MEMORY_RESERVE,
    LINK_KINDS,
    ClusterParts,
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
from hetcc.hardware.schema import (
    Choice,
    Count,
    Fraction,
    ListOf,
    Quantity,
    Record,
    Table,
    Text,
    Where,
    check_path,
    load_file,
)


def read_file(path: str | os.PathLike[str]) -> ClusterParts:
    """Read a ``.yaml``/``.yml``/``.json`` cluster file; relative calibration paths start at its folder."""
    check_path(path, "cluster file")  # before anything treats it as a path
    path = pathlib.Path(path)
    return read_spec(load_file(path, "cluster file"), str(path), path.parent)


def read_spec(spec: object, source: str = "<spec>", base_dir: pathlib.Path | None = None) -> ClusterParts:
    """Read a parsed cluster file; errors name ``source`` and the field. Relative calibration paths
    start at ``base_dir`` (default: the current directory)."""
    where = Where(source)
    return _Builder().parts(_file_format(base_dir or pathlib.Path())(spec, where), where)


def write_spec(parts: ClusterParts) -> dict[str, Any]:
    """A self-contained spec: every type written out in SI numbers, so reading it back needs no presets."""
    spec: dict[str, Any] = {"name": parts.name} if parts.name else {}
    spec["memory_reserve"] = parts.memory_reserve
    spec["custom_types"] = [_type_spec(t) for t in parts.types]
    spec["nodes"] = []
    for node, members in parts.nodes.items():
        intra = parts.intra_links.get(node)
        link = {"intra_link": _link_spec(intra)} if intra else {}
        spec["nodes"].append({"name": node, **link, "devices": [_device_spec(d) for d in members]})
    if parts.inter_node_link:
        spec["inter_node_link"] = _link_spec(parts.inter_node_link)
    overrides = parts.pair_overrides()
    if overrides:
        spec["links"] = [{"between": list(pair), **_link_spec(link)} for pair, link, _ in overrides]
    return spec


# ---- the format ------------------------------------------------------------------------------
# File key -> (Link field, kind).
_LINK_FIELDS = {
    "kind": ("kind", Choice(LINK_KINDS, "link kind")),
    "bandwidth": ("bandwidth_bps", Quantity("bytes/s")),
    "latency": ("latency_s", Quantity("seconds")),
}
# What a device entry or a custom type may set on its type besides peak_flops: file key -> (DeviceType field, kind).
_TYPE_FIELDS = {
    "memory_bandwidth": ("memory_bandwidth_bps", Quantity("bytes/s")),
    "matmul_efficiency": ("matmul_efficiency", Fraction()),
    "memory_efficiency": ("memory_efficiency", Fraction()),
    "kernel_overhead": ("kernel_overhead_s", Quantity("seconds")),
    "host_op": ("host_op_s", Quantity("seconds")),
    "host_backward_op": ("host_backward_op_s", Quantity("seconds")),
    "host_fused_op": ("host_fused_op_s", Quantity("seconds")),
    "host_fused_backward_op": ("host_fused_backward_op_s", Quantity("seconds")),
}
_LINK_KEYS = {key: kind for key, (_, kind) in _LINK_FIELDS.items()}
_TYPE_KEYS = {
    "peak_flops": Table(DTYPE_KEYS, Quantity("flop/s"), "dtype to FLOP/s, e.g. {bf16: 312 TFLOP/s}")
} | {key: kind for key, (_, kind) in _TYPE_FIELDS.items()}
_LINK = Record(_LINK_KEYS, required=("kind", "bandwidth"))
MAX_DEVICES = 1024  # devices in one cluster file: the planner's search and link tables grow with the square
_DEVICE = Record({"type": Text(), "count": Count(maximum=MAX_DEVICES), "name": Text(), "memory": Quantity("bytes"), **_TYPE_KEYS},
                 required=("type",))  # fmt: skip
_CUSTOM_TYPE = Record(
    {
        "name": Text(),
        "base": Text(),
        "vendor": Choice(VENDORS, "vendor"),
        "memory": Quantity("bytes"),
        **_TYPE_KEYS,
    },
    required=("name",),
)
_NODE = Record({"name": Text(), "intra_link": _LINK, "devices": ListOf(_DEVICE, nonempty=True)},
               required=("name", "devices"))  # fmt: skip


def _between(value: object, where: Where) -> tuple[str, str]:
    """``between: [x, y]`` of a links entry: two node or device names."""
    if not isinstance(value, list) or len(value) != 2:
        where.fail(f"expected two node or device names; got {value!r}")
    return Text()(value[0], where.at(0)), Text()(value[1], where.at(1))


_OVERRIDE = Record({"between": _between, **_LINK_KEYS}, required=("between",))


@dataclasses.dataclass(frozen=True)
class _Calibrations:
    """The ``calibration`` key: one calibration file or a non-empty list, relative to ``base_dir``, loaded."""

    base_dir: pathlib.Path

    def __call__(self, value: object, where: Where) -> list[Calibration]:
        if isinstance(value, str):
            return [self.load(value, where)]
        return ListOf(self.load, nonempty=True)(value, where)

    def load(self, value: object, where: Where) -> Calibration:
        path = self.base_dir / pathlib.Path(Text()(value, where)).expanduser()
        with where.blame():
            return Calibration.load(path)


def _file_format(base_dir: pathlib.Path) -> Record:
    """The top level of a cluster file, whose calibration files are found from ``base_dir``."""
    return Record(
        {
            "name": Text(), "memory_reserve": Fraction(zero=True), "nodes": ListOf(_NODE, nonempty=True),
            "inter_node_link": _LINK, "links": ListOf(_OVERRIDE), "custom_types": ListOf(_CUSTOM_TYPE),
            "calibration": _Calibrations(base_dir),
        },
        required=("nodes",),
    )  # fmt: skip


# ---- from a checked file to parts ------------------------------------------------------------
class _Builder:
    """Turns a checked cluster file into ClusterParts: resolves type names, names devices, inherits links."""

    def __init__(self) -> None:
        self.custom: dict[str, DeviceType] = {}  # type_key(name) -> type
        self.default_name_counts: dict[str, int] = {}  # type slug -> devices named after it so far
        self.device_paths: dict[str, str] = {}  # device name -> entry that made it
        self.nodes: set[str] = set()  # node names seen so far

    def parts(self, spec: Mapping[str, Any], where: Where) -> ClusterParts:
        for i, entry in enumerate(spec.get("custom_types", [])):
            self.custom_type(entry, where.at("custom_types", i))
        devices: list[Device] = []
        intra: dict[str, Link] = {}
        for i, node in enumerate(spec["nodes"]):
            self.node(node, where.at("nodes", i), devices, intra)
        inter = (
            _link(spec["inter_node_link"], where.at("inter_node_link")) if "inter_node_link" in spec else None
        )
        node_pairs, device_pairs = _overrides(spec.get("links", []), where, devices, intra, inter)
        reserve = spec.get("memory_reserve", DEFAULT_MEMORY_RESERVE)
        with where.blame():
            parts = ClusterParts(devices, intra, inter, node_pairs, device_pairs, reserve, spec.get("name"))
        with where.at("calibration").blame():
            return apply_to_cluster(parts, spec.get("calibration", []))

    def lookup_type(self, name: str, where: Where) -> DeviceType:
        """The custom type or preset called ``name`` (ignoring case and punctuation)."""
        if type_key(name) in self.custom:
            return self.custom[type_key(name)]
        try:
            return get_preset(name)
        except ClusterError:  # neither: name the closest of the presets and the custom types
            known = {type_key(n): n for n in PRESETS} | {k: t.name for k, t in self.custom.items()}
            match = difflib.get_close_matches(type_key(name), list(known), n=1, cutoff=0.5)
            closest = f"; closest is {known[match[0]]!r}" if match else ""
            hint = f"presets: {', '.join(PRESETS)}; or define it under custom_types"
            where.fail(f"unknown device type {name!r}{closest}", hint=hint)

    def custom_type(self, entry: Mapping[str, Any], where: Where) -> None:
        """Define a custom type: a preset (``base``) with changes, or a new type given in full."""
        name = entry["name"]
        if type_key(name) in self.custom:
            where.at("name").fail(f"custom type {name!r} is defined twice")
        base = self.lookup_type(entry["base"], where.at("base")) if "base" in entry else None
        changes = _type_changes(entry, base) | {"name": name}
        if "vendor" in entry:
            changes["vendor"] = entry["vendor"]
        if "memory" in entry:
            changes["memory_bytes"] = int(entry["memory"])
        needed = ("vendor", "peak_flops", "memory", "memory_bandwidth")
        if base is None and (missing := [k for k in needed if k not in entry]):
            where.fail(f"custom type {name!r} lacks {', '.join(missing)}",
                       hint="give them, or start from a preset: base: <preset>")  # fmt: skip
        with where.blame():
            made = (
                base.replace(**changes)
                if base
                else DeviceType(**(VENDOR_EFFICIENCY[entry["vendor"]] | changes))
            )
        self.custom[type_key(name)] = made

    def node(
        self, entry: Mapping[str, Any], where: Where, devices: list[Device], intra: dict[str, Link]
    ) -> None:
        name = entry["name"]
        if name in self.nodes:
            where.at("name").fail(f"node {name!r} is listed twice", hint="give every node a distinct name")
        self.nodes.add(name)
        if "intra_link" in entry:
            intra[name] = _link(entry["intra_link"], where.at("intra_link"))
        for j, device in enumerate(entry["devices"]):
            devices += self.device_entry(device, where.at("devices", j), name)
            if len(devices) > MAX_DEVICES:
                where.at("devices", j).fail(
                    f"more than {MAX_DEVICES} devices in the cluster; hetcc plans at most that many"
                )

    def device_entry(self, entry: Mapping[str, Any], where: Where, node: str) -> list[Device]:
        """The ``count`` devices an entry expands to; type changes make a derived type ``<type>@<first>``."""
        base = self.lookup_type(entry["type"], where.at("type"))
        names = self.device_names(entry, base, where)
        dtype = base
        if changes := _type_changes(entry, base):
            with where.blame():
                dtype = base.replace(name=f"{base.name}@{names[0]}", **changes)
        memory = int(entry["memory"]) if "memory" in entry else None
        return [Device(n, dtype, node, memory_override_bytes=memory) for n in names]

    def device_names(self, entry: Mapping[str, Any], base: DeviceType, where: Where) -> list[str]:
        """``<name><i>`` (``name`` alone for one device) or ``<type>-<k>``; a name used before fails."""
        count = entry.get("count", 1)
        if "name" in entry:
            names = [entry["name"]] if count == 1 else [f"{entry['name']}{i}" for i in range(count)]
        else:
            slug, first = base.name.lower(), self.default_name_counts.get(base.name.lower(), 0)
            names = [f"{slug}-{first + i}" for i in range(count)]
            self.default_name_counts[slug] = first + count
        for name in names:
            if name in self.device_paths:
                where.fail(f"device name {name!r} is already used by {self.device_paths[name]}",
                           hint="give the entry a distinct `name:` prefix")  # fmt: skip
            self.device_paths[name] = where.path
        return names


def _type_changes(entry: Mapping[str, Any], base: DeviceType | None) -> dict[str, Any]:
    """The DeviceType fields ``entry`` sets; its peak_flops add to ``base``'s or replace them per dtype."""
    changes = {field: entry[key] for key, (field, _) in _TYPE_FIELDS.items() if key in entry}
    if "peak_flops" in entry:
        changes["peak_flops"] = dict(base.peak_flops if base else {}) | entry["peak_flops"]
    return changes


def _link(entry: Mapping[str, Any], where: Where, base: Link | None = None) -> Link:
    """A Link from ``entry``, taking fields it leaves out from ``base`` (the link it overrides).

    A latency left out is the base's, or the kind's typical one when the entry sets a new kind.
    """
    fields = dataclasses.asdict(base) if base else {}
    fields |= {field: entry[key] for key, (field, _) in _LINK_FIELDS.items() if key in entry}
    if "latency" not in entry and "kind" in entry and (base is None or base.kind != entry["kind"]):
        fields["latency_s"] = DEFAULT_LATENCY_S[entry["kind"]]
    if "kind" not in fields or "bandwidth_bps" not in fields:
        where.fail("no link to inherit from here: give kind and bandwidth")
    return Link(**fields)


def _overrides(
    entries: list[Mapping[str, Any]],
    where: Where,
    devices: list[Device],
    intra: dict[str, Link],
    inter: Link | None,
) -> tuple[dict[PairKey, Link], dict[PairKey, Link]]:
    """Node-pair then device-pair overrides (a device pair may refine its nodes' override)."""
    by_name, nodes = {d.name: d for d in devices}, {d.node for d in devices}
    checked = []
    for i, entry in enumerate(entries):
        at = where.at("links", i)
        if not any(key in entry for key in _LINK_FIELDS):
            at.fail("an override needs at least one of kind, bandwidth, latency")
        checked.append((_is_device_pair(entry["between"], at.at("between"), nodes, by_name), entry, at))
    node_pairs: dict[PairKey, Link] = {}
    device_pairs: dict[PairKey, Link] = {}
    for is_device, entry, at in sorted(checked, key=lambda row: row[0]):
        a, b = entry["between"]
        if is_device:
            na, nb = by_name[a].node, by_name[b].node
            base = intra.get(na) if na == nb else _pair_get(node_pairs, na, nb) or inter
        else:
            base = inter
        table = device_pairs if is_device else node_pairs
        if _pair_get(table, a, b):
            at.fail(f"a second override for {a!r} and {b!r}")
        table[(a, b)] = _link(entry, at, base)
    return node_pairs, device_pairs


def _is_device_pair(pair: PairKey, where: Where, nodes: set[str], devices: Mapping[str, Device]) -> bool:
    """Check that ``pair`` is two devices or two distinct nodes; True for devices."""
    kinds = []
    for i, name in enumerate(pair):
        if name in nodes and name in devices:
            where.at(i).fail(f"{name!r} is both a node and a device; rename one")
        if name not in nodes and name not in devices:
            where.at(i).fail(f"unknown device or node {name!r}{did_you_mean(name, [*nodes, *devices])}")
        kinds.append(name in devices)
    if kinds[0] != kinds[1]:
        where.fail(f"{list(pair)} mixes a node and a device; give two nodes or two devices")
    if pair[0] == pair[1]:
        where.fail(f"{pair[0]!r} linked to itself; a node's own link is its intra_link")
    return kinds[0]


def _pair_get(table: Mapping[PairKey, Link], a: str, b: str) -> Link | None:
    return table.get((a, b)) or table.get((b, a))


# ---- from parts to a spec --------------------------------------------------------------------
def _type_spec(t: DeviceType) -> dict[str, Any]:
    fields = {key: getattr(t, field) for key, (field, _) in _TYPE_FIELDS.items()}
    return {
        "name": t.name,
        "vendor": t.vendor,
        "peak_flops": dict(t.peak_flops),
        "memory": t.memory_bytes,
        **fields,
    }


def _link_spec(link: Link) -> dict[str, Any]:
    return {key: getattr(link, field) for key, (field, _) in _LINK_FIELDS.items()}


def _device_spec(d: Device) -> dict[str, Any]:
    memory = {} if d.memory_override_bytes is None else {"memory": d.memory_override_bytes}
    return {"name": d.name, "type": d.type.name, **memory}
