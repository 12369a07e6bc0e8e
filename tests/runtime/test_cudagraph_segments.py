"""CUDA graph segments of stage graphs (``hetcc.runtime.cudagraphs``): the runs of compute between a
stage's communication and the ops no graph can hold, the stage rewritten to call them, the knob, and
(on a CUDA machine only) captured stages against uncaptured ones."""

from __future__ import annotations

import pytest
import torch
from models import gpt2, token_ids
from runtime_models import MLP_RULES, ResidualMLP, export, stages_by_module

import hetcc
from hetcc import config
from hetcc.errors import HetccError
from hetcc.passes.codegen import module_for_device
from hetcc.passes.comm import split_stages
from hetcc.runtime.cudagraphs import (
    GraphedStage,
    graphs_for_stage,
    graphs_note,
    in_flight_peak,
    room_for_graphs,
)
from hetcc.runtime.segments import barrier_reason, plan_segments, split_at_segments
from hetcc.sendrecv import LocalTransport, use_transport
from hetcc.solver.schedules import Action
from hetcc.train.local import run_local

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU unless one is present
COMM = (torch.ops.hetcc.send.default, torch.ops.hetcc.recv.default)
GPIPE_2 = [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]


@pytest.fixture(scope="module")
def mlp_stages():
    torch.manual_seed(0)
    gm = export(ResidualMLP(), kwargs={"x": torch.randn(4, 8)})
    return split_stages(gm, stages_by_module(gm, MLP_RULES), 3)


@pytest.fixture(scope="module")
def gpt2_compiled():
    """GPT-2 compiled by hetcc for two CPU devices too small for all of it: two stages, with recv/send."""
    cluster = hetcc.Cluster.from_spec({
        "nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s", "latency": "30 us"},
                   "devices": [{"type": "cpu", "count": 2, "memory": "600 KiB"}]}],
    })  # fmt: skip
    model = gpt2(n_layer=2, n_embd=32, vocab=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 8, vocab=64)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=2, replicate=False)
    assert len(compiled.pipeline.stages) == 2
    return compiled, ids


def test_residual_mlp_segments_print_where_communication_falls(mlp_stages):
    dumps = [plan_segments(stage.module.graph).format() for stage in mlp_stages]
    assert dumps[0] == (
        "# CUDA graph segments: 1 (2 ops), 2 nodes outside, 0 runs under 2 ops\n"
        "segment 0 (2 ops): linear, relu  <- x  -> relu\n"
        "outside send_relu_to_2 = hetcc.send.default: communication with another stage\n"
        "outside send_relu_to_1 = hetcc.send.default: communication with another stage"
    )
    assert dumps[1] == (
        "# CUDA graph segments: 1 (2 ops), 3 nodes outside, 0 runs under 2 ops\n"
        "outside hetcc_anchor = hetcc_anchor: communication: the anchor hetcc.recv ties received tensors to\n"
        "outside recv_relu = hetcc.recv.default: communication with another stage\n"
        "segment 0 (2 ops): linear_1, relu_1  <- recv_relu  -> relu_1\n"
        "outside send_relu_1_to_2 = hetcc.send.default: communication with another stage"
    )
    # the last stage's second recv falls between its two ops: two runs of one op, neither worth a graph
    assert dumps[2].splitlines()[0] == "# CUDA graph segments: 0 (0 ops), 3 nodes outside, 2 runs under 2 ops"
    assert "uncaptured linear_2: 1 op(s), too few for a graph" in dumps[2]


@pytest.mark.parametrize("device", [None, CUDA], ids=["as-traced", "cuda-stage"])
def test_segments_of_compiled_stages_are_valid(gpt2_compiled, device):
    """No segment holds a comm or uncapturable op, each reads only what comes before it, and segments,
    nodes outside and short runs cover the stage's call nodes once, in graph order."""
    for stage in gpt2_compiled[0].pipeline.stages:
        plan = plan_segments(stage.module.graph, device)
        assert plan.segments
        _check_plan(stage.module.graph, plan, device)
        comm = [n for n in stage.module.graph.nodes if n.target in COMM]
        assert comm and all(plan.outside[n] == "communication with another stage" for n in comm)


