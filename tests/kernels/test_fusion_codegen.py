"""Generated Triton source: structure (not pinned text), dumps, and the compile-once cache."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import export_and_fuse, fused_groups
from test_fusion_numerics import Chain

from hetcc.errors import RuntimeFailure
from hetcc.kernels import cache, op
from hetcc.kernels.execute import run_forward
from hetcc.kernels.group import group_from_json
from hetcc.kernels.op import load_groups
from hetcc.kernels.source import kernel_source, write_kernel


def group_of(fn, *args, modules=()):
    _, fused = export_and_fuse(Chain(fn, *modules), args)
    (group,) = fused_groups(fused)
    return group


def kernels(source: str) -> dict[str, str]:
    """Kernel name -> body, split at each ``@triton.jit``."""
    chunks = source.split("@triton.jit\n")[1:]
    return {re.match(r"def (\w+)\(", chunk).group(1): chunk for chunk in chunks}


def statements(body: str, call: str) -> list[str]:
    return [line.strip() for line in body.splitlines() if line.strip().startswith(call)]


def gelu_bias(x, b):
    return group_of(lambda m, x, b: F.gelu(x + b, approximate="tanh") * 2.0, x, b)


def test_pointwise_group_has_forward_and_generated_backward_kernel():
    group = gelu_bias(torch.randn(4, 6), torch.randn(6))
    source = kernel_source(group)
    assert source.count("@triton.jit") == 2
    forward, backward = kernels(source)[f"{group.name}_fwd"], kernels(source)[f"{group.name}_bwd"]
    # Forward: each input read once, the one output written once, all masked.
    assert len(statements(forward, "in0 = tl.load")) == 1 and len(re.findall(r"tl\.load\(", forward)) == 2
    assert len(re.findall(r"tl\.store\(", forward)) == 1
    assert all(
        "mask=mask" in s for s in statements(forward, "tl.store") + re.findall(r"tl\.load\([^\n]*", forward)
    )
    # Backward: inputs + one incoming gradient read, one gradient per input written.
    assert len(re.findall(r"tl\.load\(", backward)) == 3
    assert len(re.findall(r"tl\.store\(", backward)) == 2


def test_broadcast_input_is_addressed_by_strides_and_flat_input_by_offset():
    group = gelu_bias(torch.randn(4, 6), torch.randn(6))
    forward = kernels(kernel_source(group))[f"{group.name}_fwd"]
    assert "tl.load(in0_ptr + offs, mask=mask" in forward
    assert "tl.load(in1_ptr + idx0 * in1_s0 + idx1 * in1_s1, mask=mask" in forward
    assert re.search(
        r"def \w+\(in0_ptr, in1_ptr, out0_ptr, numel, size0, size1, in1_s0, in1_s1, BLOCK: tl.constexpr\)",
        forward,
    )


def test_fp16_math_runs_in_fp32_and_is_cast_back_on_store():
    group = gelu_bias(torch.randn(4, 6).half(), torch.randn(6).half())
    forward = kernels(kernel_source(group))[f"{group.name}_fwd"]
    assert all(".to(tl.float32)" in load for load in re.findall(r"in\d = tl\.load\([^\n]*", forward))
    assert statements(forward, "tl.store") == ["tl.store(out0_ptr + offs, t2.to(tl.float16), mask=mask)"]


def test_header_lists_replaced_ops_in_order():
    group = gelu_bias(torch.randn(4, 6), torch.randn(6))
    header = [line for line in kernel_source(group).splitlines() if line.startswith("#   ")]
    assert [re.sub(r"^#   \w+ = ", "", line).split("(")[0] for line in header] == [
        "aten.add.Tensor",
        "aten.gelu.default",
        "aten.mul.Tensor",
    ]
    assert (
        kernel_source(group)
        .splitlines()[0]
        .startswith(f"# {group.name}: pointwise, 3 ops (add -> gelu_tanh -> mul)")
    )


def test_row_group_has_row_blocks_reductions_and_a_backward_kernel():
    ln = torch.nn.LayerNorm(10)
    group = group_of(lambda m, x, r: m.mods[0](x + r), torch.randn(3, 10), torch.randn(3, 10), modules=(ln,))
    source = kernel_source(group)
    assert source.count("@triton.jit") == 2 and group.backward == "generated"
    body = kernels(source)[f"{group.name}_fwd"]
    assert "row = tl.program_id(0)" in body and "mask = cols < n_cols" in body
    assert body.count("tl.sum(") == 2
    assert len(re.findall(r"tl\.load\(", body)) == 4 and len(re.findall(r"tl\.store\(", body)) == 1


def test_source_is_valid_python_and_written_to_kernels_folder(tmp_path):
    group = gelu_bias(torch.randn(4, 6), torch.randn(6))
    path = write_kernel(group, tmp_path)
    assert path == tmp_path / "kernels" / f"{group.name}.py"
    assert path.read_text() == kernel_source(group)
    compile(path.read_text(), str(path), "exec")


def test_equal_structure_shares_a_name_and_dtype_changes_it():
    first = gelu_bias(torch.randn(4, 6), torch.randn(6))
    other_shape = gelu_bias(torch.randn(2, 3), torch.randn(3))
    half = gelu_bias(torch.randn(4, 6).half(), torch.randn(6).half())
    assert first.name == other_shape.name != half.name
    assert cache.cache_key(first) != cache.cache_key(half)


@pytest.mark.usefixtures("interpreter")
def test_kernel_compiles_once_per_key():
    group = group_of(lambda m, x: torch.sigmoid(x * 3.0) - 0.25, torch.randn(2, 5))
    before = cache.cache_size()
    for rows in (2, 7):  # a different shape reuses the same compiled kernel
        (out,) = run_forward(group, [torch.randn(rows, 5)])
        assert out.shape == (rows, 5)
    assert cache.cache_size() == before + 1
    assert cache.compiled(group).path.read_text() == kernel_source(group)


def test_saved_group_round_trips_and_registers_from_the_kernels_folder(tmp_path, monkeypatch):
    group = gelu_bias(torch.randn(4, 6).half(), torch.randn(6).half())
    write_kernel(group, tmp_path)
    assert group_from_json((tmp_path / "kernels" / f"{group.name}.json").read_text()) == group
    monkeypatch.setattr(op, "_GROUPS", {})  # a fresh process knows no groups
    with pytest.raises(RuntimeFailure, match=group.name):
        op.registered_group(group.name)
    assert load_groups(tmp_path) == [group]
    assert op.registered_group(group.name) == group


def test_interpreted_and_native_kernels_never_share_a_cache_entry(monkeypatch):
    group = gelu_bias(torch.randn(4, 6), torch.randn(6))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = cache.cache_key(group)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert cache.cache_key(group) != interpreted
