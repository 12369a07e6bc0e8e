"""Messages between two ranks pair up in posting order (nccl ignores tags; ``Links`` makes gloo do the
same), so both ends of a stage pair must post its messages in one order derived from the plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from runtime_models import CROSSED_RULES, CrossedMLP, eager_reference, export, stages_by_module

from hetcc import config, verify
from hetcc.errors import AnalysisError, RuntimeFailure
from hetcc.passes.comm import split_stages
from hetcc.runtime.transport import LinkTransport
from hetcc.sendrecv import LocalTransport, use_transport
from hetcc.train.local import run_local

SEND, RECV = torch.ops.hetcc.send.default, torch.ops.hetcc.recv.default


def _crossed_stages(microbatch: torch.Tensor, model: CrossedMLP | None = None):
    gm = export(model or CrossedMLP(), (microbatch,))
    return split_stages(gm, stages_by_module(gm, CROSSED_RULES), 2)


class _Wire:
    """In-process stand-in for ``Links`` between ranks: each message goes to the next receive its receiver
    posts from its sender, whatever it holds, as over nccl (a receive of another size fails, as gloo's)."""

    def __init__(self):
        self.queues: dict[tuple[int, int], list[torch.Tensor]] = {}

    def rank(self, rank: int):
        wire = self

        class Endpoint:
            def isend(self, tensor, peer, what, stages=None):
                wire.queues.setdefault((rank, peer), []).append(tensor.detach().clone())

            def recv(self, peer, shape, dtype, what, stages=None):
                sent = wire.queues[(peer, rank)].pop(0)
                buffer = torch.empty(shape, dtype=dtype)
                raw = buffer.reshape(-1).view(torch.uint8)
                raw.copy_(sent.reshape(-1).view(torch.uint8))  # fails unless the byte counts agree
                return buffer

        return Endpoint()


def test_sends_to_a_stage_are_posted_in_the_tag_order_of_its_recvs():
    stages = _crossed_stages(torch.randn(4, 8))
    posted = [
        [(n.args[1], n.args[2]) for n in s.module.graph.nodes if n.target in (SEND, RECV)] for s in stages
    ]
    assert posted == [[(1, 0), (1, 1), (1, 2)], [(0, 0), (0, 1), (0, 2)]]  # (peer, tag)
    assert [e.value for e in stages[1].recvs] == ["tanh_2", "tanh_1", "tanh"]  # used c, b, a; made a, b, c
    verify.check_pipeline(stages)


def test_a_stage_that_posts_its_sends_out_of_tag_order_is_caught():
    stages = _crossed_stages(torch.randn(4, 8))
    sends = [n for n in stages[0].module.graph.nodes if n.target is SEND]
    sends[-1].append(sends[0])  # tag 0 after tag 2
    with pytest.raises(AnalysisError, match="stage 0 posts its send of tag 0 after tag 2 .to stage 1."):
        verify.check_pipeline(stages)


def test_the_wire_order_holds_when_the_consumer_uses_its_inputs_in_reverse():
    """Both stages in one process over a wire that pairs messages by order alone: the forward, the
    gradients coming back, and the result equal eager."""
    torch.manual_seed(0)
    model, x = CrossedMLP(), torch.randn(4, 8)
    stages, wire = _crossed_stages(x, model), _Wire()
    first, last = (LinkTransport(wire.rank(k), stage) for k, stage in enumerate(stages))
    with use_transport(first):
        tokens = stages[0].module(x)
    with use_transport(last):
        (out,) = stages[1].module()
        out.sum().backward()
        last.settle_gradients()
    with use_transport(first):
        torch.autograd.backward(tokens, [torch.ones(()) for _ in tokens])
        first.settle_gradients()
    assert not any(wire.queues.values())
    expected = model(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    got = {stages[0].param_names[k]: p.grad for k, p in stages[0].module.named_parameters()}
    got |= {stages[1].param_names[k]: p.grad for k, p in stages[1].module.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, msg=name)


@pytest.mark.parametrize(
    ("shape", "dtype", "received"),
    [([4, 5], torch.float32, r"float32\[4, 4\]"), ([2, 8], torch.float32, r"float32\[4, 4\]"),
     ([4, 4], torch.int32, r"float32\[4, 4\]")],
    ids=["shape", "same-size-shape", "dtype"],
)  # fmt: skip
def test_a_receive_that_records_another_shape_or_dtype_than_is_sent_fails_naming_both(shape, dtype, received):
    stages, wire = _crossed_stages(torch.randn(4, 8)), _Wire()
    sender, receiver = (LinkTransport(wire.rank(k), stage) for k, stage in enumerate(stages))
    sender.send(torch.randn(4, 4), 1, 0, grad=False)  # tag 0: tanh_2, float32[4, 4]
    recorded = rf"{str(dtype).removeprefix('torch.')}\[{', '.join(map(str, shape))}\]"
    message = (
        rf"stage 1 received {received} from stage 0 where its recv of tanh_2 \(tag 0\) records {recorded}"
    )
    with pytest.raises(RuntimeFailure, match=message) as failure:
        receiver.recv(0, 0, shape, dtype, grad=False)
    assert "compile and save the pipeline again" in str(failure.value)


def test_a_sender_whose_tensor_is_not_what_the_plan_records_fails_before_sending():
    stages, wire = _crossed_stages(torch.randn(4, 8)), _Wire()
    sender = LinkTransport(wire.rank(0), stages[0])
    with pytest.raises(RuntimeFailure, match=r"stage 0 computed tanh_2 \(tag 0\) for stage 1 as float32\[3, 4\], "
                       r"but the plan records float32\[4, 4\]"):  # fmt: skip
        sender.send(torch.randn(3, 4), 1, 0, grad=False)
    with pytest.raises(RuntimeFailure, match=r"as bfloat16\[4, 4\], but the plan records float32\[4, 4\]"):
        sender.send(torch.randn(4, 4, dtype=torch.bfloat16), 1, 0, grad=False)
    assert not any(wire.queues.values())


def test_under_mixed_precision_a_tensor_crosses_in_the_dtype_autocast_made():
    stages, wire = _crossed_stages(torch.randn(4, 8)), _Wire()
    sender, receiver = (LinkTransport(wire.rank(k), s, mixed_precision=True) for k, s in enumerate(stages))
    sent = torch.randn(4, 4, dtype=torch.bfloat16)
    sender.send(sent, 1, 0, grad=False)
    assert torch.equal(receiver.recv(0, 0, [4, 4], torch.float32, grad=False), sent)


def test_the_in_process_transport_checks_what_arrives_too():
    transport = LocalTransport()
    transport.send(torch.zeros(3), 1, 5, grad=False)
    with pytest.raises(
        RuntimeFailure, match=r"tag 5 from stage 1: received float32\[3\], but the recv records int64\[3\]"
    ):
        transport.recv(1, 5, [3], torch.int64, grad=False)


@pytest.mark.slow
def test_a_stage_that_uses_its_inputs_in_another_order_than_they_are_sent_matches_eager():
    torch.manual_seed(0)
    model, x, y = CrossedMLP(), torch.randn(8, 8), torch.randn(8, 8)
    gm = export(model, (x[:4],))
    stages = split_stages(gm, stages_by_module(gm, CROSSED_RULES), 2)
    with config.patch(comm_timeout_s=30.0):  # a message paired with the wrong one fails in 30 s, not 120
        result = run_local(
            stages, {"x": x}, y, F.mse_loss, steps=2, schedule="1f1b", microbatches=2,
            optimizer={"name": "sgd", "lr": 0.1},
        )  # fmt: skip
    losses, grads, _ = eager_reference(model, {"x": x}, y, F.mse_loss, 2, 2, {"name": "sgd", "lr": 0.1})
    for got, want in zip(result.losses, losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (result.losses, losses)
    for name, grad in grads[-1].items():
        torch.testing.assert_close(result.grads[name], grad, rtol=0, atol=1e-4, msg=name)
