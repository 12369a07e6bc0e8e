"""Cluster model: presets, units, file format, link resolution and the errors a bad file gets."""

from __future__ import annotations

import json
import math
import pathlib
import pickle

import pytest
import yaml

from hetcc.errors import ClusterError
from hetcc.hardware.cluster import SAME_DEVICE, Cluster, Device, Link
from hetcc.hardware.presets import PRESETS, DeviceType, flops_key, get_preset
from hetcc.hardware.quantities import parse_quantity

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "clusters"
T, GiB = 1e12, 2**30


# ---- presets -----------------------------------------------------------------------------------
REQUIRED = ["V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H200", "L4", "T4", "RTX-3090", "RTX-4090",
            "MI210", "MI250X", "MI300X", "cpu"]  # fmt: skip


@pytest.mark.parametrize("name", REQUIRED)
def test_required_presets_exist_and_are_sane(name):
    t = PRESETS[name]
    assert t.name == name and t.vendor in ("nvidia", "amd", "cpu")
    assert t.memory_bytes > 0 and t.memory_bandwidth_bps > 0 and 0 < t.matmul_efficiency <= 1
    # Half precision (where present) is never slower than fp32 on these parts.
    half = t.peak_flops.get("bf16", t.peak_flops.get("fp16"))
    assert half is not None and half >= t.peak_flops["fp32"] * (0.5 if name == "cpu" else 1)


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("H100-SXM", "bf16", 989.4 * T),  # dense; 1979 is the sparse figure
        ("H100-SXM", "fp8", 1978.9 * T),
        ("H100-SXM", "tf32", 494.7 * T),
        ("A100-80GB", "bf16", 312 * T),
        ("A100-40GB", "fp32", 19.5 * T),
        ("V100-32GB", "fp16", 125 * T),
        ("T4", "fp16", 65 * T),
        ("L4", "bf16", 121 * T),
        ("RTX-4090", "bf16", 165.2 * T),
        ("RTX-3090", "fp16", 71 * T),
        ("MI250X", "bf16", 383 * T),
        ("MI300X", "bf16", 1307.4 * T),
        ("MI210", "fp16", 181 * T),
    ],
)
def test_datasheet_peaks(name, key, value):
    assert PRESETS[name].peak_flops[key] == pytest.approx(value)


@pytest.mark.parametrize(
    "name, memory_gib, bandwidth_gbps",
    [("A100-80GB", 80, 2039), ("A100-40GB", 40, 1555), ("H100-SXM", 80, 3350), ("H200", 141, 4800),
     ("MI300X", 192, 5300), ("T4", 16, 320), ("RTX-4090", 24, 1008), ("V100-32GB", 32, 900)],
)  # fmt: skip
def test_datasheet_memory(name, memory_gib, bandwidth_gbps):
    t = PRESETS[name]
    assert t.memory_bytes == memory_gib * GiB
    assert t.memory_bandwidth_bps == pytest.approx(bandwidth_gbps * 1e9)


def test_hardware_without_a_dtype_has_no_peak_for_it():
    assert "bf16" not in PRESETS["T4"].peak_flops and "bf16" not in PRESETS["V100-32GB"].peak_flops
    assert "fp8" not in PRESETS["A100-80GB"].peak_flops and "fp8" in PRESETS["H100-SXM"].peak_flops


@pytest.mark.parametrize(
    "dtype, key",
    [("float32", "fp32"), ("torch.float32", "fp32"), ("tf32", "tf32"), ("torch.bfloat16", "bf16"),
     ("float16", "fp16"), ("half", "fp16"), ("torch.float8_e4m3fn", "fp8"), ("BF16", "bf16")],
)  # fmt: skip
def test_dtype_names_map_to_peak_keys(dtype, key):
    assert flops_key(dtype) == key


def test_peak_accepts_torch_dtypes_and_uses_tf32_only_when_asked():
    torch = pytest.importorskip("torch")
    a100 = get_preset("A100-80GB")
    assert a100.peak(torch.float32) == 19.5 * T and a100.peak("tf32") == 156 * T
    assert a100.peak(torch.bfloat16) == 312 * T
    assert a100.achievable_flops(torch.bfloat16) == pytest.approx(312 * T * a100.matmul_efficiency)


def test_peak_for_a_missing_dtype_names_the_device_type():
    with pytest.raises(ClusterError, match=r"'T4' has no bf16 peak"):
        get_preset("T4").peak("bfloat16")
    with pytest.raises(ClusterError, match=r"dtype 'int8'"):
        get_preset("T4").peak("int8")


