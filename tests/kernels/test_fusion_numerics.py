"""Every fusible op, fused into a small chain, matches eager forward and backward (fp32 and fp16).

Kernels run on CPU through Triton's interpreter (see conftest.py); tensors are tiny and rows are not a
power of two, so masks matter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import (
    assert_generated_kernels_ran,
    export_and_fuse,
    forward_backward,
    forward_backward_counted,
    fused_groups,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}


class Chain(torch.nn.Module):
    def __init__(self, fn, *modules: torch.nn.Module):
        super().__init__()
        self.fn, self.mods = fn, torch.nn.ModuleList(modules)

    def forward(self, *args):
        return self.fn(self, *args)


def assert_matches_eager(module: torch.nn.Module, args: tuple, dtype: torch.dtype, groups: int = 1):
    reference, fused = export_and_fuse(module, args)
    assert len(fused_groups(fused)) == groups, fused.code
    expected = forward_backward(reference, args)
    fused_out, launches = forward_backward_counted(fused, args)
    assert_generated_kernels_ran(fused_groups(fused), launches)
    tol = TOLERANCE[dtype]
    for want, got in zip(expected[0] + expected[1], fused_out[0] + fused_out[1]):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return fused


def _other_float(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype == torch.float32 else torch.float32


# name -> (chain using the op, needs positive inputs). Each chain has >= 2 fusible ops.
POINTWISE = {
    "add": (lambda m, x, y: (x * 2.0) + y, False),
    "sub": (lambda m, x, y: (x * 2.0) - y, False),
    "rsub": (lambda m, x, y: 1.0 - x * y, False),
    "mul": (lambda m, x, y: (x + 1.0) * y, False),
    "div": (lambda m, x, y: (x + 1.0) / y, True),
    "neg": (lambda m, x, y: -(x * y), False),
    "abs": (lambda m, x, y: torch.abs(x - y), False),
    "exp": (lambda m, x, y: torch.exp(x * y), False),
    "log": (lambda m, x, y: torch.log(x * y), True),
    "sqrt": (lambda m, x, y: torch.sqrt(x * y), True),
    "rsqrt": (lambda m, x, y: torch.rsqrt(x * y), True),
    "tanh": (lambda m, x, y: torch.tanh(x * y), False),
    "sigmoid": (lambda m, x, y: torch.sigmoid(x * y), False),
    "relu": (lambda m, x, y: torch.relu(x * y), False),
    "gelu_erf": (lambda m, x, y: F.gelu(x * y), False),
    "gelu_tanh": (lambda m, x, y: F.gelu(x * y, approximate="tanh"), False),
    "silu": (lambda m, x, y: F.silu(x * y), False),
    "pow2": (lambda m, x, y: torch.pow(x * y, 2), False),
    "pow3": (lambda m, x, y: torch.pow(x + y, 3.0), False),
    "pow_half": (lambda m, x, y: torch.pow(x * y, 0.5), True),
    "pow_1_5": (lambda m, x, y: torch.pow(x * y, 1.5), True),
    "pow_minus1": (lambda m, x, y: torch.pow(x * y, -1), True),
    "where": (lambda m, x, y: torch.where(x > y, x * 2.0, y), False),
    "lt_where": (lambda m, x, y: torch.where(x * 2.0 < y, 0.0, x), False),
    "dropout_eval": (lambda m, x, y: F.dropout(x * y, 0.3, training=False) + 1.0, False),
    "dropout_p0": (lambda m, x, y: F.dropout(x * y, 0.0, training=True) + 1.0, False),
    # Through fp16 (fp32 inputs) or fp32 (fp16 inputs): the interpreter truncates fp32 -> bf16.
    "cast": (lambda m, x, y: (x * y).to(_other_float(x.dtype)).to(x.dtype) * 3.0, False),
}


def inputs(dtype: torch.dtype, positive: bool, shape=(5, 33)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(shape, generator=generator), torch.randn(shape[-1:], generator=generator)
    if positive:
        x, y = x.abs() + 0.5, y.abs() + 0.5
    return x.to(dtype), y.to(dtype)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_pointwise_op_matches_eager(name, dtype):
    fn, positive = POINTWISE[name]
    fused = assert_matches_eager(Chain(fn), inputs(dtype, positive), dtype)
    assert fused_groups(fused)[0].backward == "generated"


ROW = {
    "softmax": (lambda m, x, y: torch.softmax(x * y + 1.0, dim=-1), ()),
    "layer_norm": (lambda m, x, y: m.mods[0](x + y), (torch.nn.LayerNorm(33),)),
    "layer_norm_plain": (lambda m, x, y: F.layer_norm(x * y, (33,)), ()),
    "rms_norm": (lambda m, x, y: m.mods[0](x - y), (torch.nn.RMSNorm(33, eps=1e-6),)),
    "rms_norm_default_eps": (lambda m, x, y: m.mods[0](x - y), (torch.nn.RMSNorm(33),)),
    # Written out as HF Llama does: the mean is mid-chain and its per-row result broadcasts onward.
    "mean_of_squares": (lambda m, x, y: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * y, ()),
}


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(ROW))
def test_row_reduction_ends_chain_and_matches_eager(name, dtype):
    fn, modules = ROW[name]
    for module in modules:
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape))
    module = Chain(fn, *modules).to(dtype)
    fused = assert_matches_eager(module, inputs(dtype, False), dtype)
    assert fused_groups(fused)[0].kind == "row"
    assert fused_groups(fused)[0].backward == "generated"


@pytest.mark.usefixtures("interpreter")
def test_value_used_outside_the_chain_is_stored_as_second_output():
    def fn(m, x, y):
        h = x * y + 1.0
        return torch.tanh(h), h.sum(dim=0)

    fused = assert_matches_eager(Chain(fn), inputs(torch.float32, False), torch.float32)
    (group,) = fused_groups(fused)
    assert len(group.outputs) == 2


@pytest.mark.usefixtures("interpreter")
def test_broadcast_of_column_and_zero_dim_operands_matches_eager():
    def fn(m, x, col, scalar):
        return F.silu(x * col + scalar) - col

    generator = torch.Generator().manual_seed(3)
    args = (torch.randn(4, 6, generator=generator), torch.randn(4, 1, generator=generator), torch.tensor(0.5))
    fused = assert_matches_eager(Chain(fn), args, torch.float32)
    (group,) = fused_groups(fused)
    assert [spec.broadcast for spec in group.inputs] == [False, True, True]


@pytest.mark.usefixtures("interpreter")
def test_non_contiguous_input_is_read_through_strides():
    def fn(m, x, y):
        return torch.exp(x.transpose(0, 1) * 0.5) + y

    generator = torch.Generator().manual_seed(5)
    args = (torch.randn(6, 4, generator=generator), torch.randn(4, 6, generator=generator))
    fused = assert_matches_eager(Chain(fn), args, torch.float32)
    (group,) = fused_groups(fused)
    assert group.inputs[0].flat is False and group.inputs[0].broadcast is False
