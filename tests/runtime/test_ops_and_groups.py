"""send/recv ops (fake kernels, autograd through a transport), backend choice per link, interop checks."""

from __future__ import annotations

import pytest
import torch
from runtime_models import GPT2_RULES, MLP_RULES, ResidualMLP, export, stages_by_module, tiny_gpt2
from torch._subclasses.fake_tensor import FakeTensorMode

from hetcc.errors import HetccError, PlanFormatError, RuntimeFailure
from hetcc.passes.codegen import module_for_device
from hetcc.passes.comm import split_stages
from hetcc.runtime.groups import link_backend, link_backends, world_backend
from hetcc.runtime.interop import pipelining_schedule
from hetcc.sendrecv import LocalTransport, new_anchor, transfer_stats, use_transport
from hetcc.train.local import run_local


def test_backward_of_send_receives_and_backward_of_recv_sends_the_gradient():
    transport = LocalTransport()
    x = torch.randn(3, requires_grad=True)
    with use_transport(transport):
        token = torch.ops.hetcc.send(x * 2, 1, 7, [3], torch.float32)
        received = torch.ops.hetcc.recv(new_anchor(), 0, 7, [3], torch.float32)
        (received**2).sum().backward()  # the consumer's backward sends d/dr = 2r back on tag 7
        token.backward()  # the producer's backward receives it
    torch.testing.assert_close(x.grad, 8 * x.detach())
    assert transport.mailbox == {(7, False): [], (7, True): []}


def test_ops_count_every_tensor_they_move_forward_and_backward():
    before = transfer_stats()
    test_backward_of_send_receives_and_backward_of_recv_sends_the_gradient()
    moved = {key: transfer_stats()[key] - before[key] for key in before}
    assert moved == {
        "sends": 2, "recvs": 2, "bytes_sent": 24, "bytes_received": 24, "grads_filled": 0, "grads_dropped": 0,
        "replayed": 0,
    }  # fmt: skip


def test_module_for_a_gpu_rank_names_its_device_and_shares_the_stage_parameters():
    ids = torch.randint(0, 64, (2, 8))
    gm = export(tiny_gpt2(), kwargs={"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    last = split_stages(gm, stages_by_module(gm, GPT2_RULES), 3)[2]
    assert module_for_device(last, "cpu") is last.module  # a CPU rank runs the stage module itself
    moved = module_for_device(last, "meta")
    assert "device(type='meta')" in moved.code and "device(type='cpu')" not in moved.code
    assert "device(type='cpu')" in last.module.code and "hetcc.recv" in moved.code
    params = dict(moved.named_parameters())
    assert params and all(params[name] is p for name, p in last.module.named_parameters())
    assert moved.hetcc_anchor.device.type == "meta" and moved.hetcc_anchor.requires_grad


def test_ops_have_fake_kernels_with_the_declared_shape():
    with FakeTensorMode():
        out = torch.ops.hetcc.recv(torch.zeros(()), 0, 1, [2, 5], torch.bfloat16)
        token = torch.ops.hetcc.send(torch.zeros(4), 1, 1, [4], torch.float32)
    assert out.shape == (2, 5) and out.dtype == torch.bfloat16 and token.shape == ()


def test_ops_outside_a_transport_fail_clearly():
    with pytest.raises(RuntimeFailure, match="outside a transport"):
        torch.ops.hetcc.send(torch.zeros(2), 1, 0, [2], torch.float32)


def test_recv_of_something_never_sent_names_the_tag():
    with use_transport(LocalTransport()), pytest.raises(RuntimeFailure, match="tag 4 from stage 2"):
        torch.ops.hetcc.recv(new_anchor(), 2, 4, [1], torch.float32)


@pytest.mark.parametrize(
    ("a", "b", "backend"),
    [
        ("nvidia", "nvidia", "nccl"),
        ("amd", "AMD", "nccl"),
        ("nvidia", "amd", "gloo"),
        ("cpu", "cpu", "gloo"),
        ("nvidia", "cpu", "gloo"),
    ],
)
def test_link_backend(a, b, backend):
    assert link_backend(a, b) == backend


def test_link_backends_cover_every_pair_and_world_backend_is_gloo_when_mixed():
    vendors = ["nvidia", "nvidia", "amd", "cpu"]
    pairs = link_backends(vendors)
    assert pairs[(0, 1)] == "nccl" and pairs[(1, 2)] == "gloo" and pairs[(2, 3)] == "gloo"
    assert len(pairs) == 6
    assert world_backend(vendors) == "gloo" and world_backend(["amd", "amd"]) == "nccl"


def test_pipelining_interop_refuses_a_split_with_a_skip_over_a_stage():
    gm = export(ResidualMLP(), (torch.randn(4, 8),))
    stages = split_stages(gm, stages_by_module(gm, MLP_RULES), 3)
    with pytest.raises(PlanFormatError, match="stage 0 is not part of a chain .*relu"):
        pipelining_schedule(stages, 0, 2)


def test_inputs_that_do_not_split_into_the_traced_microbatch_fail_before_spawning():
    gm = export(ResidualMLP(), (torch.randn(4, 8),))
    stages = split_stages(gm, stages_by_module(gm, MLP_RULES), 3)
    with pytest.raises(PlanFormatError, match=r"shape \(3, 8\) but stage 0 was traced with \(4, 8\)"):
        run_local(stages, {"x": torch.randn(6, 8)}, microbatches=2)
    with pytest.raises(HetccError, match="does not split into 4 equal microbatches"):
        run_local(stages, {"x": torch.randn(6, 8)}, microbatches=4)