@pytest.mark.parametrize(
    "query, name",
    [("a100-80gb", "A100-80GB"), ("A100_80GB", "A100-80GB"), ("h100", "H100-SXM"), ("rtx4090", "RTX-4090"),
     ("RTX 3090", "RTX-3090"), ("mi300x", "MI300X"), ("CPU", "cpu"), ("v100", "V100-32GB")],
)  # fmt: skip
def test_get_preset_ignores_case_and_punctuation(query, name):
    assert get_preset(query) is PRESETS[name]


@pytest.mark.parametrize(
    "query, closest", [("A100-80", "A100-80GB"), ("MI250", "MI250X"), ("RTX-490", "RTX-4090")]
)
def test_get_preset_suggests_the_closest_name(query, closest):
    with pytest.raises(ClusterError, match=rf"unknown device type '{query}'; closest preset is '{closest}'"):
        get_preset(query)


def test_device_type_dict_round_trip_pickle_and_hash():
    t = get_preset("MI300X")
    data = json.loads(json.dumps(t.to_dict()))
    assert DeviceType.from_dict(data) == t and hash(DeviceType.from_dict(data)) == hash(t)
    assert pickle.loads(pickle.dumps(t)) == t
    changed = t.replace(matmul_efficiency=0.5)
    assert changed != t and changed.matmul_efficiency == 0.5 and changed.peak_flops == t.peak_flops


def test_device_type_validation_names_the_type():
    with pytest.raises(ClusterError, match=r"'H200'.*memory_bytes must be a positive integer"):
        get_preset("H200").replace(memory_bytes=-1)
    with pytest.raises(ClusterError, match=r"'X'.*'bf61'.*did you mean 'bf16'"):
        DeviceType("X", "nvidia", {"bf61": 1e12}, GiB, 1e9)
    with pytest.raises(ClusterError, match=r"unknown key 'memory'; did you mean 'memory_bytes'"):
        DeviceType.from_dict(get_preset("L4").to_dict() | {"memory": 1})


# ---- quantities --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, unit, value",
    [
        ("80 GB", "bytes", 80e9),
        ("80GiB", "bytes", 80 * GiB),
        ("1.5 TiB", "bytes", 1.5 * 2**40),
        (4096, "bytes", 4096),
        ("300 GB/s", "bytes/s", 300e9),
        ("25 Gb/s", "bytes/s", 25e9 / 8),  # bits
        ("25 Gbps", "bytes/s", 25e9 / 8),  # bits
        ("25 Gbit/s", "bytes/s", 25e9 / 8),
        ("100 GBps", "bytes/s", 100e9),  # bytes
        ("10 GB/sec", "bytes/s", 10e9),
        ("32 GiB/s", "bytes/s", 32 * GiB),
        ("1e9", "bytes/s", 1e9),
        ("2 us", "seconds", 2e-6),
        ("3 µs", "seconds", 3e-6),
        ("0.5 ms", "seconds", 5e-4),
        (0, "seconds", 0.0),
        ("312 TFLOP/s", "flop/s", 312e12),
        ("1.2 PFLOPS", "flop/s", 1.2e15),
        ("50 gflops", "flop/s", 50e9),
    ],
)
def test_parse_quantity(text, unit, value):
    assert parse_quantity(text, unit) == pytest.approx(value, rel=1e-12)


def test_parse_quantity_is_exact_for_microseconds():
    assert parse_quantity("2 us", "seconds") == 2e-6 and parse_quantity("20 us", "seconds") == 20e-6


@pytest.mark.parametrize(
    "value, unit, message",
    [
        ("80 Gb", "bytes", r"'80 Gb' is in bits; memory is given in bytes"),
        ("80 gigs", "bytes", r"unknown unit 'gigs'"),
        ("25 Gb/min", "bytes/s", r"unknown unit 'Gb/min' in '25 Gb/min'; did you mean 'Gb/s'"),
        ("fast", "bytes/s", r"cannot read 'fast'"),
        (-1, "bytes", r"-1 is not a quantity in bytes that is finite and positive"),
        (0, "bytes/s", r"0 is not a quantity in bytes/s"),
        ("-2 us", "seconds", r"finite and >= 0"),
        (True, "bytes", r"expected a quantity in bytes"),
        ("5 m", "seconds", r"did you mean 'ms'"),
    ],
)
def test_parse_quantity_rejects(value, unit, message):
    with pytest.raises(ClusterError, match=message):
        parse_quantity(value, unit)


