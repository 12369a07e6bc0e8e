"""Which schedule, and which tensor degrees: each solved, the fastest simulated plan kept.

``solve_one`` solves a problem (``solver.solve``), or with tensor parallelism on, searches its degree
assignments (``solver.tensor.solve_tensor``). ``schedule="auto"`` tries every schedule of
``AUTO_SCHEDULES`` (``solve_each_schedule``): one search, whose plans each schedule re-ranks and refines
under its own replay (the searches see these schedules alike: ``solver.solve.Searched``), then
interleaved 1F1B with its v and ZB-V (``solver.interleave``), on pure pipelines solved beside those
re-rankings; with ``tensor_parallel="auto"`` too, the degrees are searched once, under the first, and
the others planned on the degrees found and on degree 1, interleaved 1F1B and ZB-V (which take no
tensor parts) at degree 1 (not where a degree is pinned). Solves that do not depend
on each other run side by side, and beside the search (``solver.parallel.Solves``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hetcc.errors import InfeasiblePlanError
from hetcc.solver.bound import lower_bound
from hetcc.solver.interleave import (
    interleaved_bound,
    interleaving_pipelines,
    solve_interleaved,
    solve_zbv,
    zbv_bound,
)
from hetcc.solver.parallel import Solves, solve_each
from hetcc.solver.problem import PartitionProblem, PartitionSolution
from hetcc.solver.schedules import INTERLEAVED, MULTI_STAGE, ZBV
from hetcc.solver.solve import Searched, search_plans, solve
from hetcc.solver.tensor import DeviceMap, composite_problem, search_key, solve_tensor, tensor_bound

RERANK = 6  # best sequences replayed in the simulator; the fastest simulated wins

# What ``schedule="auto"`` searches once and re-ranks under each, with interleaved 1F1B and ZB-V after; the
# fastest simulated is kept (ties: the earlier). GPipe is left out: it has 1F1B's bubble and holds every
# microbatch.
AUTO_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")


def schedule_bound(problem: PartitionProblem, schedule: str, multi_stage: bool = True) -> float:
    """A step no plan ``solve_schedules(problem, schedule, multi_stage)`` may return simulates below: the
    schedule's lower bound, under "auto" the least over the schedules it tries."""
    if schedule == INTERLEAVED:  # planned on a 1F1B problem, its devices running several stages each
        return interleaved_bound(problem)
    if schedule == ZBV:
        return zbv_bound(problem)
    if schedule == "auto":
        names = (*AUTO_SCHEDULES, *(MULTI_STAGE if multi_stage else ()))
        return min(schedule_bound(problem, name) for name in names)
    return lower_bound(replace(problem, schedule=schedule))


def solve_schedules(
    problem: PartitionProblem, schedule: str, multi_stage: bool = True
) -> tuple[PartitionProblem, PartitionSolution, str]:
    """``problem`` solved under ``schedule``, or under ``"auto"`` once per schedule of ``AUTO_SCHEDULES``
    and, with ``multi_stage``, as interleaved 1F1B and ZB-V (a schedule no plan fits under is skipped);
    the problem and solution kept (``chunks`` > 1: several stages per device), and a note saying what
    each tried schedule simulated (empty unless ``"auto"``). ``multi_stage=False``: "auto" as a compile
    with a tensor degree pinned tries it (its stages' devices run one stage each)."""
    return solve_each_schedule(problem, schedule, multi_stage=multi_stage)[:3]


