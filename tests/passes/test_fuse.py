"""fuse: which nodes form groups, where groups must stop, the fused node's records, and numerics of
fused real models (forward and backward) against eager, run through Triton's CPU interpreter."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import export_and_fuse, forward_backward, fused_groups
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

from hetcc import ir
from hetcc.kernels import fused as fused_call
from hetcc.kernels.group import FusionGroup
from hetcc.passes.fuse import fuse, fusion_candidates, install_code_comments

FUSED = fused_call  # every fused node calls the group's launcher


class Fn(torch.nn.Module):
    def __init__(self, fn, **modules: torch.nn.Module):
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *args):
        return self.fn(self, *args)


def exported(module: torch.nn.Module, *args) -> torch.fx.GraphModule:
    return torch.export.export(module, args, strict=False).module()


def replaced(group: FusionGroup) -> list[str]:
    return [instr.replaced.split(" = ")[0] for instr in group.instrs]


def assert_same_training_step(reference, fused, args, atol=1e-5):
    (want_out, want_grads), (got_out, got_grads) = (
        forward_backward(reference, args),
        forward_backward(fused, args),
    )
    for want, got in zip(want_out + want_grads, got_out + got_grads, strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@pytest.mark.usefixtures("interpreter")
def test_gpt2_mlp_gelu_new_chain_is_one_kernel_and_trains_like_eager():
    config = GPT2Config(n_embd=16, n_inner=48, activation_function="gelu_new")
    torch.manual_seed(0)
    args = (torch.randn(2, 5, 16),)
    reference, fused = export_and_fuse(GPT2MLP(48, config).eval(), args)
    (group,) = fused_groups(fused)
    assert replaced(group) == ["mul", "pow_1", "mul_1", "add", "mul_2", "tanh", "add_1", "mul_3"]
    assert group.backward == "generated" and len(group.inputs) == 1
    assert_same_training_step(reference, fused, args)


@pytest.mark.usefixtures("interpreter")
def test_residual_add_and_layer_norm_fuse_with_the_sum_as_second_output():
    def block(m, x):
        h = x + m.proj(x)
        return h + m.fc(m.ln(h)) * 0.5

    torch.manual_seed(0)
    module = Fn(block, proj=torch.nn.Linear(12, 12), ln=torch.nn.LayerNorm(12), fc=torch.nn.Linear(12, 12))
    args = (torch.randn(3, 4, 12),)
    reference, fused = export_and_fuse(module, args)
    row, tail = fused_groups(fused)
    assert (row.kind, replaced(row), row.output_names) == (
        "row",
        ["add", "layer_norm"],
        ("add", "layer_norm"),
    )
    assert (tail.kind, replaced(tail)) == ("pointwise", ["mul", "add_1"])
    assert_same_training_step(reference, fused, args)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_whole_tiny_model_trains_like_eager_after_fusion(architecture):
    import models

    model = {
        "gpt2": lambda: models.gpt2(n_layer=1, n_embd=32, n_head=2, vocab=64),
        "llama": lambda: models.llama(1, 32, 4, 2, 64),
    }
    reference = model[architecture]().eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    reference = torch.export.export(
        reference, (), {"input_ids": ids, "use_cache": False}, strict=False
    ).module()
    fused = fuse(copy.deepcopy(reference))
    kinds = {g.kind for g in fused_groups(fused)}
    assert kinds == {"pointwise", "row"}  # GPT-2: residual + layer_norm; Llama: written-out RMSNorm
    logits = [gm(input_ids=ids, use_cache=False).logits for gm in (reference, fused)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    for gm in (reference, fused):
        gm.zero_grad(set_to_none=True)
        gm(input_ids=ids, use_cache=False).logits.square().mean().backward()
    for p_ref, p_fused in zip(reference.parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(p_fused.grad, p_ref.grad, atol=1e-5, rtol=1e-4)


def chain(m, x):
    return torch.exp(torch.tanh(x * 2.0) + 1.0) - x


class Chain(torch.nn.Module):
    def forward(self, x):
        return chain(self, x)


@pytest.mark.parametrize("field", ["stage", "block"])
def test_group_never_spans_two_stages_or_blocks(field):
    x = torch.randn(4, 6)
    gm = exported(Chain(), x)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]  # mul, tanh, add, exp, sub
    for k, node in enumerate(ops):
        ir.annotate(node, **{field: 0 if k < 2 else 1})
    fused = fuse(gm)
    first, second = fused_groups(fused)
    assert (replaced(first), replaced(second)) == (["mul", "tanh"], ["add", "exp", "sub"])
    records = [n.meta[ir.META_KEY] for n in fused.graph.nodes if n.target is FUSED]
    assert [getattr(r, field) for r in records] == [0, 1]
    torch.testing.assert_close(fused(x), chain(None, x))


def test_a_chain_nothing_reads_is_no_candidate():
    """A cast left unused where a stage's split moved its reader away (Llama's rotary tables on the
    embedding's stage): no kernel to make, and the graph is left as it is."""
    x = torch.randn(4, 6)
    gm = exported(Chain(), x)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    out.args = ((next(n for n in gm.graph.nodes if n.op == "placeholder"),),)  # the chain now feeds nothing
    gm.recompile()
    assert fusion_candidates(gm) == []
    torch.testing.assert_close(fuse(gm)(x), x)
    assert fused_groups(gm) == []


