"""Independent solves at once (``hetcc.solver.parallel``): forked workers give exactly the answers of
one-after-another solving, infeasible problems included, and the degree search keeps its plan."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from unittest import mock

import pytest
from test_tensor_plans import _two_h100_nodes

from hetcc import config
from hetcc.errors import InfeasiblePlanError
from hetcc.solver import parallel, tensor
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.tensor import solve_tensor

SAVED = Path(__file__).parent / "data" / "gpt2_medium_three_nodes.problem.json"


@pytest.fixture
def forced():
    """Two workers, whatever the size of the jobs."""
    with mock.patch.object(parallel, "PARALLEL_WORK", 0), config.patch(solver_workers=2):
        yield


def _jobs() -> list[PartitionProblem]:
    problem = PartitionProblem.from_json(SAVED.read_text())
    tiny = [dataclasses.replace(d, memory_bytes=1.0) for d in problem.devices]
    return [
        dataclasses.replace(problem, schedule="1f1b"),
        dataclasses.replace(problem, devices=tiny),  # nothing fits
        dataclasses.replace(problem, schedule="gpipe", microbatches=4),
    ]


def test_workers_answer_exactly_as_solving_one_after_another(forced):
    jobs = _jobs()
    assert parallel._workers(jobs) == 2
    together = parallel.solve_each(jobs)
    with config.patch(solver_workers=1):
        assert parallel._workers(jobs) == 1
        alone = parallel.solve_each(jobs)
    assert isinstance(together[1], InfeasiblePlanError) and str(together[1]) == str(alone[1])
    assert together[0] == alone[0] and together[2] == alone[2]
    assert together[0].simulated_s != together[2].simulated_s  # two different problems, two answers


def test_small_jobs_are_solved_in_this_process():
    jobs = _jobs()
    assert sum(len(p.blocks) * len(p.devices) * p.microbatches for p in jobs) < parallel.PARALLEL_WORK
    assert parallel._workers(jobs) == 1 and parallel._workers(jobs[:1]) == 1


@pytest.mark.parametrize("exhaustive", [tensor.EXHAUSTIVE_ASSIGNMENTS, 0])
def test_the_degree_search_keeps_its_plan_with_workers(forced, exhaustive):
    problem = _two_h100_nodes()
    with mock.patch.object(tensor, "EXHAUSTIVE_ASSIGNMENTS", exhaustive):
        together = solve_tensor(problem, rerank=2)
        with config.patch(solver_workers=1):
            alone = solve_tensor(problem, rerank=2)
    assert together == alone


_PARENT = os.getpid()
_SOLVE = parallel._solve_or_error


def _dying(job):
    if os.getpid() != _PARENT:  # a worker killed mid-job (out of memory, say)
        os._exit(1)
    return _SOLVE(job)


def test_jobs_of_a_worker_that_dies_are_solved_in_this_process(forced, monkeypatch):
    monkeypatch.setattr(parallel, "_solve_or_error", _dying)
    jobs = _jobs()
    answers = parallel.solve_each(jobs)
    assert answers[0] == _SOLVE((jobs[0], 0)) and isinstance(answers[1], InfeasiblePlanError)