def _check_plan(graph: torch.fx.Graph, plan, device) -> None:
    order = {node: i for i, node in enumerate(graph.nodes)}
    label = {}
    for segment in plan.segments:
        members = set(segment.nodes)
        label.update(dict.fromkeys(segment.nodes, f"segment {segment.index}"))
        assert all(barrier_reason(node, device) is None for node in segment.nodes)
        assert all(order[v] < order[segment.nodes[0]] and v not in members for v in segment.inputs)
        for node in segment.nodes:  # every value it needs: its own, an attribute, or an input
            assert all(
                v in members or v.op == "get_attr" or v in segment.inputs for v in node.all_input_nodes
            )
        assert all(any(u not in members for u in node.users) for node in segment.outputs)
        assert set(segment.outputs) == {n for n in segment.nodes if any(u not in members for u in n.users)}
    label.update({node: "outside" for node in plan.outside})
    label.update({node: f"short {i}" for i, run in enumerate(plan.short) for node in run})
    calls = [n for n in graph.nodes if n.op.startswith("call") or n in plan.outside]
    assert [n for n in calls if n not in label] == []  # covered, and (dict) each node once
    runs = [label[n] for n in calls]
    grouped = [name for i, name in enumerate(runs) if i == 0 or runs[i - 1] != name]
    named = [name for name in grouped if name != "outside"]
    assert len(named) == len(set(named))  # each segment and short run is one contiguous run


def test_compiled_stages_are_one_segment_each_between_their_communication(gpt2_compiled):
    first, last = gpt2_compiled[0].pipeline.stages
    (segment,) = plan_segments(first.module.graph).segments
    send = next(n for n in first.module.graph.nodes if n.target is torch.ops.hetcc.send.default)
    assert [n.name for n in segment.inputs] == ["input_ids"] and segment.outputs == (send.args[0],)
    (segment,) = plan_segments(last.module.graph).segments
    recv = next(n for n in last.module.graph.nodes if n.target is torch.ops.hetcc.recv.default)
    output = next(n for n in last.module.graph.nodes if n.op == "output")
    assert set(segment.inputs) == {recv, *(n for n in last.module.graph.nodes if n.op == "placeholder")}
    assert set(segment.outputs) == set(output.all_input_nodes)  # the loss and the logits
    held = {name for name, _ in last.module.named_parameters()} | {
        name for name, _ in last.module.named_buffers()
    }
    assert segment.attributes and set(segment.attributes) <= held  # parameters are attributes, not inputs


def test_a_cuda_stage_keeps_host_device_ops_outside(gpt2_compiled):
    """Traced ``device=cpu`` constants would run on the host in a GPU stage (``module_for_device``
    retargets them there, so the executor's plan has none)."""
    first = gpt2_compiled[0].pipeline.stages[0]
    plan = plan_segments(first.module.graph, CUDA)
    named_cpu = [n for n in first.module.graph.nodes if torch.device("cpu") in (*n.args, *n.kwargs.values())]
    assert named_cpu and all(
        n in plan.outside and "names a device other" in plan.outside[n] for n in named_cpu
    )
    assert len(plan.segments) > 1


def _host_sync(x):
    a = torch.relu(x * 2)
    b = a.sum(0) + 1
    scale = b.max().item()
    return torch.tanh(a * scale) - 1


def test_item_in_the_middle_splits_a_hand_built_graph_in_two():
    gm = torch.fx.symbolic_trace(_host_sync)
    plan = plan_segments(gm.graph)
    item = next(n for n in gm.graph.nodes if n.target == "item")
    assert plan.outside == {item: "reads a tensor's value on the host"}
    before, after = plan.segments
    assert [n.name for n in before.nodes] == ["mul", "relu", "sum_1", "add", "max_1"]
    assert [n.name for n in after.nodes] == ["mul_1", "tanh", "sub"]
    assert [n.name for n in before.outputs] == ["relu", "max_1"]  # relu is read after the item
    assert [n.name for n in after.inputs] == ["relu", "item"]
    _check_plan(gm.graph, plan, None)


