"""Tensor parallelism end to end: the ``TensorSplit`` rows ``passes.tensor_cost`` prices from the rewritten
graph, ``hetcc.compile(tensor_parallel=...)`` planning with them, and the stages it shards."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import model_zoo
import pytest
import torch
from runtime_models import slow_cards

import hetcc
from hetcc import config
from hetcc.cli import build_parser
from hetcc.errors import HetccError
from hetcc.hardware.cluster import Cluster
from hetcc.kernels import FUSION_META_KEY
from hetcc.passes.cost import cost
from hetcc.passes.partition import PlanSettings, build_problem
from hetcc.passes.tensor_cost import group_link, tensor_cost, tensor_row, tried_degrees
from hetcc.plan import Plan, read_plan
from hetcc.report import load
from hetcc.solver.links import ring_allreduce_s

NVLINK_BPS, NVLINK_S = 300e9, 2e-6  # slow_cards' intra-node link
LAYERS = (1, 2)  # the transformer blocks of model_zoo's two-layer models (embed, layer 0, layer 1, head)


def _cluster(tmp_path: Path, per_node: list[int], memory: int = 2**30, gflops: int = 1, **kw) -> Path:
    """``slow_cards`` at ``gflops`` GFLOP/s: at 1 the tiny models' compute outweighs each op's host time,
    as a large model's does on a real card."""
    path = tmp_path / f"cards{'-'.join(map(str, per_node))}-{memory}.yaml"
    path.write_text(slow_cards(per_node, memory, **kw).replace("20 GFLOP/s", f"{gflops} GFLOP/s"))
    return path


@pytest.fixture(scope="module")
def costed(tmp_path_factory):
    """model name -> (analysis, cluster), the graph costed on the cluster's cards."""
    folder, cache = tmp_path_factory.mktemp("cards"), {}

    def get(name: str):
        if name not in cache:
            case = getattr(model_zoo, name)()
            analysis = hetcc.analyze(case.model, example_kwargs=case.inputs)
            cluster = Cluster.from_file(_cluster(folder, [2]))
            cost(analysis.graph, device_types=cluster.types, fuse="off")
            cache[name] = (case, analysis, cluster)
        return cache[name]

    return get


def _problem(analysis, cluster, settings):
    return build_problem(analysis.graph, analysis.blocks, analysis.tied_params, cluster, settings)


# ----------------------------------------------------------------------------------------- the rows


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_at_degree_two_a_layer_holds_half_and_computes_less_plus_its_collectives(costed, name):
    _, analysis, cluster = costed(name)
    settings = PlanSettings(1, "1f1b", True, "adam", tensor_parallel=2)
    whole = _problem(analysis, cluster, settings)
    pricing = tensor_cost(analysis.graph, analysis.blocks, analysis.tied_params, cluster, settings)
    (row,) = pricing.rows
    fwd_c, bwd_c = pricing.collective_s[2]
    for i in LAYERS:
        assert row.state_bytes[i] == pytest.approx(whole.state_bytes[i] / 2, rel=0.1)
        assert row.param_bytes[i] == pytest.approx(whole.param_bytes[i] / 2, rel=0.1)
        assert row.optimizer_bytes[i] == pytest.approx(whole.optimizer_bytes[i] / 2, rel=0.1)
        compute = row.fwd_s["Slow"][i] - fwd_c["Slow"][i] + row.bwd_s["Slow"][i] - bwd_c["Slow"][i]
        assert compute < 0.6 * (whole.fwd_s["Slow"][i] + whole.bwd_s["Slow"][i])
        assert fwd_c["Slow"][i] > 0 and bwd_c["Slow"][i] > 0
        assert row.wgrad_s["Slow"][i] <= row.bwd_s["Slow"][i] - bwd_c["Slow"][i]
    dataclasses.replace(whole, tensor_splits=pricing.rows).validate()
    assert pricing.gathered[2] == []
    assert "degree 2, priced in" in pricing.summary([b.name for b in analysis.blocks])


