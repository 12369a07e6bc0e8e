"""Independent solves at once (``hetcc.solver.parallel``): forked workers give exactly the answers of
one-after-another solving, infeasible problems included, and the degree search keeps its plan; one
search serves every 1F1B-family schedule (``solve.search_plans``), each solved as alone."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from test_plan_space import problems
from test_tensor_plans import _two_h100_nodes

from hetcc import config
from hetcc.api import microbatches
from hetcc.errors import InfeasiblePlanError
from hetcc.passes import schedule_search
from hetcc.passes.schedule_search import AUTO_SCHEDULES
from hetcc.solver import parallel, tensor
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.solve import search_plans, solve, solve_searched
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


def test_jobs_started_before_the_callers_own_search_answer_as_solved_alone(forced):
    """``Solves`` starts a job as it is submitted, so the caller searches meanwhile ("auto" solves the
    pipelines interleaving is laid on while it searches); each answer is the job's own ``solve``."""
    jobs = _jobs()
    with parallel.Solves(jobs) as solves:
        early = [solves.submit(job) for job in jobs[:2]]
        searched = search_plans(jobs[2], rerank=1)  # the caller's own work, while the workers solve
        late = solves.submit(jobs[2], 1, searched)
        answers = [answer() for answer in (*early, late)]
    assert answers[0] == solve(jobs[0]) and isinstance(answers[1], InfeasiblePlanError)
    assert answers[2] == solve(jobs[2], rerank=1)


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


def _two_kinds() -> PartitionProblem:
    """``_two_h100_nodes`` with the second node's cards of another type as fast: two device classes, each
    at degree 1, 2 or 4 (three candidates a step of the descent: two workers leave one idle)."""
    problem = _two_h100_nodes()
    devices = [replace(d, type="h100b") if d.node == "node1" else d for d in problem.devices]

    def twice(table: dict) -> dict:
        return {**table, "h100b": table["h100"]}

    rows = [replace(row, fwd_s=twice(row.fwd_s), bwd_s=twice(row.bwd_s)) for row in problem.tensor_splits]
    return replace(
        problem, devices=devices, fwd_s=twice(problem.fwd_s), bwd_s=twice(problem.bwd_s), tensor_splits=rows
    )


def test_the_descent_guesses_on_idle_workers_and_keeps_its_plan(forced, monkeypatch):
    """Where a class's candidates leave a worker idle, the next class's are begun there on a guess; the
    descent still asks for, and decides on, what it asks for solved one after another."""
    problem, guesses = _two_kinds(), []
    start = tensor._Assignments.start

    def noted(self, assignments, most=None):
        fresh = start(self, assignments, most)
        guesses.extend(fresh if most else [])
        return fresh

    monkeypatch.setattr(tensor._Assignments, "start", noted)
    with mock.patch.object(tensor, "EXHAUSTIVE_ASSIGNMENTS", 0):
        together = solve_tensor(problem, rerank=2)
        assert guesses
        with config.patch(solver_workers=1):
            alone = solve_tensor(problem, rerank=2)
    assert together == alone


_PARENT = os.getpid()
_SOLVE = parallel._solve_or_error


def _at(problem: PartitionProblem, m: int) -> PartitionProblem:
    """``problem`` at ``m`` microbatches of its batch: each one's seconds and activations scaled to its rows."""
    k = problem.microbatches / m
    scaled = {
        name: {t: [x * k for x in v] for t, v in getattr(problem, name).items()}
        for name in ("fwd_s", "bwd_s")
    }
    return replace(problem, microbatches=m, act_bytes=[x * k for x in problem.act_bytes],
                   cut_bytes=[x * k for x in problem.cut_bytes], **scaled)  # fmt: skip


def test_microbatch_counts_planned_side_by_side_keep_what_one_after_another_finds(monkeypatch):
    problem = PartitionProblem.from_json((SAVED.parent / "formula_misranks.problem.json").read_text())
    counts = [_at(problem, m) for m in (5, 10, 20)]
    alone = microbatches._plan_counts(counts, "1f1b")
    waves = []
    spy = lambda function, jobs: waves.append(len(jobs)) or parallel.map_forked(function, jobs)  # noqa: E731
    monkeypatch.setattr(microbatches, "map_forked", spy)
    monkeypatch.setattr(microbatches, "PARALLEL_COUNT_S", 0.0)  # the first count "took long"
    with config.patch(solver_workers=2):
        together = microbatches._plan_counts(counts, "1f1b")
    assert waves == [2]  # the first count alone, then the other two at once
    assert together == alone and [m for m, _ in alone[0]] == [5, 10, 20]


