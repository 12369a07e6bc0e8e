"""``microbatches="auto"``: every divisor of the batch priced from one symbolic trace, planned unless
its lower bound shows it cannot win, the fastest simulated count kept; precision and the plan-space
options reach the plan and the problem."""

from __future__ import annotations

import json
import re

import pytest
import torch
from models import gpt2, token_ids

import hetcc
from hetcc import api
from hetcc.api import microbatches
from hetcc.errors import HetccError
from hetcc.passes.schedule_search import schedule_bound, solve_schedules

CLUSTER = "examples/clusters/mixed_a100_t4.yaml"
# The same cards on hosts where one fused call costs what the torch.library custom op cost (190 / 690 us):
# small groups stay ops, large ones fuse.
SLOW_CALLS = {"host_fused_op": "190 us", "host_fused_backward_op": "690 us"}
SLOW_CALL_CLUSTER = hetcc.Cluster.from_spec({
    "nodes": [
        {"name": "node0", "intra_link": {"kind": "nvlink", "bandwidth": "300 GB/s", "latency": "2 us"},
         "devices": [{"type": "A100-80GB", "count": 4, **SLOW_CALLS}]},
        {"name": "node1", "intra_link": {"kind": "pcie", "bandwidth": "32 GB/s", "latency": "5 us"},
         "devices": [{"type": "T4", "count": 4, "memory": "15 GiB", **SLOW_CALLS}]},
    ],
    "inter_node_link": {"kind": "ethernet", "bandwidth": "25 Gb/s", "latency": "20 us"},
})  # fmt: skip


@pytest.fixture(scope="module")
def searched():
    calls, priced = [], []
    real, plan_counts = api.analyze, microbatches._plan_counts

    def counting(*args, **kwargs):
        calls.append(kwargs.get("dynamic_shapes"))
        return real(*args, **kwargs)

    def keeping(problems, schedule, multi_stage=True):
        priced.extend(problems)
        return plan_counts(problems, schedule, multi_stage)

    api.analyze, microbatches._plan_counts = counting, keeping
    try:
        ids = token_ids(12, 16)
        compiled = hetcc.compile(
            gpt2(n_layer=2), CLUSTER, example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False}
        )
    finally:
        api.analyze, microbatches._plan_counts = real, plan_counts
    return compiled, calls, priced


def _skipped(plan) -> list[int]:
    """The counts the plan's note says were not planned (their bound above the fastest plan)."""
    notes = [n for n in plan.notes if n.startswith("microbatches: not planned")]
    return [int(m) for note in notes for m in re.findall(r"M=(\d+)", note)]


def test_every_divisor_is_priced_from_one_symbolic_trace(searched):
    compiled, calls, _ = searched
    tried = dict(compiled.plan.microbatch_search)
    assert sorted([*tried, *_skipped(compiled.plan)]) == [1, 2, 3, 4, 6, 12]
    assert len(calls) == 2 and calls[0] is not None and calls[1] is None  # one symbolic trace, one to compile
    assert compiled.plan.microbatches == min(tried, key=lambda m: (tried[m], m))
    assert compiled.plan.microbatch_rows == 12 // compiled.plan.microbatches
    assert (
        f"{compiled.plan.microbatches} microbatches, {compiled.plan.microbatch_rows} rows each"
        in compiled.explain()
    )


def test_a_count_is_left_unplanned_only_where_its_bound_shows_it_cannot_win(searched):
    """Each count's problem planned anyway: the counts skipped all plan slower than the count kept,
    and each count planned has the figure its own plan simulates."""
    compiled, _, priced = searched
    tried, skipped = dict(compiled.plan.microbatch_search), _skipped(compiled.plan)
    assert skipped, "the search skipped nothing: this test checks nothing"  # M=12 on this cluster
    best = min(tried.values())
    for problem in priced:
        step_s = solve_schedules(problem, "auto")[1].simulated_s  # the compile's default schedule
        if problem.microbatches in skipped:
            assert step_s > best and schedule_bound(problem, "auto") > best, problem.microbatches
        else:
            assert step_s == pytest.approx(tried[problem.microbatches], rel=1e-12)


def test_the_problem_describes_itself(searched):
    compiled, _, _ = searched
    data = json.loads(compiled.problem.to_json())
    assert data["optimizer"] == "adam" and data["precision"] == "fp32" and data["batch_size"] == 12
    assert (
        data["replicate"] is True
        and data["recompute"] is True
        and len(data["param_bytes"]) == len(data["blocks"])
    )