def solve_each_schedule(
    problem: PartitionProblem, schedule: str, tensor: bool | int | str = False, multi_stage: bool = True
) -> tuple[PartitionProblem, PartitionSolution, str, DeviceMap]:
    """``solve_schedules`` with each schedule solved by ``solve_one`` (``tensor``: its tensor degrees),
    and the device map of the solution kept. With ``tensor="auto"`` the degrees are searched once, under
    the first schedule (every assignment tried costs a ``solve``: a search per schedule would double the
    compile), and each other schedule is planned on the degrees it chose and on degree 1
    (``_on_searched_degrees``); with ``multi_stage``, interleaved 1F1B and ZB-V at degree 1 too (they take
    no tensor parts), so that "auto" never loses a plan ``tensor=False`` finds."""
    if schedule in MULTI_STAGE:  # planned on pure pipelines: a rank runs whole stages
        solved, solution, note = (solve_zbv if schedule == ZBV else solve_interleaved)(problem, RERANK)
        return solved, solution, note, _identity(solved)
    if schedule != "auto":
        solved, solution, device_map = solve_one(problem, tensor)
        return solved, solution, "", device_map
    tried, first_error = [], None
    if not (tensor and problem.tensor_splits):  # one search, then each schedule's re-ranking at once
        scheduled = [replace(problem, schedule=name) for name in AUTO_SCHEDULES]
        problem.validate()
        # the pure pipelines interleaved 1F1B and ZB-V are laid on, solved while the search runs
        pipelines = [pure for pure, _ in interleaving_pipelines(problem)] if multi_stage else []
        with Solves([*scheduled, *pipelines]) as solves:
            laid = [solves.submit(pure, RERANK) for pure in pipelines]
            searched = search_plans(scheduled[0], RERANK)  # InfeasiblePlanError: no schedule has a plan
            ranked = [solves.submit(each, RERANK, searched) for each in scheduled]
            for each, answer in zip(scheduled, (rerank() for rerank in ranked)):
                if isinstance(answer, InfeasiblePlanError):
                    first_error = first_error or answer
                else:
                    tried.append((each, answer, _identity(problem)))
            fastest_s = min((found[1].simulated_s for found in tried), default=math.inf)
            if multi_stage:
                tried += _multi_stage(problem, [answer() for answer in laid], fastest_s)
    elif tensor == "auto":
        searches: dict[tuple, Searched] = {}  # each composite's searches, made once for every schedule
        try:
            tried.append(solve_one(replace(problem, schedule=AUTO_SCHEDULES[0]), tensor, searches))
        except InfeasiblePlanError as error:
            first_error = error
        for answer in _on_searched_degrees(problem, tried[0], AUTO_SCHEDULES[1:], searches) if tried else ():
            if isinstance(answer, InfeasiblePlanError):
                first_error = first_error or answer
            else:
                tried.append(answer)
        if multi_stage:  # at degree 1 a device may run several stages, as with tensor parallelism off
            plain = replace(problem, tensor_splits=None)
            pipelines = solve_each([pure for pure, _ in interleaving_pipelines(plain)], RERANK)
            tried += _multi_stage(plain, pipelines, min((f[1].simulated_s for f in tried), default=math.inf))
    else:
        searches = {}
        for name in AUTO_SCHEDULES:
            try:
                tried.append(solve_one(replace(problem, schedule=name), tensor, searches))
            except InfeasiblePlanError as error:
                first_error = first_error or error
    if not tried:
        raise first_error
    solved, solution, device_map = min(tried, key=lambda found: found[1].simulated_s)
    figures = ", ".join(f"{_name(p, s)} {s.simulated_s * 1e3:.2f} ms" for p, s, _ in tried)
    shared = (
        f"; tensor degrees searched under {AUTO_SCHEDULES[0]}" if tensor == "auto" and len(tried) > 1 else ""
    )
    note = f"schedule: {_name(solved, solution)} kept by simulation ({figures}){shared}"
    return solved, solution, note, device_map


def _multi_stage(
    problem: PartitionProblem, pipelines: list[PartitionSolution | InfeasiblePlanError], fastest_s: float
) -> list[tuple[PartitionProblem, PartitionSolution, DeviceMap]]:
    """``solve_interleaved``'s and ``solve_zbv``'s plans of ``problem`` on ``pipelines``
    (``interleaving_pipelines``' answers; ZB-V's the first, every device alone) as "auto" tries them,
    each where it has one, refined where it starts near ``fastest_s`` (the fastest plan "auto" has)."""
    found = []
    for solver, answers in ((solve_interleaved, pipelines), (solve_zbv, pipelines[0])):
        try:
            solved, solution, _ = solver(problem, RERANK, answers, fastest_s)
        except InfeasiblePlanError:
            continue
        found.append((solved, solution, _identity(solved)))
    return found