@torch.library.custom_op("hetcc_test::opaque_boundary", mutates_args=())
def opaque_boundary(x: torch.Tensor) -> torch.Tensor:
    """Stands in for hetcc's send/recv: an op with no lowering in the middle of a chain."""
    return x.clone()


@opaque_boundary.register_fake
def _(x):
    return torch.empty_like(x)


def test_group_stops_at_an_op_without_lowering_such_as_send_or_recv():
    def split_chain(m, x):
        y = torch.sigmoid(x * 3.0)
        return torch.relu(opaque_boundary(y) - 0.5) * 2.0

    x = torch.randn(5, 3)
    fused = fuse(exported(Fn(split_chain), x))
    order = [
        n.target
        for n in fused.graph.nodes
        if n.op == "call_function" and n.target in (FUSED, opaque_boundary._opoverload)
    ]
    assert order == [FUSED, opaque_boundary._opoverload, FUSED]
    torch.testing.assert_close(fused(x), split_chain(None, x))


def test_value_needed_by_an_earlier_outside_node_stays_out_of_the_group():
    def early_use(m, x):
        a = torch.exp(x)
        s = a.sum()  # not fusible, and it runs before the chain's end
        return (a * 2.0) + s

    x = torch.randn(3, 4)
    fused = fuse(exported(Fn(early_use), x))
    (group,) = fused_groups(fused)
    assert replaced(group) == ["mul", "add"]
    assert any(n.target is torch.ops.aten.exp.default for n in fused.graph.nodes)
    torch.testing.assert_close(fused(x), early_use(None, x))


def test_narrow_value_used_outside_is_not_stored_by_the_kernel():
    def bias_chain(m, x, b):
        b2 = b * 2.0  # shape [6], used outside: a kernel over [4, 6] must not own it
        return torch.tanh(x + b2), b2

    args = (torch.randn(4, 6), torch.randn(6))
    fused = fuse(exported(Fn(bias_chain), *args))
    (group,) = fused_groups(fused)
    assert replaced(group) == ["add", "tanh"] and group.shape == (4, 6)
    for got, want in zip(fused(*args), bias_chain(None, *args)):
        torch.testing.assert_close(got, want)


def test_single_ops_and_training_dropout_are_left_alone():
    def lonely(m, x):
        return F.dropout(torch.relu(x), 0.2, training=True) @ x.T

    fused = fuse(exported(Fn(lonely), torch.randn(3, 3)))
    assert fused_groups(fused) == []