def test_a_llama_layer_moves_its_residual_twice_each_way_on_the_nodes_link(costed):
    """Sequence parallel: per layer two reduce-scatters and two gathers forward (what two all-reduces
    move), the same backward, and the two norms' weight gradients (partial sums over each device's tokens)
    all-reduced; the first layer's attention takes the embedding's replicated output, entered."""
    case, analysis, cluster = costed("llama")
    settings = PlanSettings(1, "1f1b", True, "adam", tensor_parallel=2)
    pricing = tensor_cost(analysis.graph, analysis.blocks, analysis.tied_params, cluster, settings)
    fwd_c, bwd_c = pricing.collective_s[2]
    batch, seq = case.inputs["input_ids"].shape
    hidden = case.model.config.hidden_size
    once = ring_allreduce_s(batch * seq * hidden * 4, 2, NVLINK_BPS, NVLINK_S)  # fp32 residual
    norm = ring_allreduce_s(hidden * 4, 2, NVLINK_BPS, NVLINK_S)
    first, second = LAYERS
    assert fwd_c["Slow"][second] == pytest.approx(2 * once)
    assert bwd_c["Slow"][second] == pytest.approx(2 * once + 2 * norm)
    # the first: its attention's input enters (no gather forward; an all-reduce backward), and the
    # embedding's output, sliced to the tokens for the residual add, gathers its gradient back (half);
    # only its MLP's norm runs on a part of the tokens
    assert fwd_c["Slow"][first] == pytest.approx(1.5 * once)
    assert bwd_c["Slow"][first] == pytest.approx(once + once / 2 + 3 * once / 2 + norm)
    assert once == pytest.approx(2 * (batch * seq * hidden * 4 / 2 / NVLINK_BPS + NVLINK_S))


def test_under_autocast_a_sum_of_half_precision_matmuls_moves_half_the_bytes(costed):
    _, analysis, cluster = costed("llama")
    fp32, mixed = (
        tensor_cost(analysis.graph, analysis.blocks, analysis.tied_params, cluster,
                    PlanSettings(1, "1f1b", True, "adam", precision=p, tensor_parallel=2)).collective_s[2]
        for p in ("fp32", "bf16-mixed")
    )  # fmt: skip
    # forward: the row-parallel matmuls' outputs are bf16 (reduce-scattered at half the bytes), the norms'
    # outputs fp32 (gathered whole); backward: the bf16 outputs' gradients are gathered at half too
    layer = LAYERS[1]
    assert fp32[0]["Slow"][layer] / 2 < mixed[0]["Slow"][layer] < fp32[0]["Slow"][layer]
    assert mixed[1]["Slow"][layer] < fp32[1]["Slow"][layer]