# ---- building clusters ---------------------------------------------------------------------------
NVLINK = {"kind": "nvlink", "bandwidth": "300 GB/s", "latency": "2 us"}
PCIE = {"kind": "pcie", "bandwidth": "32 GB/s"}
ETHERNET = {"kind": "ethernet", "bandwidth": "25 Gb/s", "latency": "20 us"}


def two_nodes(**top) -> dict:
    """node0: 2× A100-80GB on NVLink; node1: 2× T4 on PCIe; node2: one RTX-4090; 25 Gb/s Ethernet."""
    return {
        "nodes": [
            {"name": "node0", "intra_link": NVLINK, "devices": [{"type": "A100-80GB", "count": 2}]},
            {
                "name": "node1",
                "intra_link": PCIE,
                "devices": [{"type": "T4", "count": 2, "memory": "15 GiB"}],
            },
            {"name": "node2", "devices": [{"type": "rtx4090", "name": "ws"}]},
        ],
        "inter_node_link": ETHERNET,
    } | top


def test_count_expands_and_names_devices():
    spec = {
        "nodes": [
            {"name": "a", "intra_link": NVLINK, "devices": [{"type": "A100-80GB", "count": 2}]},
            {"name": "b", "intra_link": NVLINK, "devices": [
                {"type": "a100_80gb", "count": 2}, {"type": "H100", "count": 3, "name": "gpu"},
                {"type": "T4", "name": "small"}]},
        ],
        "inter_node_link": ETHERNET,
    }  # fmt: skip
    c = Cluster.from_spec(spec)
    assert [d.name for d in c.devices] == ["a100-80gb-0", "a100-80gb-1", "a100-80gb-2", "a100-80gb-3",
                                           "gpu0", "gpu1", "gpu2", "small"]  # fmt: skip
    assert [d.index for d in c.devices] == list(range(8))
    assert [d.local_index for d in c.nodes["b"]] == list(range(6))
    assert [d.node for d in c.devices] == ["a"] * 2 + ["b"] * 6
    assert c.types == (PRESETS["A100-80GB"], PRESETS["H100-SXM"], PRESETS["T4"])
    assert c.device("gpu2").vendor == "nvidia" and c.device(c.devices[0]) is c.devices[0]


def test_link_resolution_order():
    spec = two_nodes(
        links=[
            {"between": ["node0", "node1"], "kind": "infiniband", "bandwidth": "100 Gb/s"},
            {"between": ["a100-80gb-0", "t4-1"], "bandwidth": "200 Gb/s"},  # beats the node pair
            {"between": ["a100-80gb-1", "a100-80gb-0"], "latency": "1 us"},  # beats node0's intra link
        ]
    )
    c = Cluster.from_spec(spec)
    assert c.link("a100-80gb-0", "a100-80gb-0") == SAME_DEVICE
    assert c.bandwidth("t4-0", "t4-0") == math.inf and c.latency("t4-0", "t4-0") == 0
    assert c.link("t4-0", "t4-1") == Link(32e9, 5e-6, "pcie")  # intra link, latency defaulted per kind
    assert c.link("a100-80gb-0", "a100-80gb-1") == Link(300e9, 1e-6, "nvlink")  # keeps intra bandwidth
    assert c.link("a100-80gb-1", "t4-0") == Link(12.5e9, 5e-6, "infiniband")  # node pair, default latency
    assert c.link("t4-1", "a100-80gb-0") == Link(25e9, 5e-6, "infiniband")  # device pair over node pair
    assert c.link("ws", "t4-0") == Link(25e9 / 8, 20e-6, "ethernet")  # inter-node link
    bandwidth, latency = c.bandwidth_matrix_bps(), c.latency_matrix_s()
    for a in c.devices:
        for b in c.devices:
            assert c.link(a, b) == c.link(b.name, a.name)
            assert (bandwidth[a.index][b.index], latency[a.index][b.index]) == (
                c.bandwidth(a, b),
                c.latency(a, b),
            )
    assert c.link("t4-0", "t4-1").transfer_s(32e9) == pytest.approx(1 + 5e-6)


def test_usable_memory_keeps_the_reserve():
    c = Cluster.from_spec(two_nodes())
    assert c.device("t4-0").memory_bytes == 15 * GiB  # per-device override, type unchanged
    assert c.device("t4-0").type is PRESETS["T4"]
    assert c.usable_memory_bytes("t4-0") == int(15 * GiB * 0.9)
    c = Cluster.from_spec(two_nodes(memory_reserve=0.25))
    assert c.usable_memory_bytes(c.device("ws")) == int(24 * GiB * 0.75)