@pytest.mark.parametrize(
    "op, reason",
    [
        (lambda x: torch.nonzero(x), "its output shape depends on the data"),
        (lambda x: torch.masked_select(x, x > 0), "its output shape depends on the data"),
        (lambda x: torch.ops.aten._local_scalar_dense.default(x.sum()), "reads a tensor's value on the host"),
        (lambda x: torch.equal(x, x), "reads a tensor's value on the host"),
        (
            lambda x: torch.ops.aten.is_nonzero.default(x.sum()),
            "waits for the device (a host sync or a Python value)",
        ),
        (lambda x: x.cpu(), "waits for the device (a host sync or a Python value)"),
    ],
    ids=["nonzero", "masked_select", "local_scalar_dense", "equal", "is_nonzero", "cpu"],
)
def test_uncapturable_ops_stay_outside(op, reason):
    gm = torch.fx.symbolic_trace(lambda x: op(torch.exp(x) * 2))
    plan = plan_segments(gm.graph)
    assert reason in plan.outside.values()
    assert not any(barrier_reason(n) for s in plan.segments for n in s.nodes)


def test_index_is_captured_with_integer_indices_only():
    gm = export(_Gather(), (torch.randn(4, 8), torch.tensor([0, 2])))
    index = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor)
    assert barrier_reason(index) is None
    index.args[1][0].meta["val"] = torch.zeros(4, dtype=torch.bool)  # as a boolean mask would be
    assert barrier_reason(index) == "its output shape depends on the data"


class _Gather(torch.nn.Module):
    def forward(self, x, rows):
        return torch.relu(x[rows] * 2)


def test_a_write_into_a_value_from_before_the_run_stays_outside():
    def f(x):
        y = torch.relu(x) * 2
        x.add_(1)
        z = y * 3
        z.mul_(2)  # its own run's value: fine inside
        return z + x

    gm = torch.fx.symbolic_trace(f)
    plan = plan_segments(gm.graph)
    assert [n.name for n in plan.outside] == ["add_"]
    assert [[n.name for n in s.nodes] for s in plan.segments] == [["relu", "mul"], ["mul_1", "mul_", "add"]]


def test_split_stages_compute_what_the_stages_compute(gpt2_compiled):
    """Each stage rewritten to call its segments (many of them, with host-device ops between, as the
    plan for a CUDA stage of the traced graph has) gives the same loss and gradients on CPU."""
    compiled, ids = gpt2_compiled
    stages = compiled.pipeline.stages
    split = [split_at_segments(s.module, plan_segments(s.module.graph, CUDA)) for s in stages]
    want, want_grads = _run_pipeline([s.module for s in stages], stages, ids[:2])
    got, got_grads = _run_pipeline(split, stages, ids[:2])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=0, msg=name)
    assert "segment_0 = self.segment_0(" in split[0].code


def _run_pipeline(modules, stages, ids, call=None):
    """Forward through both stages and back in one process; the loss and every parameter's gradient."""
    params = {
        f"{k}.{name}": p for k, stage in enumerate(stages) for name, p in stage.module.named_parameters()
    }
    for param in params.values():
        param.grad = None
    inputs = {"input_ids": ids, "labels": ids}
    with use_transport(_Mailbox()):
        run = call or (lambda k, module, args: module(*args))
        tokens = run(0, modules[0], [inputs[name] for name in stages[0].inputs])
        loss = run(1, modules[1], [inputs[name] for name in stages[1].inputs])[0]
        loss.backward()
        torch.autograd.backward(list(tokens), [torch.ones_like(t) for t in tokens])
    return loss.detach(), {name: p.grad.clone() for name, p in params.items() if p.grad is not None}