class _Wide(torch.nn.Module):
    """Two matmuls whose weights outweigh their two-row inputs: under autocast each casts its weight."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(2048, 16384), torch.nn.Linear(16384, 2048)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


def test_under_autocast_each_device_casts_only_its_part_of_a_split_weight(tmp_path):
    """Memory-bound at two rows, the column-parallel matmul's forward is its weight's fp32 -> bf16 cast
    and read: at degree 2 each device does about half (the records of the split weights are the parts)."""
    with torch.device("meta"):
        model = _Wide()
    analysis = hetcc.analyze(model, (torch.randn(2, 2048, device="meta"),))
    cluster = Cluster.from_file(_cluster(tmp_path, [2], gflops=10**6))
    settings = PlanSettings(1, "1f1b", True, "adam", precision="bf16-mixed", tensor_parallel=2)
    cost(analysis.graph, device_types=cluster.types, fuse="off", dtype=torch.bfloat16, autocast=True)
    whole = _problem(analysis, cluster, settings)
    pricing = tensor_cost(
        analysis.graph, analysis.blocks, analysis.tied_params, cluster, settings, torch.bfloat16
    )
    (row,) = pricing.rows
    assert [b.name for b in analysis.blocks] == ["up", "down"]
    assert row.fwd_s["Slow"][0] < 0.65 * whole.fwd_s["Slow"][0]  # the whole weight's cast: 0.86 x


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_at_degree_one_the_row_holds_exactly_the_problems_bytes(costed, name, monkeypatch):
    monkeypatch.setattr(config, "fuse", "off")  # as the fixture priced the whole graph
    _, analysis, cluster = costed(name)
    settings = PlanSettings(1, "1f1b", True, "adam", precision="bf16-mixed")
    whole = _problem(analysis, cluster, settings)
    row, (fwd_c, _), _ = tensor_row(
        analysis.graph, 1, analysis.blocks, analysis.tied_params, cluster, settings, cluster.types
    )
    for field in ("state_bytes", "act_bytes", "param_bytes", "optimizer_bytes"):
        assert getattr(row, field) == getattr(whole, field), field
    assert fwd_c["Slow"] == [0.0] * len(whole.blocks)  # a ring of one moves nothing
    # the same cost model: the rewrite's identity collectives add only their host time
    for mine, theirs in zip(row.fwd_s["Slow"], whole.fwd_s["Slow"]):
        assert theirs * 0.99 <= mine <= theirs * 1.3


def test_degrees_go_up_to_the_most_like_devices_one_node_holds(tmp_path):
    cluster = Cluster.from_file(_cluster(tmp_path, [4, 2], inter_node="10 Gb/s"))
    assert {t: [k.name for k in kinds] for t, kinds in tried_degrees(cluster, "auto").items()} == {
        2: ["Slow"],
        4: ["Slow"],
    }
    assert list(tried_degrees(cluster, 2)) == [2]
    with pytest.raises(
        HetccError, match=r"tensor_parallel=8: no node holds 8 like devices \(the most: 4 Slow\)"
    ):
        tried_degrees(cluster, 8)


def test_a_ring_runs_at_the_slowest_intra_node_link_of_its_type(tmp_path):
    text = slow_cards([2, 2], 2**30, inter_node="10 Gb/s").replace(
        "nodes:\n  - name: node0\n    intra_link: {kind: nvlink, bandwidth: 300 GB/s, latency: 2 us}",
        "nodes:\n  - name: node0\n    intra_link: {kind: pcie, bandwidth: 16 GB/s, latency: 5 us}",
    )
    path = tmp_path / "two_links.yaml"
    path.write_text(text)
    assert group_link(Cluster.from_file(path), "Slow", 2) == (16e9, 5e-6)


# ------------------------------------------------------------------------------------ the compiler


def test_two_cards_hold_what_one_cannot_as_one_tensor_parallel_stage(tmp_path):
    case = model_zoo.gpt2()
    cluster = _cluster(tmp_path, [2], memory=2_000_000)  # the model and its Adam state need ~2.7 MB
    compiled = hetcc.compile(
        case.model,
        cluster,
        example_kwargs=case.inputs,
        microbatches=1,
        tensor_parallel=2,
        dump_dir=tmp_path / "ir",
    )
    plan = compiled.plan
    (stage,) = plan.stages
    assert stage.tensor == 2 and stage.devices == ("slow-0", "slow-1") and stage.device_type == "Slow"
    assert stage.peak_memory_bytes <= stage.device_memory_bytes < 2.7e6
    assert "megatron" in plan.baselines and any(
        n.startswith("tensor parallel: degrees priced 2") for n in plan.notes
    )
    assert plan.lower_bound_s <= plan.step_time_s
    # the stage runs sharded: explicit collectives, each weight's split recorded, and the groups that pay
    # fused on its local shapes fused between them (their kernels dumped with the others)
    (graph,) = compiled.stages
    assert graph.tensor is not None and graph.tensor.degree == 2 and graph.tensor.sharded_params
    targets = {str(n.target) for n in graph.module.graph.nodes}
    assert {"hetcc.all_reduce.default", "hetcc.tensor_enter.default"} <= targets
    groups = [n.meta[FUSION_META_KEY] for n in graph.module.graph.nodes if FUSION_META_KEY in n.meta]
    assert groups and all((tmp_path / "ir" / "kernels" / f"{g.name}.py").exists() for g in groups)
    assert not any("tensor-parallel stages" in n for n in plan.notes)
    # plan.json keeps the degree; the table shows it; the report replays the plan
    compiled.save_plan(tmp_path / "build")
    assert read_plan(tmp_path / "build") == plan == Plan.from_json(plan.to_json())
    assert json.loads(plan.to_json())["stages"][0]["tensor"] == 2
    header, row = plan.explain().splitlines()[1:3]
    assert row[header.index(" tp") : header.index(" tp") + 4].strip() == "2"
    assert load(tmp_path / "build").simulation.step_time_s == pytest.approx(plan.step_time_s)
    assert "<th>tp</th>" in (tmp_path / "build" / "report.html").read_text()
    assert (tmp_path / "ir" / "06_tensor_cost.txt").exists() and (tmp_path / "ir" / "10_shard.txt").exists()


def test_without_tensor_parallelism_nothing_changes(tmp_path):
    case = model_zoo.gpt2()
    compiled = hetcc.compile(case.model, _cluster(tmp_path, [2]), example_kwargs=case.inputs, microbatches=1)
    assert all(s.tensor == 1 for s in compiled.plan.stages) and "megatron" not in compiled.plan.baselines
    assert " tp" not in compiled.plan.explain().splitlines()[1]
    assert all(stage.tensor is None for stage in compiled.stages)
    assert compiled.problem.tensor_splits is None


@pytest.mark.parametrize("microbatches", [2, 4])
def test_auto_never_simulates_slower_than_no_tensor_parallelism(tmp_path, microbatches):
    case = model_zoo.llama()
    cluster = _cluster(tmp_path, [4, 4], inter_node="10 Gb/s")
    plans = {
        tp: hetcc.compile(
            case.model, cluster, example_kwargs=case.inputs, microbatches=microbatches, tensor_parallel=tp
        ).plan
        for tp in (False, "auto")
    }
    assert plans["auto"].step_time_s <= plans[False].step_time_s * (1 + 1e-9)
    assert plans["auto"].lower_bound_s <= plans["auto"].step_time_s * (1 + 1e-9)
    assert plans["auto"].baselines["uniform"] == plans[False].baselines["uniform"]


class _Untraceable(torch.nn.Module):
    def forward(self, x):
        raise AssertionError("traced: the argument should have been refused first")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (True, "tensor_parallel must be False, 'auto' or a tensor degree"),
        ("yes", "tensor_parallel must be False, 'auto' or a tensor degree"),
        (2.0, "tensor_parallel must be False, 'auto' or a tensor degree"),
        (0, "tensor_parallel=0: a tensor degree is the number of devices"),
        (8, r"tensor_parallel=8: no node holds 8 like devices \(the most: 2 Slow\)"),
    ],
)
def test_bad_values_are_refused_before_tracing(tmp_path, value, match):
    with pytest.raises(HetccError, match=match):
        hetcc.compile(_Untraceable(), _cluster(tmp_path, [2]), (torch.ones(2, 2),), tensor_parallel=value)


@pytest.mark.parametrize(("text", "value"), [("2", 2), ("auto", "auto"), ("off", False)])
def test_the_cli_takes_a_tensor_degree(text, value):
    args = ["compile", "m:f", "--cluster", "c.yaml", "--out", "o", "--tensor-parallel", text]
    assert build_parser().parse_args(args).tensor_parallel == value
    assert build_parser().parse_args(args[:-2]).tensor_parallel is False


# ------------------------------------------------------------------------------------- real shapes


@pytest.mark.slow
def test_gpt2_small_on_a100s_and_t4s_auto_is_no_slower_and_names_its_degrees():
    from examples.models import gpt2_small

    clusters = Path(__file__).resolve().parents[1] / "examples" / "clusters"
    model, batch = gpt2_small(batch=8, seq=512)
    plans = {
        tp: hetcc.compile(model, clusters / "mixed_a100_t4.yaml", example_kwargs=batch, microbatches=4,
                          tensor_parallel=tp).plan
        for tp in (False, "auto")
    }  # fmt: skip
    auto = plans["auto"]
    assert auto.step_time_s <= plans[False].step_time_s * (1 + 1e-9)
    assert math.isfinite(auto.baselines["megatron"])
    assert any(n.startswith("tensor parallel: degrees priced 2, 4") for n in auto.notes)
    for stage in auto.stages:
        assert (
            len(stage.devices) % stage.tensor == 0 and len(stage.shares) == len(stage.devices) // stage.tensor
        )


def test_the_microbatch_search_says_its_figures_are_without_tensor_parallelism(tmp_path):
    """The search prices counts at degree 1; the count kept is planned with tensor groups, and the note
    says which figure is which (a degree-2 stage here, faster than the search's figure)."""
    case = model_zoo.llama()
    cluster = _cluster(tmp_path, [4, 4], inter_node="10 Gb/s")
    plan = hetcc.compile(case.model, cluster, example_kwargs=case.inputs, tensor_parallel="auto").plan
    head = (
        f"microbatches: M={plan.microbatches} priced again from its own trace and planned with tensor "
        f"parallelism: {plan.step_time_s * 1e3:.2f} ms (the symbolic trace, without it, gave "
    )
    (note,) = [n for n in plan.notes if n.startswith(head)]
    assert (
        any(s.tensor > 1 for s in plan.stages)
        and float(note[len(head) :].split()[0]) > plan.step_time_s * 1e3
    )
    assert dict(plan.microbatch_search)[plan.microbatches] == plan.step_time_s  # the plan's own figure
