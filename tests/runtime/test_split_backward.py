"""A stage's backward split in B (input gradients) and W (weight gradients), as zero-bubble schedules run
it: together they give eager's gradients, and each computes only its half of the matmuls."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from hetcc.kernels import fused, register_group
from hetcc.kernels import group as g
from hetcc.runtime.split_backward import input_gradients, weight_gradients


class Stage(torch.nn.Module):
    """Received ``x`` (tied to the anchor as hetcc.recv ties it), two linears, a layer norm, a weight
    used twice, and a second root fed by a weight alone (a tensor sent on that no input reaches)."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.zeros((), requires_grad=True)
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
        self.bias = torch.nn.Parameter(torch.randn(8))
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        x = x + self.anchor
        h = torch.tanh(x @ self.w1.t() + self.bias)
        h = self.norm(h) @ self.w2.t() @ self.w1  # w1 a second time
        return [h.sum(), (self.w2 * 2).sum()]


def _eager_grads(stage, x):
    roots = stage(x)
    torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    return grads


def test_b_then_w_give_eagers_gradients_and_b_leaves_the_weights_alone():
    torch.manual_seed(0)
    stage, x = Stage(), torch.randn(4, 8)
    want = _eager_grads(stage, x)
    deferred = input_gradients(stage(x), stage.anchor, list(stage.parameters()))
    assert deferred is not None and all(p.grad is None for p in stage.parameters())
    assert deferred.lone  # the weight-only root's gradient waits for W too
    weight_gradients(deferred)
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, want[name], msg=name)


def test_b_runs_the_input_gradient_matmuls_and_w_the_weight_ones():
    torch.manual_seed(0)
    anchor = torch.zeros((), requires_grad=True)
    w1, w2 = (torch.nn.Parameter(torch.randn(256, 256)) for _ in range(2))
    x = torch.randn(64, 256)
    roots = lambda: [(((x + anchor) @ w1) @ w2).sum()]  # noqa: E731
    with FlopCounterMode(display=False) as whole:
        torch.autograd.backward(roots())
    forward_flops = 2 * (2 * 64 * 256 * 256)  # two matmuls
    held = roots()
    with FlopCounterMode(display=False) as b:
        deferred = input_gradients(held, anchor, [w1, w2])
    with FlopCounterMode(display=False) as w:
        weight_gradients(deferred)
    # each: one 64 x 256 x 256 matmul per weight (dX in B, dW in W); nothing runs twice
    assert b.get_total_flops() == w.get_total_flops() == forward_flops
    assert b.get_total_flops() + w.get_total_flops() == whole.get_total_flops() - forward_flops


def test_a_stage_whose_roots_do_not_reach_its_inputs_runs_its_backward_whole_in_b():
    anchor = torch.zeros((), requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3))
    assert input_gradients([(weight * 2).sum()], anchor, [weight]) is None
    torch.testing.assert_close(weight.grad, torch.full((3,), 2.0))


def test_a_fused_group_reading_a_parameter_splits_too():
    """A fused bias add (its group's kernel computes every input's gradient at once) between matmuls:
    W runs the group's backward again for the bias; the sums are eager's."""
    spec = lambda name, shape, param: g.TensorSpec(name, shape, torch.float32, flat=not param,  # noqa: E731
                                                   broadcast=param, param=param)  # fmt: skip
    inputs = (spec("h", (4, 8), False), spec("bias", (8,), True))
    instrs = (g.Instr("add", (("in", 0), ("in", 1)), torch.float32, "add = h + bias"),
              g.Instr("tanh", (("tmp", 0),), torch.float32, "tanh = tanh(add)"))  # fmt: skip
    key = g.structural_key("pointwise", inputs, instrs, (1,), "generated")
    group = g.FusionGroup(g.group_name(instrs, key), "pointwise", (4, 8), inputs, instrs, (1,), ("tanh",),
                          "generated", "cpu")  # fmt: skip
    register_group(group)
    torch.manual_seed(0)
    anchor = torch.zeros((), requires_grad=True)
    w, bias, x = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8)), torch.randn(4, 8)
    roots = lambda: [(fused([(x + anchor) @ w, bias], group.name)[0] @ w).sum()]  # noqa: E731
    torch.autograd.backward(roots())
    want = {"w": w.grad.clone(), "bias": bias.grad.clone()}
    w.grad = bias.grad = None
    weight_gradients(input_gradients(roots(), anchor, [w, bias]))
    torch.testing.assert_close(w.grad, want["w"])
    torch.testing.assert_close(bias.grad, want["bias"])


def test_a_weight_only_value_sent_on_and_used_here_counts_each_gradient_once():
    """T5's position bias: made from a weight alone, added to this stage's attention scores and sent on
    to the next stage too. Its gradient has two parts, one through the scores (on the path to the
    inputs: W replays it from there) and one from the send; W adds each once."""
    torch.manual_seed(0)
    anchor = torch.zeros((), requires_grad=True)
    table, w = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)

    def roots():
        bias = table * 2  # no input reaches it
        return [(torch.tanh((x + anchor) @ w + bias)).sum(), bias.clone()]  # a send's token

    torch.autograd.backward(held := roots(), [torch.ones_like(r) for r in held])
    want = {"table": table.grad.clone(), "w": w.grad.clone()}
    table.grad = w.grad = None
    deferred = input_gradients(roots(), anchor, [table, w])
    assert deferred is not None and table.grad is None
    weight_gradients(deferred)
    torch.testing.assert_close(table.grad, want["table"])
    torch.testing.assert_close(w.grad, want["w"])