def test_device_overrides_derive_a_type_and_custom_types():
    spec = two_nodes(custom_types=[
        {"name": "MyCard", "base": "A100-40GB", "memory": "48 GB"},
        {"name": "Npu", "vendor": "amd", "peak_flops": {"bf16": "400 TFLOP/s", "fp32": 5e13},
         "memory": "96 GiB", "memory_bandwidth": "2.4 TB/s"},
        {"name": "A100-80GB", "base": "A100-80GB", "matmul_efficiency": 0.8},  # calibrated preset
    ])  # fmt: skip
    spec["nodes"][2]["devices"] = [{"type": "RTX-4090", "peak_flops": {"bf16": "330 TFLOPS"}, "name": "ws"}]
    spec["nodes"].append(
        {"name": "node3", "devices": [{"type": "mycard"}, {"type": "Npu"}], "intra_link": PCIE}
    )
    c = Cluster.from_spec(spec)
    ws = c.device("ws").type
    assert ws.name == "RTX-4090@ws" and ws.peak_flops == {**PRESETS["RTX-4090"].peak_flops, "bf16": 330e12}
    assert c.device("mycard-0").memory_bytes == 48e9 and c.device("mycard-0").type.peak("bf16") == 312e12
    npu = c.device("npu-0").type
    assert npu.memory_bytes == 96 * GiB and npu.matmul_efficiency == 0.6  # vendor default
    assert c.device("a100-80gb-0").type.matmul_efficiency == 0.8
    assert len(c.types) == 5


def test_to_spec_round_trips_through_json_and_yaml(tmp_path):
    spec = two_nodes(
        name="lab",
        memory_reserve=0.2,
        links=[
            {"between": ["node0", "node1"], "bandwidth": "100 Gb/s"},
            {"between": ["ws", "t4-0"], "latency": "9 us"},
        ],
    )
    spec["nodes"][1]["devices"][0]["matmul_efficiency"] = 0.5
    c = Cluster.from_spec(spec)
    assert Cluster.from_spec(c.to_spec()) == c
    (tmp_path / "c.json").write_text(json.dumps(c.to_spec()))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(c.to_spec()))
    for loaded in (Cluster.from_file(tmp_path / "c.json"), Cluster.from_file(tmp_path / "c.yaml")):
        assert loaded == c and loaded.devices == c.devices
        assert all(loaded.link(a, b) == c.link(a, b) for a in c.devices for b in c.devices)
    assert Cluster.from_spec(two_nodes()) != c


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_files_load(path):
    c = Cluster.from_file(path)
    assert Cluster.from_spec(c.to_spec()) == c
    assert all(c.bandwidth(a, b) > 0 for a in c.devices for b in c.devices)
    text = c.describe()
    assert all(d.name in text for d in c.devices) and repr(c).startswith("Cluster(")


def test_example_files_describe_the_clusters_the_examples_rely_on():
    mixed = Cluster.from_file(EXAMPLES / "mixed_a100_t4.yaml")
    assert [t.name for t in mixed.types] == ["A100-80GB", "T4"] and len(mixed.devices) == 8
    assert mixed.bandwidth("a100-80gb-0", "t4-0") == 25e9 / 8
    cpu4 = Cluster.from_file(EXAMPLES / "cpu4.yaml")
    assert [d.name for d in cpu4.devices] == [f"cpu-{i}" for i in range(4)]
    assert cpu4.link("cpu-0", "cpu-3").kind == "loopback"
    vendors = {d.vendor for d in Cluster.from_file(EXAMPLES / "mixed_nvidia_amd.yaml").devices}
    assert vendors == {"nvidia", "amd"}


def test_programmatic_cluster():
    t4 = get_preset("T4")
    c = Cluster([Device("x", t4, "h"), Device("y", t4, "h")], intra_links={"h": Link(32e9, 5e-6, "pcie")})
    assert c.bandwidth("x", "y") == 32e9 and [d.index for d in c.devices] == [0, 1]
    with pytest.raises(ClusterError, match=r"two device types are named 'T4'"):
        Cluster(
            [Device("x", t4, "h"), Device("y", t4.replace(memory_bytes=GiB), "i")],
            inter_node_link=c.link("x", "y"),
        )
    with pytest.raises(ClusterError, match=r"no device 'z' in the cluster"):
        c.link("x", "z")