def test_a_model_without_a_symbolic_batch_keeps_a_fixed_count_and_says_why():
    class BranchesOnBatch(torch.nn.Module):  # Python control flow on the batch size: no symbolic batch
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            y = self.a(x)
            if x.shape[0] == 12:  # a guard export cannot keep symbolic
                y = y * 2
            return self.b(y).sum()

    compiled = hetcc.compile(BranchesOnBatch(), CLUSTER, example_inputs=(torch.randn(12, 8),))
    assert compiled.plan.microbatches == 6 and not compiled.plan.microbatch_search
    assert any(
        note.startswith("microbatches: kept 6 (no trace with a symbolic batch")
        for note in compiled.plan.notes
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "bf16"}, "unknown precision 'bf16'; did you mean"),
        ({"recompute": "yes"}, "recompute must be"),
        ({"replicate": 1}, "replicate must be"),
    ],
)
def test_bad_plan_space_arguments_are_named(kwargs, match):
    with pytest.raises(HetccError, match=match):
        hetcc.compile(torch.nn.Linear(2, 2), CLUSTER, example_inputs=(torch.randn(4, 2),), **kwargs)


class WideMLP(torch.nn.Module):
    """Two GPT-2 MLPs on long rows: gelu_new's eight pointwise ops pay as one kernel on a GPU, the
    small residual adds do not."""

    def __init__(self):
        super().__init__()
        from transformers.activations import NewGELUActivation

        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 1024), NewGELUActivation(), torch.nn.Linear(1024, 64))
            for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return (x * x).mean()


def _fused_nodes(compiled) -> int:
    return sum(1 for node in compiled.graph.graph.nodes if node.target == hetcc.kernels.fused)


@pytest.mark.slow  # five compiles of a small model
def test_auto_prices_each_count_with_the_fusion_its_compile_chooses():
    x = torch.randn(8, 1024, 64)
    with hetcc.config.patch(fuse="cost"):
        auto = hetcc.compile(WideMLP(), SLOW_CALL_CLUSTER, example_inputs=(x,))
        tried = dict(auto.plan.microbatch_search)
        pinned = {
            m: hetcc.compile(WideMLP(), SLOW_CALL_CLUSTER, example_inputs=(x,), microbatches=m)
            for m in (*tried, *_skipped(auto.plan))
        }
    assert sorted(pinned) == [1, 2, 4, 8]
    assert tried[auto.plan.microbatches] == pytest.approx(auto.plan.step_time_s, rel=1e-9)
    for m, compiled in pinned.items():  # each count's search figure is the plan its own compile makes
        if m in tried:
            assert tried[m] == pytest.approx(compiled.plan.step_time_s, rel=1e-9), m
    assert auto.plan.step_time_s <= min(c.plan.step_time_s for c in pinned.values()) * (1 + 1e-9)
    # fusion is part of what was priced: the gelu chains fuse at some counts and not at others
    fused = {m: _fused_nodes(c) for m, c in pinned.items()}
    assert 0 in fused.values() and max(fused.values()) > 0, fused  # and the choice follows the size


def test_a_count_whose_own_trace_prices_differently_is_priced_again_and_the_fastest_kept(monkeypatch):
    """Export specialises a one-row trace (and a model may differ at one size): where the plan of the
    count kept differs from its search figure, the plan's figure replaces it and the fastest is kept."""
    real = api.search_microbatches
    claimed = {}

    def optimistic(*args, **kwargs):  # the symbolic trace underprices M=1 tenfold
        best, tried, notes = real(*args, **kwargs)
        claimed.update(tried)
        tried = [(m, s / 10 if m == 1 else s) for m, s in tried]
        return 1, tried, notes

    monkeypatch.setattr(api, "search_microbatches", optimistic)
    ids = token_ids(4, 16)
    compiled = hetcc.compile(
        gpt2(n_layer=2), CLUSTER, example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False}
    )
    tried = dict(compiled.plan.microbatch_search)
    assert tried[1] == pytest.approx(claimed[1], rel=1e-9)  # M=1's own plan replaced the claim
    assert compiled.plan.microbatches == min(tried, key=lambda m: (tried[m], m))
    assert tried[compiled.plan.microbatches] == pytest.approx(compiled.plan.step_time_s, rel=1e-9)
    assert any(
        note.startswith("microbatches: M=1 priced again from its own trace") for note in compiled.plan.notes
    )
