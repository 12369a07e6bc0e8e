import math

import pytest
import torch

import hetcc
from hetcc.errors import AnalysisError, ClusterError
from hetcc.hardware.calibration import Calibration, apply
from hetcc.hardware.presets import HOST_FIELDS, RateCurve, get_preset
from hetcc.ir import info
from hetcc.passes.cost import UNALIGNED_TENSOR_CORE_SHARE, block_times, cost


class MLP(torch.nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _costed(model, inputs, types, **kw):
    analysis = hetcc.analyze(model, inputs)
    cost(analysis.graph, device_types=types, **kw)
    return analysis


def _node(analysis, name):
    return next(n for n in analysis.graph.graph.nodes if n.name == name)


def _no_host(device_type):
    """The type with no host cost per op: its node times are the roofline alone."""
    return device_type.replace(**dict.fromkeys(HOST_FIELDS, 0.0))


class Head(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.head = torch.nn.Linear(1024, vocab, bias=False)

    def forward(self, x):
        return self.head(x)


def test_roofline_time_is_the_max_of_compute_and_memory_plus_overhead():
    a100 = _no_host(get_preset("A100-80GB"))
    analysis = _costed(MLP(), (torch.randn(512, 256),), [a100])
    linear = info(_node(analysis, "linear"))
    compute = linear.fwd_flops / a100.achievable_flops("fp32")
    memory = linear.bytes / a100.achievable_bandwidth_bps
    assert dict(linear.fwd_s)["A100-80GB"] == pytest.approx(max(compute, memory) + a100.kernel_overhead_s)
    gelu = info(_node(analysis, "gelu"))  # memory-bound: backward is two memory passes
    assert dict(gelu.fwd_s)["A100-80GB"] == pytest.approx(
        gelu.bytes / a100.achievable_bandwidth_bps + a100.kernel_overhead_s
    )
    assert dict(gelu.bwd_s)["A100-80GB"] == pytest.approx(
        2 * gelu.bytes / a100.achievable_bandwidth_bps + a100.kernel_overhead_s
    )


def test_faster_device_types_get_smaller_times_and_views_cost_nothing():
    types = [get_preset("H100-SXM"), get_preset("T4")]
    analysis = _costed(MLP(), (torch.randn(512, 256),), types)
    fwd, bwd = block_times(analysis.graph, [b.nodes for b in analysis.blocks], [t.name for t in types])
    assert all(h < t for h, t in zip(fwd["H100-SXM"], fwd["T4"]))
    assert all(b > f for b, f in zip(bwd["T4"], fwd["T4"]))  # backward of matmuls costs about 2x
    views = [n for n in analysis.graph.graph.nodes if n.op == "get_attr"]
    assert all(info(n).fwd_s == () for n in views)


def test_dtype_changes_the_peak_and_missing_dtypes_fall_back():
    a100, t4 = get_preset("A100-80GB"), get_preset("T4")
    fp32 = _costed(MLP(1024), (torch.randn(2048, 1024),), [a100, t4])
    bf16 = _costed(MLP(1024), (torch.randn(2048, 1024),), [a100, t4], dtype=torch.bfloat16)
    fp16 = _costed(MLP(1024), (torch.randn(2048, 1024),), [a100, t4], dtype=torch.float16)
    linear32, linear_bf16 = info(_node(fp32, "linear")), info(_node(bf16, "linear"))
    linear_fp16 = info(_node(fp16, "linear"))
    assert dict(linear_bf16.fwd_s)["A100-80GB"] < dict(linear32.fwd_s)["A100-80GB"] / 5  # tensor cores
    # T4 has no bf16 units: bf16 runs at its fp32 rate, while fp16 uses its tensor cores.
    assert dict(linear_bf16.fwd_s)["T4"] == dict(linear32.fwd_s)["T4"]
    assert dict(linear_fp16.fwd_s)["T4"] < dict(linear32.fwd_s)["T4"] / 3


def test_inference_has_no_backward_time():
    analysis = _costed(MLP(), (torch.randn(8, 256),), [get_preset("L4")], training=False)
    assert all(s == 0.0 for n in analysis.graph.graph.nodes for _, s in info(n).bwd_s)


def test_symbolic_sizes_must_be_evaluated_first():
    from torch.export import Dim

    analysis = hetcc.analyze(MLP(), (torch.randn(8, 256),), dynamic_shapes=({0: Dim("batch")},))
    with pytest.raises(AnalysisError, match="evaluate"):
        cost(analysis.graph, device_types=[get_preset("L4")])


def test_device_type_without_any_usable_peak_is_a_cluster_error():
    odd = get_preset("A100-80GB").replace(name="fp8-only", peak_flops={"fp8": 1e15})
    with pytest.raises(ClusterError, match="fp8-only"):
        _costed(MLP(), (torch.randn(8, 256),), [odd])


def test_fused_chain_is_one_memory_pass_on_gpus_and_its_ops_on_cpus():
    from transformers.activations import NewGELUActivation

    from hetcc.passes.fuse import fuse

    class TanhGelu(torch.nn.Module):  # GPT-2's gelu_new: seven pointwise ops
        def __init__(self):
            super().__init__()
            self.act = NewGELUActivation()

        def forward(self, x):
            return self.act(x * 2.0)

    a100, cpu = _no_host(get_preset("A100-80GB")), get_preset("cpu")
    analysis = hetcc.analyze(TanhGelu(), (torch.randn(64, 1024, requires_grad=True),))
    fuse(analysis.graph)
    cost(analysis.graph, device_types=[a100, cpu])
    fused = next(n for n in analysis.graph.graph.nodes if info(n).members)
    record = info(fused)
    assert len(record.members) >= 5
    gpu_fwd = record.bytes / a100.achievable_bandwidth_bps + a100.kernel_overhead_s
    assert dict(record.fwd_s)["A100-80GB"] == pytest.approx(gpu_fwd)
    member_fwd = sum(
        max(m.bytes / cpu.achievable_bandwidth_bps, 0) + cpu.kernel_overhead_s
        for m in record.members
        if m.bytes
    )
    assert dict(record.fwd_s)["cpu"] == pytest.approx(member_fwd)
    # on a CPU the group's ops run under autograd: its backward is theirs, nothing recomputed
    unfused = hetcc.analyze(TanhGelu(), (torch.randn(64, 1024, requires_grad=True),))
    cost(unfused.graph, device_types=[a100, cpu])
    ops_bwd = sum(dict(info(n).bwd_s).get("cpu", 0.0) for n in unfused.graph.graph.nodes if info(n).bwd_s)
    assert dict(record.bwd_s)["cpu"] == pytest.approx(ops_bwd, rel=1e-6)


def _gelu_choice(types, rows: int = 64, fuse: str = "cost"):
    from transformers.activations import NewGELUActivation

    from hetcc.passes.fuse import fusion_candidates

    analysis = hetcc.analyze(NewGELUActivation(), (torch.randn(rows, 64, requires_grad=True),))
    candidates = fusion_candidates(analysis.graph)
    assert len(candidates) == 1 and len(candidates[0].members) >= 7
    return analysis, cost(analysis.graph, device_types=types, candidates=candidates, fuse=fuse)


def test_a_group_fuses_only_on_the_device_types_where_its_kernel_call_beats_its_ops():
    slow_call = get_preset("A100-80GB").replace(host_fused_op_s=1e-3, host_fused_backward_op_s=2e-3)
    free_call = slow_call.replace(name="free-call", host_fused_op_s=0.0, host_fused_backward_op_s=0.0)
    cpu = get_preset("cpu")
    analysis, choice = _gelu_choice([slow_call, free_call, cpu])
    # tiny kernels: the slow call's host time loses to seven small ops; a free call's one memory pass wins;
    # a CPU runs the ops either way and replays them in backward
    assert choice.fused == {"A100-80GB": frozenset(), "free-call": frozenset({0}), "cpu": frozenset()}
    fused_s, ops_s = choice.compared["A100-80GB"][0]
    assert fused_s == pytest.approx(1e-3 + 2e-3, rel=0.01) and ops_s < fused_s
    assert choice.compared["free-call"][0][0] < choice.compared["free-call"][0][1]
    # where it fuses, the last member carries the kernel's time and the others none
    (candidate,) = choice.candidates
    times = [dict(info(m).fwd_s)["free-call"] for m in candidate.members]
    assert times[:-1] == [0.0] * (len(times) - 1) and times[-1] > 0
    assert all(dict(info(m).fwd_s)["A100-80GB"] > 0 for m in candidate.members if info(m).bytes)
    # the plan's note names each stage type's count and how to override
    note = choice.note(["A100-80GB", "free-call"])
    assert "A100-80GB: 0 of 1 fused" in note and "free-call: 1 of 1 fused" in note and "HETCC_FUSE" in note
    assert choice.note(["free-call"]) is None  # every group fused where the stages run: nothing to say


def test_fusing_everything_or_nothing_is_the_users_to_force():
    slow_call = get_preset("A100-80GB").replace(host_fused_op_s=1e-3, host_fused_backward_op_s=2e-3)
    _, every = _gelu_choice([slow_call, get_preset("cpu")], fuse="all")
    assert every.fused == {"A100-80GB": frozenset({0}), "cpu": frozenset({0})}
    _, none = _gelu_choice([slow_call], fuse="off")
    assert none.fused == {"A100-80GB": frozenset()}


def test_larger_tensors_make_the_same_group_pay_on_a_gpu():
    # a host where one fused call costs what the torch.library custom op cost (190 / 690 us)
    a100 = get_preset("A100-80GB").replace(host_fused_op_s=190e-6, host_fused_backward_op_s=690e-6)
    _, small = _gelu_choice([a100], rows=64)
    _, large = _gelu_choice([a100], rows=1 << 18)  # 16M elements: eight memory passes against one
    assert small.fused[a100.name] == frozenset() and large.fused[a100.name] == frozenset({0})
    # the launcher's call (the preset) costs the host less than the group's seven ops: it fuses at any size
    _, small = _gelu_choice([get_preset("A100-80GB")], rows=64)
    assert small.fused["A100-80GB"] == frozenset({0})


def test_queue_adds_gpu_time_when_the_host_is_ahead_and_host_time_when_it_is_behind():
    from hetcc.passes.cost import _queue

    # one long kernel hides the host cost of the three small ops issued while it runs
    assert _queue([100.0, 1.0, 1.0, 1.0], [10.0, 10.0, 10.0, 10.0]) == [110.0, 1.0, 1.0, 1.0]
    # small kernels behind a slow host: each adds the host's time
    assert _queue([1.0, 1.0, 1.0], [10.0, 10.0, 10.0]) == [11.0, 10.0, 10.0]
    # no host cost (a CPU): the GPU times themselves
    assert _queue([3.0, 4.0], [0.0, 0.0]) == [3.0, 4.0]


class Chain(torch.nn.Module):
    """Small pointwise ops (host-bound on a GPU) between two matmuls (device-bound)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        x = self.fc1(x)
        for _ in range(20):
            x = torch.tanh(x) * 0.5
        return self.fc2(x)


def test_small_ops_on_a_gpu_cost_their_host_time_and_a_cpu_pays_none():
    h100, cpu = get_preset("H100-SXM"), get_preset("cpu")
    analysis = _costed(Chain(64), (torch.randn(16, 64, requires_grad=True),), [h100, cpu])
    small = [
        info(n)
        for n in analysis.graph.graph.nodes
        if info(n).fwd_s and info(n).bytes and not info(n).fwd_flops
    ]
    small = [r for r in small if r.bytes < 1e5]
    assert len(small) >= 40
    for record in small[1:]:  # each tiny op adds the host's time per op (its kernel takes far less)
        assert dict(record.fwd_s)["H100-SXM"] == pytest.approx(h100.host_op_s, rel=0.05)
        assert dict(record.bwd_s)["H100-SXM"] == pytest.approx(h100.host_backward_op_s, rel=0.05)
        assert dict(record.fwd_s)["cpu"] < h100.host_op_s  # the CPU's own roofline, no host queue
    fwd, _ = block_times(analysis.graph, [b.nodes for b in analysis.blocks], [h100.name, cpu.name])
    assert sum(fwd[h100.name]) >= 40 * h100.host_op_s


def test_a_large_kernel_hides_the_host_cost_of_the_ops_issued_while_it_runs():
    h100 = get_preset("H100-SXM")
    slow_host = h100.replace(name="slow-host", host_op_s=1e-3)
    analysis = _costed(Chain(4096), (torch.randn(8192, 4096),), [_no_host(h100), slow_host])
    fwd, _ = block_times(analysis.graph, [b.nodes for b in analysis.blocks], ["H100-SXM", "slow-host"])
    roofline, queued = sum(fwd["H100-SXM"]), sum(fwd["slow-host"])
    ops = sum(1 for n in analysis.graph.graph.nodes if info(n).fwd_s and info(n).bytes)
    # every op's host millisecond counts (the host is the bottleneck), but not on top of the kernels
    assert ops * 1e-3 <= queued < ops * 1e-3 + roofline


def test_autocast_prices_the_casts_of_fp32_inputs_of_lower_precision_ops():
    a100 = _no_host(get_preset("A100-80GB"))
    inputs = (torch.randn(2048, 1024, requires_grad=True),)
    plain = _costed(MLP(1024), inputs, [a100], dtype=torch.bfloat16)
    mixed = _costed(MLP(1024), inputs, [a100], dtype=torch.bfloat16, autocast=True)
    for name in ("linear", "linear_1"):  # input (the model's, then gelu's: fp32), weight and bias
        node = _node(mixed, name)
        inputs = [a for a in node.all_input_nodes if info(a).dtype == torch.float32]
        cast_s = 6 * sum(math.prod(info(a).shape) for a in inputs) / a100.achievable_bandwidth_bps
        extra = dict(info(node).fwd_s)["A100-80GB"] - dict(info(_node(plain, name)).fwd_s)["A100-80GB"]
        assert len(inputs) == 3
        # the casts' bytes, and their launches where the host is not ahead of the device
        assert cast_s * (1 - 1e-9) <= extra <= cast_s + len(inputs) * a100.kernel_overhead_s
    gelu = "gelu"  # autocast leaves it alone
    assert dict(info(_node(mixed, gelu)).fwd_s) == pytest.approx(dict(info(_node(plain, gelu)).fwd_s))


def test_bf16_gemms_off_tensor_core_alignment_run_at_a_fraction_of_the_rate():
    from hetcc.passes.cost import unaligned_gemm_note

    a100 = _no_host(get_preset("A100-80GB"))

    def costed(vocab, dtype):
        return _costed(Head(vocab), (torch.randn(4096, 1024),), [a100], dtype=dtype)

    def compute_s(vocab, dtype):
        return dict(info(_node(costed(vocab, dtype), "linear")).fwd_s)["A100-80GB"] - a100.kernel_overhead_s

    aligned, odd = compute_s(50304, torch.bfloat16), compute_s(50257, torch.bfloat16)
    assert odd / aligned == pytest.approx(50257 / 50304 / UNALIGNED_TENSOR_CORE_SHARE, rel=1e-3)
    assert compute_s(50257, torch.float32) / compute_s(50304, torch.float32) < 1  # fp32 runs no tensor cores
    # the plan says which GEMM and what to do about it
    note = unaligned_gemm_note(costed(50257, torch.bfloat16).graph)
    assert "%linear (N=50257)" in note and "multiple of 8" in note
    assert unaligned_gemm_note(costed(50304, torch.bfloat16).graph) is None
    assert unaligned_gemm_note(costed(50257, torch.float32).graph) is None


# ---- rates measured by size (hetcc calibrate's curves) ---------------------------------------------
def _calibrated(flops_by_size):
    """An A100 calibrated with ``flops_by_size`` (FLOP/s given as shares of its peaks) and a constant
    rate of 0.8 of peak, no per-kernel overhead, no host cost and unbounded bandwidth: a GEMM's time
    is its FLOPs over its rate."""
    a100 = get_preset("A100-80GB")
    curves = {
        op_class: {
            key: [(f, share * a100.peak_flops[key]) for f, share in points] for key, points in by.items()
        }
        for op_class, by in flops_by_size.items()
    }
    calibration = Calibration(
        device_type="A100-80GB", matmul_flops={"fp32": 0.8 * a100.peak_flops["fp32"]},
        memory_bandwidth_bps=1e18, kernel_overhead_s=0.0, flops_by_size=curves,
    )  # fmt: skip
    return _no_host(apply(a100, calibration))


def _seconds_per_flop(analysis, name, type_name="A100-80GB"):
    record = info(_node(analysis, name))
    return dict(record.fwd_s)[type_name] / record.fwd_flops, dict(record.bwd_s)[type_name] / record.bwd_flops


def test_a_rate_curve_interpolates_in_log_flops_and_clamps_at_its_ends():
    curve = RateCurve("gemm", "fp32", ((1e6, 0.2), (1e9, 0.8), (1e12, 0.9)))
    assert curve.share(1e3) == curve.share(1e6) == 0.2 and curve.share(1e15) == curve.share(1e12) == 0.9
    assert curve.share(math.sqrt(1e6 * 1e9)) == pytest.approx(0.5)  # halfway in log FLOPs
    assert curve.share(1e7) == pytest.approx(0.2 + 0.6 / 3) and curve.share(1e9) == pytest.approx(0.8)
    assert RateCurve("sdpa", "bf16", ((1e9, 0.4),)).share(1.0) == 0.4  # one point: a constant


def test_a_small_gemm_runs_at_its_measured_small_share():
    a100 = _calibrated({"gemm": {"fp32": [(1e6, 0.2), (1e9, 0.8)]}})
    small = _costed(MLP(16), (torch.randn(8, 16),), [a100])  # 16 kFLOP per linear: below the curve
    large = _costed(MLP(1024), (torch.randn(4096, 1024),), [a100])  # 34 GFLOP: above it
    small_fwd, small_bwd = _seconds_per_flop(small, "linear")
    large_fwd, large_bwd = _seconds_per_flop(large, "linear")
    assert small_fwd / large_fwd == pytest.approx(4.0) and small_bwd / large_bwd == pytest.approx(4.0)
    assert large_fwd == pytest.approx(1 / (0.8 * a100.peak_flops["fp32"]))
    # in between, the share interpolated at the node's FLOPs per call
    flops = info(_node(small, "linear")).fwd_flops
    middle = _costed(
        MLP(16),
        (torch.randn(8, 16),),
        [_calibrated({"gemm": {"fp32": [(flops / 10, 0.2), (flops * 10, 0.8)]}})],
    )
    assert _seconds_per_flop(middle, "linear")[0] == pytest.approx(1 / (0.5 * a100.peak_flops["fp32"]))


def test_nodes_priced_from_a_curve_say_so_in_their_notes_and_the_plan():
    from hetcc.passes.cost import cost_notes

    a100 = _calibrated({"gemm": {"fp32": [(1e6, 0.2), (1e9, 0.8)]}})
    analysis = _costed(MLP(16), (torch.randn(8, 16),), [a100, get_preset("cpu")])
    notes = info(_node(analysis, "linear")).notes
    assert "rate by size measured on A100-80GB: gemm 20% of peak" in notes
    assert not any("cpu" in note for note in notes)  # the preset has no curve: the constant rate
    assert not any("rate by size" in note for note in info(_node(analysis, "gelu")).notes)
    (line,) = [n for n in cost_notes(analysis.graph) if "measured by size" in n]
    assert "2 on A100-80GB" in line


def test_an_old_calibration_without_curves_prices_exactly_as_before(tmp_path):
    path = tmp_path / "a100.yaml"
    path.write_text(
        "version: 1\ndevice_type: A100-80GB\nmatmul_flops: {fp32: 1.5e13}\n"
        "memory_bandwidth_bps: 1.6e12\nkernel_overhead_s: 7.0e-06\n"
    )
    a100 = _no_host(apply(get_preset("A100-80GB"), Calibration.load(path)))
    assert a100.rate_curves == ()
    analysis = _costed(MLP(), (torch.randn(512, 256),), [a100])
    for name in ("linear", "linear_1"):
        record = info(_node(analysis, name))
        compute, memory = record.fwd_flops / a100.achievable_flops("fp32"), record.bytes / 1.6e12
        assert dict(record.fwd_s)["A100-80GB"] == max(compute, memory) + 7e-6
        assert not any("rate by size" in note for note in record.notes)


def test_an_unaligned_half_precision_gemm_runs_at_its_own_measured_curve():
    aligned_curve, unaligned_curve = [(1e6, 0.1), (1e10, 0.6)], [(1e6, 0.05), (1e10, 0.3)]
    both = _calibrated({"gemm": {"bf16": aligned_curve}, "gemm_unaligned": {"bf16": unaligned_curve}})
    aligned_only = _calibrated({"gemm": {"bf16": aligned_curve}}).replace(name="aligned-only")

    def seconds(vocab, type_name):
        analysis = _costed(
            Head(vocab), (torch.randn(4096, 1024),), [both, aligned_only], dtype=torch.bfloat16
        )
        return dict(info(_node(analysis, "linear")).fwd_s)[type_name], info(_node(analysis, "linear")).notes

    (aligned, _), (odd, notes) = seconds(50304, "A100-80GB"), seconds(50257, "A100-80GB")
    assert odd / aligned == pytest.approx(50257 / 50304 * 0.6 / 0.3)  # both beyond the curves' ends
    assert "rate by size measured on A100-80GB: gemm_unaligned 30% of peak" in notes
    # without an unaligned curve, the aligned one with the fixed penalty
    assert seconds(50257, "aligned-only")[0] / seconds(50304, "aligned-only")[0] == pytest.approx(
        50257 / 50304 / UNALIGNED_TENSOR_CORE_SHARE
    )


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_runs_at_its_measured_forward_and_backward_shares():
    qkv = tuple(torch.randn(2, 4, 128, 32) for _ in range(3))
    gemm = [(1e3, 0.5)]  # beside the constant rate's 0.8 (matmul_efficiency)
    measured = _calibrated(
        {"gemm": {"fp32": gemm}, "sdpa": {"fp32": [(1e9, 0.3)]}, "sdpa_backward": {"fp32": [(1e9, 0.15)]}}
    )
    forward_only = _calibrated({"sdpa": {"fp32": [(1e9, 0.3)]}}).replace(name="forward-only")
    gemms_only = _calibrated({"gemm": {"fp32": gemm}}).replace(name="gemms-only")
    analysis = _costed(Attention(), qkv, [measured, forward_only, gemms_only])
    (name,) = [n.name for n in analysis.graph.graph.nodes if "scaled_dot_product" in str(n.target)]
    peak = measured.peak_flops["fp32"]
    assert _seconds_per_flop(analysis, name) == pytest.approx((1 / (0.3 * peak), 1 / (0.15 * peak)))
    assert _seconds_per_flop(analysis, name, "forward-only") == pytest.approx((1 / (0.3 * peak),) * 2)
    # a GEMM curve does not price attention: the constant rate does, as before
    assert _seconds_per_flop(analysis, name, "gemms-only") == pytest.approx((1 / (0.8 * peak),) * 2)
    assert (
        "rate by size measured on A100-80GB: sdpa 30%, sdpa_backward 15% of peak"
        in info(_node(analysis, name)).notes
    )