# ---- errors name the file, the field and the culprit -------------------------------------------
GOOD_NODE1 = (
    "  - {name: node1, intra_link: {kind: pcie, bandwidth: 32 GB/s}, devices: [{type: T4, count: 2}]}\n"
)
BAD_FILES = {
    "unknown_type": (
        "nodes:\n  - {name: node0, devices: [{type: A100-80G}]}\n",
        ["nodes[0].devices[0].type", "unknown device type 'A100-80G'", "closest is 'A100-80GB'"],
    ),
    "negative_memory": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n  - {name: node1, devices: [{type: T4, memory: -16 GB}]}\n"
        "inter_node_link: {kind: ethernet, bandwidth: 10 Gb/s}\n",
        ["nodes[1].devices[0].memory", "'-16 GB' is not a quantity in bytes that is finite and positive"],
    ),
    "zero_bandwidth": (
        "nodes:\n  - {name: node0, intra_link: {kind: nvlink, bandwidth: 0 GB/s}, devices: [{type: H100, count: 2}]}\n",
        ["nodes[0].intra_link.bandwidth", "'0 GB/s' is not a quantity in bytes/s"],
    ),
    "custom_type_zero_memory": (
        "custom_types: [{name: Card, base: L4, memory: 0}]\nnodes:\n  - {name: n, devices: [{type: Card}]}\n",
        ["custom_types[0].memory", "0 is not a quantity in bytes"],
    ),
    "no_inter_node_link": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n" + GOOD_NODE1,
        ["nodes 'node0' and 'node1' have no link between them", "inter_node_link"],
    ),
    "no_intra_link": (
        "nodes:\n  - {name: node0, devices: [{type: A100-80GB, count: 2}]}\n",
        ["node 'node0' has 2 devices but no intra_link"],
    ),
    "duplicate_device_name": (
        "nodes:\n  - {name: node0, intra_link: {kind: pcie, bandwidth: 32 GB/s}, devices: [{type: T4, count: 2, name: gpu}]}\n"
        "  - {name: node1, intra_link: {kind: pcie, bandwidth: 32 GB/s}, devices: [{type: T4, count: 2, name: gpu}]}\n"
        "inter_node_link: {kind: ethernet, bandwidth: 10 Gb/s}\n",
        ["nodes[1].devices[0]", "device name 'gpu0' is already used by nodes[0].devices[0]"],
    ),
    "duplicate_node_name": (
        "nodes:\n  - {name: node1, devices: [{type: T4}]}\n" + GOOD_NODE1,
        ["nodes[1].name", "node 'node1' is listed twice"],
    ),
    "typo_in_node_key": (
        "nodes:\n  - {name: node0, intra_lnik: {kind: pcie, bandwidth: 1 GB/s}, devices: [{type: T4}]}\n",
        ["nodes[0].intra_lnik", "unknown key; did you mean 'intra_link'?"],
    ),
    "typo_in_device_key": (
        "nodes:\n  - {name: node0, devices: [{type: T4, cuont: 2}]}\n",
        ["nodes[0].devices[0].cuont", "did you mean 'count'?"],
    ),
    "typo_at_top_level": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\ninter_node_links: {kind: ethernet, bandwidth: 1 Gb/s}\n",
        ["inter_node_links: unknown key; did you mean 'inter_node_link'?"],
    ),
    "unknown_node_in_override": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n" + GOOD_NODE1 + "links:\n  - {between: [node0, nod1], bandwidth: 1 Gb/s}\n",
        ["links[0].between[1]", "unknown device or node 'nod1'; did you mean 'node1'?"],
    ),
    "unknown_device_in_override": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n" + GOOD_NODE1 +
        "inter_node_link: {kind: ethernet, bandwidth: 1 Gb/s}\nlinks:\n  - {between: [t4-0, t4-7], latency: 1 us}\n",
        ["links[0].between[1]", "unknown device or node 't4-7'"],
    ),
    "override_mixes_node_and_device": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n" + GOOD_NODE1 + "links:\n  - {between: [node0, t4-1], bandwidth: 1 Gb/s}\n",
        ["links[0].between", "mixes a node and a device"],
    ),
    "override_without_base_lacks_kind": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n" + GOOD_NODE1 + "links:\n  - {between: [node0, node1], bandwidth: 1 Gb/s}\n",
        ["links[0]: no link to inherit from here: give kind and bandwidth"],
    ),
    "zero_count": (
        "nodes:\n  - {name: node0, devices: [{type: T4, count: 0}]}\n",
        ["nodes[0].devices[0].count", "expected a positive integer; got 0"],
    ),
    "bad_latency_string": (
        "nodes:\n  - {name: node0, devices: [{type: T4}]}\n" + GOOD_NODE1 + "inter_node_link: {kind: ethernet, bandwidth: 10 Gb/s, latency: 2 secs}\n",
        ["inter_node_link.latency", "unknown unit 'secs'"],
    ),
    "link_kind_typo": (
        "nodes:\n  - {name: node0, intra_link: {kind: nvlnk, bandwidth: 1 GB/s}, devices: [{type: T4, count: 2}]}\n",
        ["nodes[0].intra_link.kind", "unknown link kind 'nvlnk'; did you mean 'nvlink'?"],
    ),
    "custom_type_incomplete": (
        "custom_types: [{name: Card, vendor: nvidia, memory: 8 GB}]\nnodes:\n  - {name: n, devices: [{type: Card}]}\n",
        ["custom_types[0]", "custom type 'Card' lacks peak_flops, memory_bandwidth"],
    ),
    "vendor_typo": (
        "custom_types: [{name: C, vendor: nvida, peak_flops: {fp32: 1e12}, memory: 1 GB, memory_bandwidth: 1 GB/s}]\n"
        "nodes:\n  - {name: n, devices: [{type: C}]}\n",
        ["custom_types[0].vendor", "unknown vendor 'nvida'; did you mean 'nvidia'?", "vendors: nvidia, amd, cpu"],
    ),
    "peak_flops_dtype_typo": (
        "nodes:\n  - {name: n, devices: [{type: T4, peak_flops: {fp33: 9 TFLOP/s}}]}\n",
        ["nodes[0].devices[0].peak_flops.fp33", "unknown key; did you mean 'fp32'?"],
    ),
    "bad_efficiency": (
        "nodes:\n  - {name: n, devices: [{type: T4, matmul_efficiency: 1.5}]}\n",
        ["nodes[0].devices[0].matmul_efficiency", "expected a number in (0, 1]; got 1.5"],
    ),
    "memory_reserve_out_of_range": (
        "memory_reserve: 1.5\nnodes:\n  - {name: n, devices: [{type: T4}]}\n",
        ["memory_reserve", "expected a number in [0, 1); got 1.5"],
    ),
    "no_devices": ("nodes:\n  - {name: n, devices: []}\n", ["nodes[0].devices", "expected a non-empty list"]),
    "not_a_mapping": ("- just a list\n", ["expected a mapping with keys name, memory_reserve, nodes"]),
    "duplicate_yaml_key": (
        "nodes:\n  - name: n\n    devices: [{type: T4}]\n    name: m\n",
        ["invalid YAML at line 4", "duplicate key 'name'"],
    ),
    "malformed_yaml": (
        "nodes:\n  - name: n\n    devices: [{type: T4}\n  - name: m\n",
        ["invalid YAML at line 4"],
    ),
}  # fmt: skip


