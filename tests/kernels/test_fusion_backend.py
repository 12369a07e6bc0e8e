"""Which backend runs a fusion group, and that every backend equals eager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import export_and_fuse, forward_backward, forward_backward_counted, fused_groups
from test_fusion_numerics import Chain

from hetcc.kernels import cache, launch_stats, reset_launch_stats
from hetcc.kernels import fused as fused_call
from hetcc.kernels.execute import run_eager, run_forward


def gelu_chain():
    return Chain(lambda m, x, b: F.gelu(x + b) * torch.sigmoid(x))


ARGS = (torch.randn(4, 7), torch.randn(7))


@pytest.mark.usefixtures("no_interpreter")
def test_cpu_without_interpreter_runs_original_ops_and_equals_eager_exactly():
    reference, fused = export_and_fuse(gelu_chain(), ARGS)
    assert cache.choose_backend("cpu") == (cache.FALLBACK, "CPU without TRITON_INTERPRET=1")
    assert "backend=eager-fallback (CPU without TRITON_INTERPRET=1)" in fused.code
    before = cache.cache_size()
    expected = forward_backward(reference, ARGS)
    got, launches = forward_backward_counted(fused, ARGS)
    for want, have in zip(expected[0] + expected[1], got[0] + got[1]):
        torch.testing.assert_close(have, want, atol=0, rtol=0)
    assert cache.cache_size() == before  # nothing was compiled
    # The fallback is the ops themselves under autograd: nothing re-runs them for the backward.
    assert {k: n for k, n in launches.items() if n} == {"fused_eager": 1}
    (group,) = fused_groups(fused)
    x = ARGS[0].clone().requires_grad_()
    (out,) = fused_call([x, ARGS[1]], group.name)
    assert type(out.grad_fn).__name__ == "MulBackward0"  # the group's last op, recorded as in eager


@pytest.mark.usefixtures("interpreter")
def test_interpreter_choice_shows_in_printed_code_and_matches_fallback():
    _, fused = export_and_fuse(gelu_chain(), ARGS)
    assert "backend=triton (CPU through TRITON_INTERPRET=1)" in fused.code
    (group,) = fused_groups(fused)
    inputs = [ARGS[0], ARGS[1]]
    reset_launch_stats()
    torch.testing.assert_close(run_forward(group, inputs), run_eager(group, inputs), atol=1e-6, rtol=1e-5)
    assert launch_stats()["fused_interpreter"] == 1 and launch_stats()["fused_eager"] == 0


def test_without_triton_every_device_falls_back(monkeypatch):
    monkeypatch.setattr(cache, "triton_installed", lambda: False)
    for device in ("cpu", "cuda"):
        assert cache.choose_backend(device) == (cache.FALLBACK, "Triton is not installed")


def test_cuda_tensors_choose_triton_where_installed():
    pytest.importorskip("triton")
    assert cache.choose_backend("cuda")[0] == cache.TRITON


@pytest.mark.usefixtures("no_interpreter")
def test_fused_module_exports_again_with_one_custom_op_node():
    _, fused = export_and_fuse(gelu_chain(), ARGS)
    again = torch.export.export(fused, ARGS, strict=False).module()
    targets = [n.target for n in again.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.hetcc.fusion_group.default) == 1
    assert torch.ops.aten.gelu.default not in targets
    torch.testing.assert_close(again(*ARGS), fused(*ARGS))


ABSENT_TRITON = """
import sys
sys.modules["triton"] = None  # what a platform without Triton (macOS) looks like to importlib
import torch
from hetcc.passes.fuse import fuse
class M(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x * 2.0) + 1.0
x = torch.randn(3, 4)
gm = fuse(torch.export.export(M(), (x,), strict=False).module())
assert "backend=eager-fallback (Triton is not installed)" in gm.code, gm.code
torch.testing.assert_close(gm(x), M()(x), atol=0, rtol=0)
print("ok")
"""


LATE_INTERPRETER = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton.language  # imported for GPUs: its library cannot run in the interpreter any more
import torch
from hetcc.passes.fuse import fuse
os.environ["TRITON_INTERPRET"] = "1"
class M(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(torch.sigmoid(x) * 2.0, -1)
x = torch.randn(3, 4)
gm = fuse(torch.export.export(M(), (x,), strict=False).module())
assert "backend=eager-fallback (CPU: TRITON_INTERPRET=1 was set after Triton was imported)" in gm.code, gm.code
torch.testing.assert_close(gm(x), M()(x), atol=0, rtol=0)
print("ok")
"""


def test_interpreter_requested_after_triton_import_falls_back_and_says_why():
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", LATE_INTERPRETER], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_without_triton_installed_fuse_still_works_and_falls_back():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", ABSENT_TRITON], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
