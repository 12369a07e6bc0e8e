"""Groups traced in fp32 and run on other dtypes (under torch.autocast, as mixed precision runs stages)
write what eager writes: the same values (to bf16 rounding) in the same dtypes, forward and backward,
from a kernel generated for the runtime dtypes.

Kernels run on CPU through Triton's interpreter (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import assert_generated_kernels_ran, export_and_fuse, fused_groups

from hetcc.kernels import launch_stats, reset_launch_stats
from hetcc.kernels.cache import compiled
from hetcc.kernels.execute import run_eager, specialize
from hetcc.kernels.source import kernel_source


def assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to a few bf16 roundings of the largest value: eager rounds after every op and the kernel
    once, in fp32 inside (and Triton's interpreter truncates to bf16); gradients then pass bf16 matmuls."""
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=float(want.abs().max()) * 2**-6, rtol=1.6e-2)


class MLPBlock(torch.nn.Module):
    """GPT-2's MLP and residual: a gelu_new chain on a matmul's output (bf16 under autocast), then the
    fp32 residual plus a bf16 matmul output into a layer norm (fp32: promotion)."""

    def __init__(self, width: int = 33):
        super().__init__()
        self.fc, self.proj, self.ln = (
            torch.nn.Linear(width, 2 * width),
            torch.nn.Linear(2 * width, width),
            torch.nn.LayerNorm(width),
        )

    def forward(self, x):
        h = self.fc(x)
        a = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return a, self.ln(x + self.proj(a))


def step_under_autocast(gm: torch.fx.GraphModule, x: torch.Tensor):
    """Forward under CPU bf16 autocast, backward outside it (as the pipeline runtime does): outputs and
    gradients of the input and parameters."""
    gm.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = gm(leaf)
    generator = torch.Generator().manual_seed(0)
    loss = sum((o.float() * torch.randn(o.shape, generator=generator)).sum() for o in outputs)
    loss.backward()
    return [o.detach() for o in outputs], [leaf.grad, *(p.grad for p in gm.parameters())]


@pytest.mark.usefixtures("interpreter")
def test_fused_block_under_autocast_matches_eager_in_values_and_dtypes():
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(3))
    reference, fused = export_and_fuse(MLPBlock(), (x,))
    groups = fused_groups(fused)
    assert [g.kind for g in groups] == ["pointwise", "row"], fused.code
    assert [g.backward for g in groups] == ["generated", "generated"], fused.code
    assert all(set(g.output_dtypes) == {torch.float32} for g in groups)  # as traced
    want_out, want_grads = step_under_autocast(reference, x)
    reset_launch_stats()
    got_out, got_grads = step_under_autocast(fused, x)
    assert_generated_kernels_ran(groups, launch_stats())
    assert [o.dtype for o in got_out] == [o.dtype for o in want_out] == [torch.bfloat16, torch.float32]
    for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
        assert_close_bf16(got, want)


def gelu_group():
    x = torch.randn(4, 40)
    _, fused = export_and_fuse(MLPBlock(40), (x,))
    (group,) = [g for g in fused_groups(fused) if g.kind == "pointwise"]
    return group, [torch.randn(4, 80)]


@pytest.mark.usefixtures("interpreter")
def test_retyped_group_has_its_own_kernel_writing_the_input_dtype():
    group, (h,) = gelu_group()
    typed = specialize(group, [h.bfloat16()])
    assert typed.name != group.name and typed.output_dtypes == (torch.bfloat16,)
    assert specialize(group, [h]) is group  # the traced dtypes: the traced kernel
    assert ".to(tl.bfloat16), mask=mask)" in kernel_source(typed)
    assert compiled(typed).path != compiled(group).path


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_fallback_and_fake_agree_with_eager_on_other_input_dtypes(dtype):
    group, (h,) = gelu_group()
    results = {}
    for name, run in {
        "kernel": lambda x: torch.ops.hetcc.fusion_group([x], group.name)[0],
        "fallback": lambda x: run_eager(group, [x])[0],
    }.items():
        leaf = h.to(dtype).requires_grad_()
        out = run(leaf)
        out.backward(torch.ones_like(out))
        results[name] = (out.detach(), leaf.grad)
    for got, want in zip(results["kernel"], results["fallback"], strict=True):
        assert got.dtype == dtype
        assert_close_bf16(got, want)
    typed_input = h.to(dtype)
    with torch._subclasses.FakeTensorMode() as mode:
        (fake,) = torch.ops.hetcc.fusion_group([mode.from_tensor(typed_input)], group.name)
    assert fake.dtype == dtype
