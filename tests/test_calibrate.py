"""Calibration: measuring this host, calibration files, and how figures replace a type's efficiencies."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import yaml

from hetcc.errors import ClusterError
from hetcc.hardware.calibration import MIN_KERNEL_SHARE
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.measure import Calibration, apply, apply_to_cluster, calibrate, preset_for_device_name
from hetcc.hardware.presets import PRESETS, RateCurve

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


def test_quick_cpu_calibration_records_rates_by_size(measured):
    curves = measured.flops_by_size
    assert {"gemm", "gemm_unaligned", "sdpa"} <= set(curves) <= {*curves, "sdpa_backward"}
    for op_class, by_dtype in curves.items():
        assert list(by_dtype) == ["fp32", "bf16"], op_class
        for points in by_dtype.values():
            assert points and all(0 < f < math.inf and 0 < rate < math.inf for f, rate in points)
            assert [f for f, _ in points] == sorted({f for f, _ in points})  # distinct, by size
    widths = [round((f / 2) ** (1 / 3)) for f, _ in curves["gemm"]["fp32"]]
    assert widths[:3] == [64, 128, 256]  # the quick plan's widths, always timed; larger ones if affordable
    unaligned = {2 * n * n * (n - 1) for n in (64, 128, 256, 512)}  # an odd output width, n - 1
    assert {f for f, _ in curves["gemm_unaligned"]["fp32"]} <= unaligned
    cpu = apply(CPU, measured)  # the curves become shares of the calibrated peaks
    assert {(c.op_class, c.dtype) for c in cpu.rate_curves} == {(c, k) for c in curves for k in curves[c]}
    assert all(0 < share < math.inf for c in cpu.rate_curves for _, share in c.points)


def test_measured_calibration_describes_itself(measured):
    text = measured.describe()
    assert text.startswith("calibration of cpu (") and ", 1 thread)" in text
    assert "matmul fp32" in text and "matmul bf16" in text and "GB/s" in text and " us" in text
    assert "datasheet" not in text  # a CPU has no datasheet peak to compare with
    assert "gemm fp32" in text and "sdpa bf16" in text and "(FLOP/s @ FLOPs per call)" in text


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
        make(flops_by_size=CURVES),
    ):
        path = calibration.save(tmp_path / f"cal{suffix}")
        assert Calibration.load(path) == calibration


CURVES = {
    "gemm": {"fp32": ((1e6, 1 * T), (1 / 3 * 1e9, 12 * T)), "bf16": ((2**40, 250 * T),)},
    "gemm_unaligned": {"fp32": ((1e9, 3 * T),)},
    "sdpa": {"fp32": ((1.7e10, 9 * T),)},
    "sdpa_backward": {"fp32": ((1.7e10, 7 * T),)},
}


def test_version_1_files_load_without_rates_by_size(tmp_path):
    path = tmp_path / "old.yaml"  # as hetcc wrote them before rates by size
    path.write_text(
        "version: 1\ndevice_type: A100-80GB\nmatmul_flops:\n  fp32: 15000000000000.0\n"
        "memory_bandwidth_bps: 1600000000000.0\nkernel_overhead_s: 7.0e-06\nhost_op_s: null\n"
        "host_backward_op_s: null\nhost_fused_op_s: null\nhost_fused_backward_op_s: null\n"
        "device_name: NVIDIA A100-SXM4-80GB\nhost: node0\ntorch_version: 2.13.0\nthreads: 8\n"
        "date: '2026-11-30T03:00:00Z'\n"
    )
    old = Calibration.load(path)
    assert old == make() and old.flops_by_size == {}
    assert apply(A100, old).rate_curves == () and "FLOPs per call" not in old.describe()
    assert "version: 2" in make().save(tmp_path / "new.yaml").read_text()


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
        ({"version": 3}, ["version", "unsupported version 3; this hetcc reads 1 and 2"]),
        (
            {"flops_by_size": {"gemm": {"fp32": [[1e6]]}}},
            ["flops_by_size.gemm.fp32[0]", "[FLOPs per call, FLOP/s]"],
        ),
        ({"flops_by_size": {"gemm": {"fp32": [[1e6, -1]]}}}, ["flops_by_size.gemm.fp32[0][1]", "positive"]),
        ({"flops_by_size": {"gemm": {"fp32": []}}}, ["flops_by_size.gemm.fp32", "non-empty list"]),
        ({"flops_by_size": {"gem": {"fp32": [[1e6, 1e9]]}}}, ["flops_by_size.gem", "did you mean 'gemm'"]),
        (
            {"flops_by_size": {"gemm": {"fp32": [[1e6, 1e9], [1e6, 2e9]]}}},
            ["flops_by_size.gemm.fp32", "same FLOPs"],
        ),
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


def shares(device_type, op_class, key) -> list[float]:
    """A type's curve as a flat list: FLOPs, share, FLOPs, share, ..."""
    return [x for point in device_type.rate_curve(op_class, key).points for x in point]