def _dying(job):
    if os.getpid() != _PARENT:  # a worker killed mid-job (out of memory, say)
        os._exit(1)
    return _SOLVE(job)


def test_jobs_of_a_worker_that_dies_are_solved_in_this_process(forced, monkeypatch):
    monkeypatch.setattr(parallel, "_solve_or_error", _dying)
    jobs = _jobs()
    answers = parallel.solve_each(jobs)
    assert answers[0] == _SOLVE((jobs[0], 0, None))[0] and isinstance(answers[1], InfeasiblePlanError)


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_blocks=7))
def test_one_search_serves_every_one_f_one_b_family_schedule(problem):
    """The searches see 1f1b, zb-h1 and zb-h2 alike, so ``schedule="auto"`` searches once: each
    schedule's plan from the shared search is the plan its own ``solve`` gives."""
    problem = replace(problem, wgrad_s={t: [b / 2 for b in v] for t, v in problem.bwd_s.items()})
    scheduled = [replace(problem, schedule=name) for name in AUTO_SCHEDULES]
    try:
        searched = search_plans(scheduled[0], rerank=2)
    except InfeasiblePlanError:
        for p in scheduled:
            with pytest.raises(InfeasiblePlanError):
                solve(p, rerank=2)
        return
    assert all(search_plans(p, rerank=2) == searched for p in scheduled[1:])
    alone = [solve(p, rerank=2) for p in scheduled]
    with mock.patch.object(schedule_search, "RERANK", 2):
        solved, kept, note = schedule_search.solve_schedules(problem, "auto")
    assert kept == min(alone, key=lambda plan: plan.simulated_s) and solved.schedule in note
    assert all(f"{p.schedule} {plan.simulated_s * 1e3:.2f} ms" in note for p, plan in zip(scheduled, alone))
    with pytest.raises(ValueError, match="GPipe"):
        solve_searched(replace(problem, schedule="gpipe"), searched, rerank=2)


def test_workers_answer_a_shared_search_as_solving_alone(forced):
    problem = replace(_two_h100_nodes(), tensor_splits=None)
    problem = replace(problem, wgrad_s={t: [b / 2 for b in v] for t, v in problem.bwd_s.items()})
    scheduled = [replace(problem, schedule=name) for name in AUTO_SCHEDULES]
    searched = search_plans(scheduled[0], rerank=1)
    together = parallel.solve_each(scheduled, 1, [searched] * len(scheduled))
    assert together == [solve(p, rerank=1) for p in scheduled]
    assert len({plan.simulated_s for plan in together}) > 1  # the schedules replay differently


def test_the_schedules_on_the_searched_degrees_share_each_composites_search():
    """With ``tensor_parallel="auto"``, zb-h1 and zb-h2 are planned on the degrees searched under 1f1b and
    on none: the degree search's own searches of both composites serve both, and each plan is its
    composite's own ``solve``."""
    problem = _two_h100_nodes()
    half = {t: [b / 2 for b in v] for t, v in problem.bwd_s.items()}
    problem = replace(problem, wgrad_s=half, tensor_splits=[
        replace(row, wgrad_s={t: [b / 2 for b in v] for t, v in row.bwd_s.items()}) for row in problem.tensor_splits
    ])  # fmt: skip
    with mock.patch.object(schedule_search, "RERANK", 1):
        searches = {}
        first = schedule_search.solve_one(replace(problem, schedule="1f1b"), "auto", searches)
        answers = schedule_search._on_searched_degrees(problem, first, ("zb-h1", "zb-h2"), searches)
    composites = [first[0], tensor.composite_problem(problem, {})[0]]
    maps = [first[2], tensor.composite_problem(problem, {})[1]]
    assert len(first[2]) < len(problem.devices)  # a tensor group: two composites
    assert all(tensor.search_key(c, m) in searches for c, m in zip(composites, maps))
    for name, (composite, plan, _) in zip(("zb-h1", "zb-h2"), answers):
        alone = [solve(replace(c, schedule=name), rerank=1) for c in composites]
        fastest = min(alone, key=lambda found: found.simulated_s)
        assert composite.schedule == name and plan.simulated_s == fastest.simulated_s
        assert plan.boundaries == fastest.boundaries and plan.groups == fastest.groups
    assert answers[0][1].simulated_s < first[1].simulated_s  # the split backward pays here
