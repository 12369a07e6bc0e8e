"""Row groups (a pointwise chain into softmax, layer_norm, rms_norm or a keepdim row mean) differentiate
in a generated Triton backward kernel, one program per row, and give eager autograd's gradients.

Kernels run on CPU through Triton's interpreter (see conftest.py); rows are short and mostly not a
power of two, so the masked lanes of every row reduction matter.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import export_and_fuse, forward_backward, forward_backward_counted, fused_groups
from test_fusion_autocast import assert_close_bf16
from test_fusion_codegen import kernels
from test_fusion_numerics import Chain

from hetcc.kernels import group_from_json, group_to_json, kernel_source
from hetcc.kernels.group import check_group

COLS = 13  # not a power of two: BLOCK is 16, three lanes per row are masked off


def parameter(*shape: int, seed: int = 1) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


class Weighted(torch.nn.Module):
    """``fn(self, x, y)`` with an optional weight and bias of the row length (as a norm layer holds)."""

    def __init__(self, fn, weight: bool = False, bias: bool = False, cols: int = COLS):
        super().__init__()
        self.fn = fn
        self.weight = parameter(cols, seed=1) if weight else None
        self.bias = parameter(cols, seed=2) if bias else None

    def forward(self, x, y):
        return self.fn(self, x, y)


def llama_rms_norm(m, x, y):
    """HF Llama's ``LlamaRMSNorm`` written out, on a residual sum: the variance in fp32, the normalized
    value cast back to the input dtype before the weight."""
    hidden = x + y
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + 1e-6)
    return m.weight * hidden.to(input_dtype)


def scaled_by_row_mean(m, x, y):
    """A per-row chain (mean -> neg -> mul -> exp) scaling the vector it was reduced from: the product
    gets adjoints from both the row mean and the vector multiply."""
    h = x * y
    return torch.exp(-h.mean(-1, keepdim=True) * 0.5) * h + x


# name -> (module, ops the one row group holds)
ROW_GROUPS = {
    "softmax": (Weighted(lambda m, x, y: torch.softmax(x * y + 1.0, dim=-1)), ["mul", "add", "softmax"]),
    "layer_norm_affine": (
        Weighted(lambda m, x, y: F.layer_norm(x + y, (COLS,), m.weight, m.bias), weight=True, bias=True),
        ["add", "layer_norm"],
    ),
    "layer_norm_plain": (Weighted(lambda m, x, y: F.layer_norm(x * y, (COLS,))), ["mul", "layer_norm"]),
    "layer_norm_weight_only": (
        Weighted(lambda m, x, y: F.layer_norm(x - y, (COLS,), m.weight), weight=True),
        ["sub", "layer_norm"],
    ),
    "layer_norm_bias_only": (
        Weighted(lambda m, x, y: F.layer_norm(x - y, (COLS,), None, m.bias), bias=True),
        ["sub", "layer_norm"],
    ),
    "rms_norm_weight": (
        Weighted(lambda m, x, y: F.rms_norm(x + y, (COLS,), m.weight, 1e-6), weight=True),
        ["add", "rms_norm"],
    ),
    "rms_norm_plain": (Weighted(lambda m, x, y: F.rms_norm(x * y, (COLS,))), ["mul", "rms_norm"]),
    "llama_rms_norm": (
        Weighted(llama_rms_norm, weight=True),
        ["add", "cast", "pow:2.0", "row_mean", "add", "rsqrt", "mul", "cast", "mul"],
    ),
    "scaled_by_row_mean": (
        Weighted(scaled_by_row_mean),
        ["mul", "row_mean", "neg", "mul", "exp", "mul", "add"],
    ),
}


def inputs(dtype: torch.dtype = torch.float32, rows: int = 4, cols: int = COLS) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(rows, cols, generator=generator), torch.randn(rows, cols, generator=generator)
    return x.to(dtype), y.to(dtype)


def assert_generated_backward_matches_eager(module, args, ops=None, close=None):
    """The module fuses into one row group whose training step runs the generated forward and backward
    kernels (no autograd replay) and equals eager's outputs and input and parameter gradients."""
    reference, fused = export_and_fuse(module, args)
    (group,) = fused_groups(fused)
    assert (group.kind, group.backward) == ("row", "generated"), fused.code
    assert ops is None or list(group.ops) == ops
    expected = forward_backward(reference, args)
    got, launches = forward_backward_counted(fused, args)
    assert {k: n for k, n in launches.items() if n} == {"fused_interpreter": 1, "backward_interpreter": 1}
    assert len(got[1]) == len(expected[1]) >= 2  # both inputs, and the weight and bias where present
    for have, want in zip(got[0] + got[1], expected[0] + expected[1], strict=True):
        if close is None:
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5)
        else:
            close(have, want)
    return group


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", sorted(ROW_GROUPS))
def test_row_group_backward_is_generated_and_equals_eager(name):
    module, ops = ROW_GROUPS[name]
    assert_generated_backward_matches_eager(module, inputs(), ops)


@pytest.mark.usefixtures("interpreter")
def test_llama_rms_norm_in_bf16_casts_like_hf_and_equals_eager():
    module = Weighted(llama_rms_norm, weight=True).to(torch.bfloat16)
    group = assert_generated_backward_matches_eager(module, inputs(torch.bfloat16), close=assert_close_bf16)
    assert [i.dtype for i in group.instrs if i.op == "cast"] == [torch.float32, torch.bfloat16]


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("cols", [2, 5, 16, 31])
def test_rows_of_any_length_and_leading_dims_equal_eager(cols):
    module = Weighted(lambda m, x, y: F.layer_norm(x + y, (cols,), m.weight, m.bias), True, True, cols)
    x, y = inputs(rows=6, cols=cols)
    assert_generated_backward_matches_eager(module, (x.view(2, 3, cols), y.view(2, 3, cols)))