def test_apply_turns_rates_by_size_into_shares_of_the_calibrated_peak():
    peak = A100.peak_flops["fp32"]
    calibrated = apply(A100, make(kernel_overhead_s=0.0, flops_by_size={
        "gemm": {"fp32": ((1e6, 0.2 * peak), (1e9, 0.8 * peak)), "bf16": ((1e9, 156 * T),)},
        "sdpa": {"fp8": ((1e9, 1 * T),)},  # the A100 has no fp8 peak: left out
    }))  # fmt: skip
    assert shares(calibrated, "gemm", "fp32") == pytest.approx([1e6, 0.2, 1e9, 0.8])
    assert shares(calibrated, "gemm", "bf16") == pytest.approx([1e9, 0.5])  # of 312 TFLOP/s
    assert calibrated.rate_curve("sdpa", "fp8") is None and calibrated.rate_curve("sdpa", "fp32") is None
    # the per-kernel overhead the cost model adds to every kernel comes off each measured call ...
    overhead = apply(A100, make(kernel_overhead_s=5e-6, flops_by_size={"gemm": {"fp32": ((1e8, 1e13),)}}))
    ((_, share),) = overhead.rate_curve("gemm", "fp32").points
    assert share * peak == pytest.approx(1e8 / (1e-5 - 5e-6))
    # ... but leaves at least MIN_KERNEL_SHARE of it, so a call as fast as an empty kernel is not free
    tiny = apply(A100, make(kernel_overhead_s=5e-6, flops_by_size={"gemm": {"fp32": ((1e6, 1e12),)}}))
    ((_, share),) = tiny.rate_curve("gemm", "fp32").points
    assert share * peak == pytest.approx(1e6 / (1e-6 * MIN_KERNEL_SHARE))
    # on a CPU the shares are of the measured peaks, and may exceed 1 where a shape beats the mix
    cpu = apply(CPU, make("cpu", matmul_flops={"fp32": 5e10}, kernel_overhead_s=0.0,
                          flops_by_size={"gemm": {"fp32": ((1e6, 2.5e10), (1e9, 6e10))}}))  # fmt: skip
    assert shares(cpu, "gemm", "fp32") == pytest.approx([1e6, 0.5, 1e9, 1.2])
    assert cpu.achievable_flops("fp32") == 5e10  # the constant rate, for other ops, is unchanged


def test_rate_curves_are_checked_and_travel_with_the_type():
    curve = RateCurve("gemm", "fp32", ((1e9, 0.8), (1e6, 0.2)))
    assert curve.points == ((1e6, 0.2), (1e9, 0.8))  # sorted by size
    a100 = A100.replace(rate_curves=(curve,))
    assert a100 != A100 and hash(a100) != hash(A100) and a100.rate_curve("gemm", "fp32") == curve
    assert type(A100).from_dict(a100.to_dict()) == a100  # to_dict writes plain lists and dicts
    for bad, fragment in [
        ({"op_class": "gem", "dtype": "fp32", "points": [(1e6, 0.5)]}, "op class is not one of"),
        ({"op_class": "gemm", "dtype": "fp32", "points": []}, "all positive"),
        ({"op_class": "gemm", "dtype": "fp32", "points": [(1e6, 0.0)]}, "all positive"),
        ({"op_class": "gemm", "dtype": "fp32", "points": [(1e6, 0.5), (1e6, 0.6)]}, "same FLOPs"),
        ({"op_class": "gemm", "dtype": "fp32", "points": "fast"}, "rate_curves"),
    ]:
        with pytest.raises(ClusterError, match=fragment):
            A100.replace(rate_curves=(bad,))
    with pytest.raises(ClusterError, match="two curves for one op class and dtype"):
        A100.replace(rate_curves=(curve, curve))


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