def planned_schedule(problem: PartitionProblem, solution: PartitionSolution) -> str:
    """The schedule ``solution`` runs: interleaved 1F1B where it places several stages per device on a
    problem priced as 1F1B, else the problem's (ZB-V's own among them)."""
    return INTERLEAVED if solution.chunks > 1 and problem.schedule != ZBV else problem.schedule


def _name(problem: PartitionProblem, solution: PartitionSolution) -> str:
    """The schedule of a plan "auto" tried, interleaved 1F1B with its v."""
    name = planned_schedule(problem, solution)
    return f"{name} (v = {solution.chunks})" if name == INTERLEAVED else name


def _on_searched_degrees(
    problem: PartitionProblem, searched: tuple[PartitionProblem, PartitionSolution, DeviceMap], schedules,
    searches: dict[tuple, Searched],
) -> list[tuple[PartitionProblem, PartitionSolution, DeviceMap] | InfeasiblePlanError]:  # fmt: skip
    """Per schedule of ``schedules``, ``solve_one``'s answer on the degrees of ``searched`` (its composite
    problem) or on none (every class at degree 1, so "auto" stays no slower than
    ``tensor_parallel=False``), the faster simulated, its bound the tensor bound of ``problem`` under
    that schedule, valid for every assignment; InfeasiblePlanError where neither fits. Each composite is
    searched once, for every schedule (``solver.solve.Searched``; not again where ``searches``, the degree
    search's, holds it), and the re-rankings run at once."""
    degrees = [(searched[0], searched[2])]
    if any(len(members) > 1 for members in searched[2]):  # else the search kept degree 1 already
        degrees.append(composite_problem(problem, {}))
    jobs, errors = [], []
    for composite, device_map in degrees:
        composite = replace(composite, schedule=schedules[0])
        try:
            found = searches.get(search_key(composite, device_map)) or search_plans(composite, RERANK)
        except InfeasiblePlanError as error:
            errors.append(error)
            continue
        jobs += [(replace(composite, schedule=name), found, device_map) for name in schedules]
    answers = solve_each([job[0] for job in jobs], RERANK, [job[1] for job in jobs])
    results = []
    for name in schedules:
        plans = [(composite, answer, device_map) for (composite, _, device_map), answer in zip(jobs, answers)
                 if composite.schedule == name and not isinstance(answer, InfeasiblePlanError)]  # fmt: skip
        if not plans:  # neither composite fits under this schedule: the first error
            results.append([*errors, *(a for (c, _, _), a in zip(jobs, answers) if c.schedule == name)][0])
            continue
        composite, solution, device_map = min(plans, key=lambda found: found[1].simulated_s)
        bound = tensor_bound(replace(problem, schedule=name), within_s=solution.simulated_s)
        gap = solution.simulated_s / bound - 1 if bound > 0 else math.inf
        results.append((composite, replace(solution, lower_bound_s=bound, gap=gap), device_map))
    return results


def _identity(problem: PartitionProblem) -> DeviceMap:
    """The device map of a problem solved as it is: each device stands for itself."""
    return [(i,) for i in range(len(problem.devices))]


def solve_one(
    problem: PartitionProblem, tensor: bool | int | str = False, searches: dict[tuple, Searched] | None = None
) -> tuple[PartitionProblem, PartitionSolution, DeviceMap]:
    """``problem`` solved by ``solve``, or where ``tensor`` (a degree or "auto") is on and the problem has
    ``tensor_splits``, by ``solver.tensor.solve_tensor``: (the problem the solution's device indices name,
    for tensor parallelism the composite problem of the degrees chosen; the solution; per device of that
    problem, the devices of ``problem`` it stands for). ``searches``: ``solve_tensor``'s."""
    if not tensor or not problem.tensor_splits:
        return problem, solve(problem, rerank=RERANK), _identity(problem)
    solution, assignment, device_map = solve_tensor(problem, tensor, rerank=RERANK, searches=searches)
    return composite_problem(problem, assignment)[0], solution, device_map