@pytest.mark.usefixtures("interpreter")
def test_residual_sum_used_outside_gets_both_outputs_gradients():
    def block(m, x, y):
        h = x + y
        return h * 2.0, F.layer_norm(h, (COLS,), m.weight, m.bias)

    reference, fused = export_and_fuse(Weighted(block, weight=True, bias=True), inputs())
    (group,) = fused_groups(fused)
    assert len(group.outputs) == 2 and group.backward == "generated"
    want, (got, launches) = forward_backward(reference, inputs()), forward_backward_counted(fused, inputs())
    assert launches["backward_interpreter"] == 1 and launches["backward_recompute"] == 0
    for have, expected in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(have, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("interpreter")
def test_per_row_column_input_gets_its_gradient_summed_over_the_row():
    """A [rows, 1] input is a vector in the row program (stride 0 over the row); its gradient buffer
    has the iteration shape and is summed back to one number per row."""
    scale = torch.randn(4, 1, generator=torch.Generator().manual_seed(3))
    module = Chain(lambda m, x, s: torch.softmax(x * s, dim=-1))
    assert_generated_backward_matches_eager(module, (inputs()[0], scale), ["mul", "softmax"])


def backward_adjoints(group) -> list[str]:
    """The backward kernel's lines after the incoming gradients are loaded: the adjoints."""
    body = kernels(kernel_source(group))[f"{group.name}_bwd"]
    return [line.strip() for line in body.split("gout0 = tl.load(", 1)[1].splitlines()[1:]]


def test_backward_reductions_mask_the_lanes_past_the_row():
    for module, _ in ROW_GROUPS.values():
        _, fused = export_and_fuse(module, inputs())
        (group,) = fused_groups(fused)
        adjoints = "\n".join(backward_adjoints(group))
        sums = re.findall(r"tl\.sum\([^\n]*", adjoints)
        assert sums and all(s.startswith("tl.sum(tl.where(mask, ") for s in sums), adjoints
        assert "tl.store(" in adjoints and all(
            "mask=mask" in s for s in re.findall(r"tl\.store\([^\n]*", adjoints)
        )


def test_backward_source_names_each_adjoint_and_sums_per_row_scalars_over_the_row():
    module, _ = ROW_GROUPS["llama_rms_norm"]
    _, fused = export_and_fuse(module, inputs())
    (group,) = fused_groups(fused)
    adjoints = backward_adjoints(group)
    comments = [line for line in adjoints if line.startswith("# d/d ")]
    assert [re.sub(r"# d/d (\w+) = .*", r"\1", c) for c in comments] == [
        "mul_1", "to_1", "mul", "rsqrt", "add_1", "mean", "pow_1", "to", "add",
    ]  # fmt: skip
    per_row = [c for c in comments if c.endswith("(one per row)")]
    assert [re.sub(r"# d/d (\w+) = .*", r"\1", c) for c in per_row] == ["rsqrt", "add_1", "mean"]
    # rsqrt's adjoint is the row sum of the vector term mul sends it; add's and mean's are scalars.
    assert adjoints[adjoints.index(per_row[0]) + 1].startswith("g_t5 = tl.sum(tl.where(mask, (g_t6 * t1)")


def test_row_group_backward_is_priced_as_one_kernel_not_a_replay_of_its_ops():
    import hetcc
    from hetcc.hardware.presets import HOST_FIELDS, get_preset
    from hetcc.ir import info
    from hetcc.passes.cost import BACKWARD_MEMORY_PASSES, cost
    from hetcc.passes.fuse import fuse

    a100 = get_preset("A100-80GB")
    a100 = a100.replace(**dict.fromkeys(HOST_FIELDS, 0.0))
    module = Weighted(lambda m, x, y: F.layer_norm(x + y, (1024,), m.weight, m.bias), True, True, 1024)
    x, y = (torch.randn(64, 1024, requires_grad=True) for _ in range(2))
    analysis = hetcc.analyze(module, (x, y))
    fuse(analysis.graph)
    cost(analysis.graph, device_types=[a100])
    (fused,) = [n for n in analysis.graph.graph.nodes if info(n).members]
    record = info(fused)
    assert "backward=generated" in record.notes[0]
    passes = BACKWARD_MEMORY_PASSES * record.bytes / a100.achievable_bandwidth_bps
    assert dict(record.bwd_s)["A100-80GB"] == pytest.approx(passes + a100.kernel_overhead_s)


def test_saved_row_group_round_trips_and_one_saved_as_recompute_still_loads(tmp_path):
    module, _ = ROW_GROUPS["layer_norm_affine"]
    _, fused = export_and_fuse(module, inputs())
    (group,) = fused_groups(fused)
    assert check_group(group_from_json(group_to_json(group)), "saved") == group
    assert kernel_source(group).count("@triton.jit") == 2
    legacy = dataclasses.replace(group, backward="recompute")  # saved before row groups had a kernel
    assert check_group(group_from_json(group_to_json(legacy)), "saved") == legacy
    assert kernel_source(legacy).count("@triton.jit") == 1
