"""Calibration: measuring this host, calibration files, and how figures replace a type's efficiencies."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import yaml

from hetcc.errors import ClusterError
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.measure import Calibration, apply, apply_to_cluster, calibrate, preset_for_device_name
from hetcc.hardware.presets import PRESETS

A100, T4, CPU = PRESETS["A100-80GB"], PRESETS["T4"], PRESETS["cpu"]
T, G = 1e12, 1e9


def make(device_type="A100-80GB", **changes) -> Calibration:
    fields = dict(
        device_type=device_type, matmul_flops={"fp32": 15 * T}, memory_bandwidth_bps=1600 * G,
        kernel_overhead_s=7e-6, device_name="NVIDIA A100-SXM4-80GB", host="node0",
        torch_version="2.13.0", threads=8, date="2026-11-30T03:00:00Z",
    )  # fmt: skip
    return Calibration(**(fields | changes))


# ---- measuring this host -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured() -> Calibration:
    # One thread: on a loaded host, OpenMP threads that wait on each other make multi-threaded
    # timings swing by orders of magnitude; one thread gives stable figures for the sanity ranges.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return calibrate("cpu", dtypes=("fp32", "bfloat16"), quick=True)
    finally:
        torch.set_num_threads(threads)


def test_quick_cpu_calibration_gives_plausible_figures(measured):
    assert measured.device_type == "cpu" and measured.threads == 1
    assert list(measured.matmul_flops) == ["fp32", "bf16"]  # torch dtype names map to peak keys
    for flops in measured.matmul_flops.values():
        assert 1e8 < flops < 1e13  # sanity ranges for a CPU core, not timing thresholds
    assert 1e8 < measured.memory_bandwidth_bps < 1e12
    assert 1e-8 < measured.kernel_overhead_s < 1e-2
    assert measured.torch_version == torch.__version__ and measured.host and measured.device_name
    assert datetime.datetime.fromisoformat(measured.date.replace("Z", "+00:00")).tzinfo is not None


def test_measured_calibration_describes_itself(measured):
    text = measured.describe()
    assert text.startswith("calibration of cpu (") and ", 1 thread)" in text
    assert "matmul fp32" in text and "matmul bf16" in text and "GB/s" in text and " us" in text
    assert "datasheet" not in text  # a CPU has no datasheet peak to compare with


def test_gpu_calibration_describes_its_share_of_the_datasheet():
    lines = make(matmul_flops={"fp32": 15 * T, "fp8": 1 * T}).describe().splitlines()
    assert lines[0] == "calibration of A100-80GB (NVIDIA A100-SXM4-80GB)"  # threads are a CPU matter
    assert lines[1] == "  measured on host node0, torch 2.13.0, 2026-11-30T03:00:00Z"
    assert lines[2].split() == "matmul fp32 15 TFLOP/s (77% of the 19.5 TFLOP/s datasheet peak)".split()
    assert lines[3].split() == "matmul fp8 1 TFLOP/s".split()  # the A100 has no fp8 peak
    assert "(78% of the 2.039 TB/s datasheet peak)" in lines[4] and lines[5].split()[-2:] == ["7", "us"]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(dtypes=("tf32",)), "tf32 is a GPU tensor-core mode"),
        (dict(dtypes=("fp8",)), "cannot time fp8 matmuls"),
        (dict(dtypes=("int8",)), "no FLOP/s figure exists for dtype 'int8'"),
        (dict(dtypes=()), "dtypes is empty"),
        (dict(device="tpu:0"), "cannot read device 'tpu:0'"),
        (dict(device="meta"), "device type 'meta' is not supported"),
    ],
)
def test_calibrate_rejects_what_it_cannot_measure(kwargs, fragment):
    with pytest.raises(ClusterError, match=fragment):
        calibrate(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without a GPU")
def test_calibrate_cuda_without_gpu_says_so():
    with pytest.raises(ClusterError, match="torch sees no CUDA/ROCm GPU"):
        calibrate("cuda")


@pytest.mark.parametrize(
    "device_name, memory_gib, preset",
    [
        ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", 80, "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", 80, "H100-SXM"),
        ("NVIDIA H200", 141, "H200"),
        ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
        ("Tesla T4", 15, "T4"),
        ("NVIDIA L4", 22, "L4"),
        ("NVIDIA GeForce RTX 4090", 24, "RTX-4090"),
        ("NVIDIA GeForce RTX 3090", 24, "RTX-3090"),
        ("AMD Instinct MI250X/MI250", 64, "MI250X-GCD"),  # ROCm exposes one GCD as a device
        ("AMD Instinct MI300X", 192, "MI300X"),
        ("NVIDIA L40S", 48, None),  # not L4
        ("NVIDIA RTX A6000", 48, None),
    ],
)
def test_gpu_names_map_to_presets(device_name, memory_gib, preset):
    assert preset_for_device_name(device_name, memory_gib * 2**30) == preset


# ---- files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_load_round_trip_is_exact(tmp_path, measured, suffix):
    for calibration in (
        measured,
        make(matmul_flops={"fp32": 1 / 3 * T, "bf16": math.pi * 1e14}, threads=None),
    ):
        path = calibration.save(tmp_path / f"cal{suffix}")
        assert Calibration.load(path) == calibration


def test_hand_written_file_may_use_units_and_unquoted_dates(tmp_path):
    path = tmp_path / "a100.yml"
    path.write_text(
        "device_type: a100_80gb\ndate: 2026-11-30\nmatmul_flops: {fp32: 15 TFLOP/s, bf16: 250 tflops}\n"
        "memory_bandwidth_bps: 1.6 TB/s\nkernel_overhead_s: 7 us\n"
    )
    loaded = Calibration.load(path)
    assert loaded.matmul_flops == {"fp32": 15 * T, "bf16": 250 * T}
    assert loaded.memory_bandwidth_bps == 1.6e12 and loaded.kernel_overhead_s == 7e-6
    assert loaded.date == "2026-11-30" and loaded.threads is None and loaded.host == ""


GOOD = {
    "device_type": "cpu",
    "matmul_flops": {"fp32": 1e11},
    "memory_bandwidth_bps": 1e10,
    "kernel_overhead_s": 3e-6,
}


@pytest.mark.parametrize(
    "change, fragments",
    [
        ({"matmul_flops": None}, ["missing required key 'matmul_flops'"]),
        ({"matmul_flops": {"fp32": -1}}, ["matmul_flops.fp32", "positive"]),
        ({"matmul_flops": {"fp33": 1e11}}, ["matmul_flops.fp33", "did you mean 'fp32'"]),
        ({"matmul_flops": {}}, ["matmul_flops", "expected a mapping of dtype to FLOP/s"]),
        ({"memory_bandwidth_bps": "fast"}, ["memory_bandwidth_bps", "cannot read 'fast'"]),
        ({"kernel_overhead_s": "3 parsecs"}, ["kernel_overhead_s", "unknown unit"]),
        ({"memory_bandwith_bps": 1e10}, ["memory_bandwith_bps", "did you mean 'memory_bandwidth_bps'"]),
        ({"threads": 0}, ["threads", "positive integer"]),
        ({"device_type": ""}, ["device_type", "non-empty string"]),
        ({"host": 7}, ["host", "expected a string"]),
        ({"version": 2}, ["version", "unsupported version 2"]),
    ],
)
def test_malformed_file_errors_name_file_and_field(tmp_path, change, fragments):
    data = {k: v for k, v in (GOOD | change).items() if v is not None}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterError) as caught:
        Calibration.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and all(f in message for f in fragments), message


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        ("list.yaml", "- 1\n- 2\n", "expected a mapping"),
        ("syntax.yaml", "device_type: [cpu\n", "invalid YAML at line"),
        ("syntax.json", "{", "invalid JSON at line 1"),
        ("cal.txt", "device_type: cpu\n", "must end in .yaml, .yml or .json"),
    ],
)
def test_unreadable_files_name_the_file(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ClusterError, match=fragment) as caught:
        Calibration.load(path)
    assert str(path) in str(caught.value)


def test_missing_file_and_bad_save_suffix(tmp_path):
    with pytest.raises(ClusterError, match="cannot read the calibration file"):
        Calibration.load(tmp_path / "absent.yaml")
    with pytest.raises(ClusterError, match="must end in .yaml, .yml or .json"):
        make().save(tmp_path / "cal.txt")


# ---- applying ------------------------------------------------------------------------------------
def test_apply_to_gpu_makes_achievable_equal_measured():
    calibrated = apply(A100, make())
    assert calibrated.achievable_flops("fp32") == pytest.approx(15 * T, rel=1e-12)
    assert calibrated.peak_flops == A100.peak_flops  # datasheet peaks stay; efficiency carries the change
    assert calibrated.matmul_efficiency == pytest.approx(15 / 19.5)
    assert calibrated.achievable_flops("bf16") == pytest.approx(312 * T * 15 / 19.5)
    assert calibrated.achievable_bandwidth_bps == pytest.approx(1600 * G, rel=1e-12)
    assert calibrated.memory_bandwidth_bps == A100.memory_bandwidth_bps
    assert calibrated.kernel_overhead_s == 7e-6 and calibrated.name == A100.name


def test_measured_host_costs_replace_the_types_and_unmeasured_ones_keep_it(tmp_path):
    measured = make(
        host_op_s=11e-6, host_backward_op_s=40e-6, host_fused_op_s=90e-6, host_fused_backward_op_s=1e-4
    )
    calibrated = apply(A100, measured)
    assert (calibrated.host_op_s, calibrated.host_backward_op_s) == (11e-6, 40e-6)
    assert (calibrated.host_fused_op_s, calibrated.host_fused_backward_op_s) == (90e-6, 1e-4)
    assert "11 us forward, 40 us backward" in measured.describe()
    assert "90 us forward, 100 us backward" in measured.describe()
    kept = apply(A100, make())  # a file without them (older, or a CPU's) leaves the type's own
    assert (kept.host_op_s, kept.host_backward_op_s) == (A100.host_op_s, A100.host_backward_op_s)
    path = measured.save(tmp_path / "a100.yaml")
    assert Calibration.load(path).host_backward_op_s == 40e-6
    with pytest.raises(ClusterError, match="host_op_s"):
        make(host_op_s=-1.0)


def test_apply_with_several_dtypes_matches_each_measured_rate():
    calibrated = apply(A100, make(matmul_flops={"fp32": 15 * T, "bf16": 200 * T}))
    best_share = 15 / 19.5  # fp32 reaches a larger share of its peak than bf16 (200/312)
    assert calibrated.matmul_efficiency == pytest.approx(best_share)
    assert calibrated.achievable_flops("fp32") == pytest.approx(15 * T, rel=1e-12)
    assert calibrated.achievable_flops("bf16") == pytest.approx(200 * T, rel=1e-12)
    assert calibrated.peak_flops["bf16"] < A100.peak_flops["bf16"]
    assert calibrated.achievable_flops("tf32") == pytest.approx(156 * T * best_share)  # unmeasured


def test_apply_above_datasheet_raises_the_peak():
    calibrated = apply(A100, make(matmul_flops={"fp32": 21 * T}, memory_bandwidth_bps=2100 * G))
    assert calibrated.matmul_efficiency == 1.0 and calibrated.peak_flops["fp32"] == 21 * T
    assert calibrated.memory_efficiency == 1.0 and calibrated.memory_bandwidth_bps == 2100 * G


def test_apply_ignores_dtypes_the_type_lacks_and_fails_when_none_is_left():
    calibrated = apply(T4, make("T4", matmul_flops={"fp32": 4 * T, "bf16": 30 * T}))
    assert "bf16" not in calibrated.peak_flops
    assert calibrated.achievable_flops("fp32") == pytest.approx(4 * T, rel=1e-12)
    with pytest.raises(
        ClusterError, match="measured bf16 matmuls, but device type 'T4' has peaks only for fp32, fp16"
    ):
        apply(T4, make("T4", matmul_flops={"bf16": 30 * T}))


def test_apply_to_cpu_sets_peaks_to_measured_at_full_efficiency():
    calibrated = apply(CPU, make("cpu", matmul_flops={"fp32": 5e10}, memory_bandwidth_bps=8e9))
    assert calibrated.peak_flops["fp32"] == 5e10 and calibrated.matmul_efficiency == 1.0
    assert calibrated.achievable_flops("fp32") == 5e10
    assert calibrated.memory_bandwidth_bps == 8e9 and calibrated.memory_efficiency == 1.0
    assert calibrated.achievable_bandwidth_bps == 8e9 and calibrated.kernel_overhead_s == 7e-6
    # Unmeasured dtypes keep the rate they had: their placeholder peak times the old efficiency.
    assert calibrated.achievable_flops("bf16") == pytest.approx(CPU.achievable_flops("bf16"))
    assert calibrated.memory_bytes == CPU.memory_bytes


# ---- clusters ------------------------------------------------------------------------------------
MIXED = {
    "nodes": [
        {"name": "n0", "intra_link": {"kind": "nvlink", "bandwidth": "300 GB/s"}, "devices": [{"type": "A100-80GB", "count": 2}]},
        {"name": "n1", "intra_link": {"kind": "pcie", "bandwidth": "32 GB/s"}, "devices": [{"type": "T4", "count": 2, "memory": "15 GiB"}]},
    ],
    "inter_node_link": {"kind": "ethernet", "bandwidth": "25 Gb/s"},
    "links": [{"between": ["a100-80gb-1", "t4-0"], "bandwidth": "10 GB/s"}],
}  # fmt: skip


def test_apply_to_cluster_replaces_matching_types_only():
    cluster = Cluster.from_spec(MIXED)
    calibrated = apply_to_cluster(cluster, [make("a100_80gb")])  # names match like presets
    by_name = {d.name: d for d in calibrated.devices}
    assert by_name["a100-80gb-0"].type == apply(A100, make())
    assert by_name["t4-1"].type == T4 and by_name["t4-1"].memory_bytes == 15 * 2**30
    assert [d.name for d in calibrated.devices] == [d.name for d in cluster.devices]
    assert calibrated.bandwidth_matrix_bps() == cluster.bandwidth_matrix_bps()
    assert calibrated.latency_matrix_s() == cluster.latency_matrix_s()
    assert Cluster.from_spec(calibrated.to_spec()) == calibrated != cluster
    assert apply_to_cluster(cluster, []) == cluster


def test_apply_to_cluster_rejects_mixed_up_files():
    cluster = Cluster.from_spec(MIXED)
    with pytest.raises(ClusterError, match="calibration of 'H100-SXM' .* matches no device type"):
        apply_to_cluster(cluster, [make("H100-SXM")])
    with pytest.raises(ClusterError, match="two calibrations of device type 'A100-80GB'"):
        apply_to_cluster(cluster, [make(), make(host="node1")])
    with pytest.raises(ClusterError, match="no device type 'A100' in the cluster; did you mean 'A100-80GB'"):
        cluster.replace_types({"A100": A100})


def write_cluster(folder, calibration_entry) -> object:
    folder.mkdir(exist_ok=True)
    spec = {"nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s"},
                       "devices": [{"type": "cpu", "count": 2}]}], "calibration": calibration_entry}  # fmt: skip
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("entry", ["cal/cpu.yaml", ["cal/cpu.yaml"]])
def test_cluster_file_calibration_is_relative_to_the_file(tmp_path, monkeypatch, entry):
    (tmp_path / "cluster" / "cal").mkdir(parents=True)
    calibration = make("cpu", matmul_flops={"fp32": 5e10}, memory_bandwidth_bps=8e9)
    calibration.save(tmp_path / "cluster" / "cal" / "cpu.yaml")
    path = write_cluster(tmp_path / "cluster", entry)
    monkeypatch.chdir(tmp_path)  # not the cluster file's folder
    cluster = Cluster.from_file(path)
    assert cluster.types == (apply(CPU, calibration),)
    assert cluster.types[0].achievable_flops("fp32") == 5e10


def test_cluster_file_calibration_errors_name_both_files(tmp_path):
    folder = tmp_path / "c"
    path = write_cluster(folder, ["cpu.yaml", "missing.yaml"])
    make("cpu").save(folder / "cpu.yaml")
    with pytest.raises(ClusterError, match=r"cluster.yaml: calibration\[1\]: .*missing.yaml: cannot read"):
        Cluster.from_file(path)
    (folder / "cpu.yaml").write_text(yaml.safe_dump(GOOD | {"matmul_flops": {"fp32": "many"}}))
    with pytest.raises(
        ClusterError, match=r"cluster.yaml: calibration\[0\]: .*cpu.yaml: matmul_flops.fp32: cannot read"
    ):
        Cluster.from_file(path)
    make("T4").save(folder / "cpu.yaml")
    with pytest.raises(
        ClusterError, match=r"cluster.yaml: calibration: calibration of 'T4' .* matches no device type"
    ):
        Cluster.from_file(write_cluster(folder, "cpu.yaml"))
    with pytest.raises(ClusterError, match=r"cluster.yaml: calibration: expected a non-empty list"):
        Cluster.from_file(write_cluster(folder, []))
