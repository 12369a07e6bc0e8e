"""split_stages: cuts, direct sends, parameter ownership, tied weights, printed code, numerics."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.fx.passes.shape_prop import ShapeProp

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))

from runtime_models import (  # noqa: E402
    GPT2_RULES,
    MLP_RULES,
    ResidualMLP,
    export,
    run_in_process,
    stages_by_module,
    tiny_gpt2,
)

from hetcc.errors import PlanFormatError  # noqa: E402
from hetcc.passes.codegen import compute_module, stage_source  # noqa: E402
from hetcc.passes.comm import split_stages  # noqa: E402


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = ResidualMLP()
    x = torch.randn(4, 8)
    gm = export(model, (x,))
    return model, gm, x, split_stages(gm, stages_by_module(gm, MLP_RULES), 3)


def test_skip_connection_is_sent_directly_to_each_consumer(mlp):
    _, _, _, stages = mlp
    edges = {(e.value, e.src, e.dst) for s in stages for e in s.sends}
    assert edges == {("relu", 0, 1), ("relu", 0, 2), ("relu_1", 1, 2)}
    assert [e.value for e in stages[1].recvs] == ["relu"] and [e.value for e in stages[1].sends] == ["relu_1"]
    assert {(e.value, e.src) for e in stages[2].recvs} == {("relu", 0), ("relu_1", 1)}


def test_each_stage_owns_only_its_parameters(mlp):
    _, _, _, stages = mlp
    owned = [sorted(name for name, _ in s.module.named_parameters()) for s in stages]
    assert owned == [["a.bias", "a.weight"], ["b.bias", "b.weight"], ["c.bias", "c.weight"]]
    assert [s.inputs for s in stages] == [("x",), (), ()]
    assert [s.num_outputs for s in stages] == [0, 0, 1]
    assert all(not s.tied for s in stages)


def test_printed_code_shows_send_and_recv_with_peer_tag_and_shape(mlp):
    _, _, _, stages = mlp
    code0, code2 = stages[0].module.code, stages[2].module.code
    tag = next(e.tag for e in stages[0].sends if e.dst == 2)
    assert f"torch.ops.hetcc.send.default(relu, 2, {tag}, [4, 8], torch.float32)" in code0
    assert f"torch.ops.hetcc.recv.default(hetcc_anchor, 0, {tag}, [4, 8], torch.float32)" in code2
    source = stage_source(stages[2])
    assert "# receives: relu float32[4, 8] from stage 0" in source and "#   c.weight: float32[8, 8]" in source


def test_compute_module_replaces_comm_by_inputs_and_outputs(mlp):
    _, _, x, stages = mlp
    compute = [compute_module(s) for s in stages]
    assert "hetcc" not in "".join(c.code for c in compute)
    h, h_again = compute[0](x)
    (g,) = compute[1](h)
    received = {"relu": h_again, "relu_1": g}
    (out,) = compute[2](*(received[e.value] for e in stages[2].recvs))
    torch.testing.assert_close(out, mlp[0](x), rtol=0, atol=0)


def test_in_process_run_matches_the_graph_forward_and_backward(mlp):
    model, gm, x, stages = mlp
    (out,) = run_in_process(stages, {"x": x}, backward=True)
    reference = gm(x)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    reference.sum().backward()
    expected = dict(gm.named_parameters())
    for stage in stages:
        for local, name in stage.param_names.items():
            torch.testing.assert_close(stage.module.get_parameter(local).grad, expected[name].grad)


def test_tied_gpt2_weights_are_held_by_both_stages_and_recorded():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    gm = export(model, kwargs={"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    stages = split_stages(gm, stages_by_module(gm, GPT2_RULES), 3)
    (group,) = stages[0].tied
    assert group.name == "transformer.wte.weight"
    assert group.stages == (0, 2)
    for stage, local in group.members:  # export names the shared tensor lm_head.weight in both stages
        assert stages[stage].param_names[local] == "transformer.wte.weight"
    assert not any("wte" in name for name, _ in stages[1].module.named_parameters())
    # labels are read by the last stage directly (no relay through stage 1)
    assert stages[0].inputs == ("input_ids",) and stages[1].inputs == () and stages[2].inputs == ("labels",)
    # the attention mask depends on inputs and constants alone: stage 1 recomputes it, nothing is sent
    assert {e.value: e.requires_grad for e in stages[1].recvs} == {"add_8": True}
    assert "where" in {n.name for n in stages[1].module.graph.nodes}
    loss, logits = run_in_process(stages, {"input_ids": ids, "labels": ids})
    expected = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(loss, expected.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-6, atol=1e-6)


class _Flatten(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x):
        batch = x.size(0)
        return self.b(self.a(x)).view(batch, 2, 3)


def test_symbolic_trace_graph_recomputes_non_tensor_values_in_the_consumer():
    model = _Flatten()
    x = torch.randn(4, 6)
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    stages = split_stages(gm, {"size": 0, "a": 0, "b": 1, "view": 1}, 2)
    assert [e.value for e in stages[0].sends] == ["a"]  # the int `batch` is not sent
    assert stages[1].inputs == ("x",)  # ...but recomputed from the input
    (out,) = run_in_process(stages, {"x": x})
    torch.testing.assert_close(out, model(x))


def test_mapping_that_flows_backwards_names_both_nodes(mlp):
    _, gm, _, _ = mlp
    mapping = stages_by_module(gm, MLP_RULES)
    mapping["linear"] = 1
    mapping["relu"] = 0
    with pytest.raises(PlanFormatError, match="'relu' \\(stage 0\\) uses 'linear' from the later stage 1"):
        split_stages(gm, mapping, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nonexistent": 0}, "not in the graph"),
        ({"linear": 5}, "not in 0..2"),
        ({}, "stage\\(s\\) \\[2\\] have no nodes"),
    ],
)
def test_invalid_mappings_are_rejected(mlp, change, message):
    _, gm, _, _ = mlp
    mapping = {k: min(v, 1) for k, v in stages_by_module(gm, MLP_RULES).items()}
    mapping.update(change)
    with pytest.raises(PlanFormatError, match=message):
        split_stages(gm, mapping, 3)


def test_graph_without_shape_metadata_fails_clearly():
    gm = torch.fx.symbolic_trace(ResidualMLP())
    with pytest.raises(PlanFormatError, match="no shape metadata"):
        split_stages(gm, {"a": 0, "relu": 0, "b": 1, "relu_1": 1, "c": 1, "add": 1}, 2)


def test_compute_module_retargets_device_constants_baked_in_by_tracing():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    gm = export(model, kwargs={"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    last = split_stages(gm, stages_by_module(gm, GPT2_RULES), 3)[2]
    assert "device(type='cpu')" in last.module.code
    code = compute_module(last, "meta").code
    assert "device(type='meta')" in code and "device(type='cpu')" not in code


def test_stage_inputs_keep_the_models_own_names_where_fx_renames_the_placeholder():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(2, 4)
    gm = export(model, kwargs={"input": x})  # fx names the placeholder input_1: `input` is a builtin
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_1"]
    stage_of = {n.name: int("linear_1" in n.name) for n in gm.graph.nodes if n.op == "call_function"}
    stages = split_stages(gm, stage_of, 2)
    assert stages[0].inputs == ("input",) and "input" in stages[0].input_shapes
    (out,) = run_in_process(stages, {"input": x})
    torch.testing.assert_close(out, model(x))


class _Front(torch.nn.Module):
    """Besides its layer, makes three tensors from the input alone: a cheap mask, a random mask and a
    matmul of the input by a constant."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.register_buffer("mix", torch.eye(8).flip(0))

    def forward(self, x):
        cheap = (x > 0).float() * 2 - 1
        noise = (torch.rand_like(x) > 0.5).float()
        return self.a(x), cheap, noise, x @ self.mix


class _Constants(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.front, self.back = _Front(), torch.nn.Linear(8, 8)

    def forward(self, x):
        h, cheap, noise, mixed = self.front(x)
        return self.back(h) * cheap * noise + mixed


def test_a_cheap_tensor_of_inputs_alone_is_recomputed_a_random_or_costly_one_is_sent():
    torch.manual_seed(0)
    model, x = _Constants(), torch.randn(4, 8)
    gm = export(model, (x,))
    stages = split_stages(gm, stages_by_module(gm, [("front", 0), ("back", 1)]), 2)
    received = {e.value: e.requires_grad for e in stages[1].recvs}
    assert received == {"linear": True, "to_1": False, "matmul": False}  # the layer, the random mask, x @ mix
    assert stages[1].inputs == ("x",)  # it reads the input to recompute the cheap mask
    ops = {n.target for n in stages[1].module.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.gt.Scalar in ops and torch.ops.aten.rand_like.default not in ops
    # the stage that made the cheap mask for the next one no longer makes it: nothing of its own reads it
    first = [n for n in stages[0].module.graph.nodes if n.target is torch.ops.aten.gt.Scalar]
    assert [n.args[0].target for n in first] == [torch.ops.aten.rand_like.default]  # the random mask's only
