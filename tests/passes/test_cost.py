import pytest
import torch

import hetcc
from hetcc.errors import AnalysisError, ClusterError
from hetcc.hardware.presets import get_preset
from hetcc.ir import info
from hetcc.passes.cost import block_times, cost


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


def test_roofline_time_is_the_max_of_compute_and_memory_plus_overhead():
    a100 = get_preset("A100-80GB")
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


def test_fused_chain_is_one_memory_pass_on_gpus_and_its_ops_plus_recompute_on_cpus():
    from transformers.activations import NewGELUActivation

    from hetcc.passes.fuse import fuse

    class TanhGelu(torch.nn.Module):  # GPT-2's gelu_new: seven pointwise ops
        def __init__(self):
            super().__init__()
            self.act = NewGELUActivation()

        def forward(self, x):
            return self.act(x * 2.0)

    a100, cpu = get_preset("A100-80GB"), get_preset("cpu")
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
    assert dict(record.bwd_s)["cpu"] > dict(record.fwd_s)["cpu"] * 2  # members' backward + the recompute
