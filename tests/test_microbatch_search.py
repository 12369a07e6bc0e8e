"""``microbatches="auto"``: every divisor of the batch priced from one symbolic trace, the fastest
simulated count kept; precision and the plan-space options reach the plan and the problem."""

from __future__ import annotations

import json

import pytest
import torch
from models import gpt2, token_ids

import hetcc
from hetcc import api
from hetcc.errors import HetccError

CLUSTER = "examples/clusters/mixed_a100_t4.yaml"


@pytest.fixture(scope="module")
def searched():
    calls = []
    real = api.analyze

    def counting(*args, **kwargs):
        calls.append(kwargs.get("dynamic_shapes"))
        return real(*args, **kwargs)

    api.analyze = counting
    try:
        ids = token_ids(12, 16)
        compiled = hetcc.compile(
            gpt2(n_layer=2), CLUSTER, example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False}
        )
    finally:
        api.analyze = real
    return compiled, calls


def test_every_divisor_is_priced_from_one_symbolic_trace(searched):
    compiled, calls = searched
    tried = dict(compiled.plan.microbatch_search)
    assert sorted(tried) == [1, 2, 3, 4, 6, 12]
    assert len(calls) == 2 and calls[0] is not None and calls[1] is None  # one symbolic trace, one to compile
    assert compiled.plan.microbatches == min(tried, key=lambda m: (tried[m], m))
    assert compiled.plan.microbatch_rows == 12 // compiled.plan.microbatches
    assert (
        f"{compiled.plan.microbatches} microbatches, {compiled.plan.microbatch_rows} rows each"
        in compiled.explain()
    )


def test_the_problem_describes_itself(searched):
    compiled, _ = searched
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