def load_error(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(ClusterError) as info:
        Cluster.from_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and message.count(str(path)) == 1, message
    return message


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_invalid_file_names_file_field_and_reason(tmp_path, case):
    text, fragments = BAD_FILES[case]
    message = load_error(tmp_path / f"{case}.yaml", text)
    for fragment in fragments:
        assert fragment in message


def test_single_device_node_needs_no_intra_link(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("nodes:\n  - {name: ws, devices: [{type: RTX-4090}]}\n")
    assert [d.name for d in Cluster.from_file(path).devices] == ["rtx-4090-0"]


def test_malformed_json_names_line(tmp_path):
    message = load_error(tmp_path / "c.json", '{"nodes": [\n  {"name": "n",}\n]}')
    assert "invalid JSON at line 2" in message


def test_unreadable_or_unsupported_files(tmp_path):
    assert "must end in .yaml, .yml or .json" in load_error(tmp_path / "c.toml", "nodes = []")
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ClusterError, match=r"missing\.yaml: cannot read the cluster file"):
        Cluster.from_file(missing)


def test_spec_errors_name_the_source():
    with pytest.raises(
        ClusterError, match=r"^lab: nodes\[0\]\.devices\[0\]\.type: unknown device type 'Z80'"
    ):
        Cluster.from_spec({"nodes": [{"name": "n", "devices": [{"type": "Z80"}]}]}, source="lab")