class _Mailbox(LocalTransport):
    """LocalTransport that takes any dtype (autocast's) where the traced graph records fp32."""

    def recv(self, peer, tag, shape, dtype, *, grad):
        return self.mailbox[(tag, grad)].pop(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where capture cannot run")
def test_a_stage_that_cannot_be_captured_runs_uncaptured_and_says_why(mlp_stages):
    module = mlp_stages[0].module
    graphs = GraphedStage(module, plan_segments(module.graph), torch.device("cpu"), "fp32", "on")
    assert graphs.reason == "pending: 1 segments (2 ops), captured at the second training step"
    graphs.begin_step(GPIPE_2)  # nothing recorded yet
    with use_transport(LocalTransport()):
        for m in range(2):  # the first step records each microbatch's inputs
            x = torch.randn(4, 8)
            torch.testing.assert_close(graphs(m, x)[0], module(x)[0])
    (call,) = graphs.calls
    assert sorted(call.samples) == [0, 1] and call.samples[0][0].shape == (4, 8)
    graphs.begin_step(GPIPE_2)  # capture: no CUDA here
    assert not graphs.active and graphs.reason.startswith("off: capture failed: ")
    assert call.samples == {} and call.graphed == {}


def test_auto_captures_only_where_the_device_holds_every_microbatchs_graphs(mlp_stages):
    one_f_one_b = [
        Action(kind, m) for kind, m in [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    ]
    assert in_flight_peak(one_f_one_b) == 2 and in_flight_peak(GPIPE_2) == 2
    module = mlp_stages[1].module
    graphs, reason = graphs_for_stage(module, CUDA, "fp32", recompute=False, mode="auto")
    assert reason == "pending: 1 segments (2 ops), captured at the second training step"
    gib = 2**30
    # 1F1B holds 2 of 8 microbatches; the first step grew by 4 GiB to a 10 GiB peak: 6 more microbatches
    # of 2 GiB (+10% for static inputs) need 23.2 GiB, which 80 GiB holds and 24 GiB does not
    assert room_for_graphs(4 * gib, 10 * gib, 80 * gib, forwards=8, held=2) is None
    assert room_for_graphs(4 * gib, 10 * gib, 24 * gib, forwards=8, held=2) == (
        "graphs for all 8 microbatches would need 23.2 GiB of the device's 24.0 GiB (the schedule holds 2 at once)"
    )
    assert room_for_graphs(4 * gib, 10 * gib, 12 * gib, forwards=2, held=2) is None  # GPipe holds all anyway


def test_why_graphs_are_off(mlp_stages):
    def off(stage: int = 1, device=CUDA, recompute: bool = False, mode: str = "auto"):
        return graphs_for_stage(mlp_stages[stage].module, device, "fp32", recompute=recompute, mode=mode)

    assert off(device=torch.device("cpu")) == (None, "off: a cpu device (CUDA graphs need a CUDA device)")
    assert off(mode="off") == (None, "off: config.cuda_graphs is off")
    assert off(recompute=True) == (
        None,
        "off: the stage recomputes its forward in backward (torch.utils.checkpoint)",
    )
    assert off(stage=2, mode="on") == (None, "off: no run of 2 or more ops between the stage's communication")


@pytest.mark.parametrize(
    "value, mode", [("auto", "auto"), (" ON ", "on"), ("off", "off"), ("0", "off"), ("1", "on")]
)
def test_cuda_graphs_knob_parses(value, mode):
    assert config.cuda_graphs_mode(value) == mode


def test_a_bad_cuda_graphs_value_is_a_clear_error():
    with pytest.raises(HetccError, match=r"'yes', not a CUDA graphs mode") as error:
        config.cuda_graphs_mode("yes")
    assert error.value.hint == "use one of off, auto, on (0 and 1 mean off and on)"
    with config.patch(cuda_graphs="autoo"), pytest.raises(HetccError, match="did you mean 'auto'"):
        config.cuda_graphs_mode(config.cuda_graphs)


@pytest.mark.slow
def test_each_rank_reports_why_graphs_are_off(mlp_stages):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    result = run_local(mlp_stages, {"x": x}, y, torch.nn.functional.mse_loss, microbatches=2)
    assert [stats["cuda_graphs"] for stats in result.stats] == [
        "off: a cpu device (CUDA graphs need a CUDA device)"
    ] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_captured_stages_match_uncaptured_ones_on_cuda(gpt2_compiled, precision):
    """Both GPT-2 stages on one GPU, two microbatches per step (GPipe order): the first step records,
    the second captures and replays, the third replays; loss and gradients equal the eager ones'."""
    compiled, ids = gpt2_compiled
    stages = compiled.pipeline.stages
    modules = [module_for_device(stage, CUDA).to(CUDA) for stage in stages]
    graphs = [GraphedStage(m, plan_segments(m.graph, CUDA), CUDA, precision, "on") for m in modules]
    eager_runs = [0]
    for graphed in graphs:
        for call in graphed.calls:
            call.compute.register_forward_hook(lambda *_: eager_runs.__setitem__(0, eager_runs[0] + 1))
    ids = ids.to(CUDA)
    for step in range(3):
        for graphed in graphs:
            graphed.begin_step(GPIPE_2)
        runs_before = eager_runs[0]
        for m in range(2):
            microbatch = ids[2 * m : 2 * m + 2]
            with graphs[0].context():
                want = _run_pipeline(modules, stages, microbatch)
                got = _run_pipeline(
                    modules, stages, microbatch, call=lambda k, _, args, m=m: graphs[k](m, *args)
                )
            tolerance = {"rtol": 1e-5, "atol": 1e-5} if precision == "fp32" else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(got[0], want[0], **tolerance)
            for name, grad in want[1].items():
                torch.testing.assert_close(got[1][name], grad, **tolerance, msg=name)
        if step > 0:
            assert all(g.reason.startswith("on: ") for g in graphs), [g.reason for g in graphs]
            assert eager_runs[0] == runs_before  # every segment replayed its graph


def test_the_plan_says_which_stages_run_as_cuda_graphs_and_why_not_the_others(gpt2_compiled):
    compiled, _ = gpt2_compiled
    stages = compiled.pipeline.stages
    assert not any(note.startswith("cuda graphs") for note in compiled.plan.notes)  # CPU devices only
    note = graphs_note(stages, on_gpu=[True, True], recompute=[False, True], mode="auto")
    assert note == (
        "cuda graphs (auto): stages 0 (1 segment) captured at the second step where the device holds every "
        "microbatch's graphs; stage 1 uncaptured: the stage recomputes its forward in backward "
        "(torch.utils.checkpoint)"
    )
    note = graphs_note(stages, on_gpu=[False, True], recompute=[False, False], mode="on")
    assert note == (
        "cuda graphs (on): stages 1 (1 segment) captured at the second step; "
        "stage 0 uncaptured: a cpu device (CUDA graphs need a CUDA device)"
    )
    assert (
        graphs_note(stages, [True, True], [False, False], "off") == "cuda graphs: off (HETCC_CUDA_GRAPHS=off)"
    )
    split = graphs_note(stages, [True, True], [False, False], "auto", split=[False, True])
    assert split.endswith(
        "stage 1 uncaptured: the schedule splits the stage's backward (zero-bubble); a captured graph runs it whole"
    )


def test_a_stage_whose_backward_the_schedule_splits_runs_uncaptured(mlp_stages):
    graphs, _ = graphs_for_stage(mlp_stages[1].module, CUDA, "fp32", recompute=False, mode="on")
    graphs.begin_step([Action("F", 0), Action("B", 0), Action("W", 0)])
    assert not graphs.active and graphs.reason.startswith("off: the schedule splits the stage's backward")