def test_casts_fuse_through_their_metadata_assertions():
    def casts(m, x):
        return torch.sigmoid(x.half()).float() * 2.0

    x = torch.randn(2, 8)
    fused = fuse(exported(Fn(casts), x))
    (group,) = fused_groups(fused)
    assert [i.op for i in group.instrs] == ["cast", "sigmoid", "cast", "mul"]
    # The dtype check on the input stays; the one on the fused intermediate went with it.
    checks = [n for n in fused.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert [n.args[0].op for n in checks] == ["placeholder"]
    # fp16 intermediates stay fp32 inside the kernel (eager rounds sigmoid's result): fp16 tolerance.
    torch.testing.assert_close(fused(x), casts(None, x), atol=1e-2, rtol=1e-2)


def test_fused_record_costs_one_memory_pass_and_sums_member_flops():
    def bias_gelu(m, x, b):
        return F.gelu(x + b) * 3.0

    x, b = torch.randn(8, 16), torch.randn(16)
    gm = exported(Fn(bias_gelu), x, b)
    members = [n for n in gm.graph.nodes if n.op == "call_function"]
    for k, node in enumerate(members):
        ir.annotate(node, fwd_flops=100 * (k + 1), bwd_flops=10 * (k + 1), act_bytes=4, stage=2)
    fused = fuse(gm)
    (node,) = [n for n in fused.graph.nodes if n.target is FUSED]
    record = node.meta[ir.META_KEY]
    assert record.bytes == (8 * 16 + 16) * 4 + 8 * 16 * 4  # x and b read once, the output written once
    assert (record.fwd_flops, record.bwd_flops, record.stage) == (600, 60, 2)
    assert record.act_bytes == (8 * 16 + 16) * 4  # what the backward keeps: the group's inputs
    assert record.shape == (8, 16) and record.dtype == torch.float32
    (item,) = node.users
    assert item.meta["val"].shape == (8, 16) and item.meta[ir.META_KEY].stage == 2


def test_printed_code_lists_replaced_ops_backward_and_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fused = fuse(exported(Chain(), torch.randn(2, 2)))
    code = fused.code
    (group,) = fused_groups(fused)
    header = f"# {group.name}: pointwise, 5 ops (mul -> tanh -> add -> exp -> sub), backward=generated"
    assert header + ", backend=eager-fallback (CPU without TRITON_INTERPRET=1)" in code
    for line in (
        "mul = aten.mul.Tensor(x, 2.0)",
        "exp = aten.exp.default(add)",
        "sub = aten.sub.Tensor(exp, x)",
    ):
        assert f"#   {line}\n" in code
    assert code.index(header) < code.index("hetcc_kernels_launch_fused([x]")


def test_comments_follow_a_copied_module_once_reinstalled():
    fused = fuse(exported(Chain(), torch.randn(2, 2)))
    expected = fused.code
    copied = copy.deepcopy(fused)
    del fused
    gc.collect()  # the copy must not depend on the original graph for its comments
    install_code_comments(copied)
    install_code_comments(copied)  # idempotent
    (group,) = fused_groups(copied)
    assert copied.code.count(f"# {group.name}:") == 1
    assert copied.code == expected


def test_group_never_crosses_hetcc_send_or_recv():
    pytest.importorskip("hetcc.sendrecv", reason="hetcc::send/recv are registered by hetcc.sendrecv")

    def relay(m, x):
        y = torch.sigmoid(x * 3.0)
        token = torch.ops.hetcc.send(y, 1, 0, list(y.shape), y.dtype)
        received = torch.ops.hetcc.recv(token, 1, 1, list(y.shape), y.dtype)
        return torch.relu(received - 0.5) * 2.0 + y

    fused = fuse(exported(Fn(relay), torch.randn(4, 3)))  # structure only: no peer to talk to
    boundary = (FUSED, torch.ops.hetcc.send.default, torch.ops.hetcc.recv.default)
    assert [n.target for n in fused.graph.nodes if n.target in boundary] == [FUSED, *boundary[1:], FUSED]
    first, second = fused_groups(fused)
    assert (replaced(first), replaced(second)) == (["mul", "sigmoid"], ["sub", "relu", "mul_1", "add"])
