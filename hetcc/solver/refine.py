"""Refinement of re-ranked plans by the simulator (``solve(rerank=...)``): local moves from the
fastest simulated plans, and restarts a few random moves away, judged by ``simulate`` within a budget
of simulations."""

from __future__ import annotations

import math
import random

from hetcc.solver.objective import evaluate, stage_costs
from hetcc.solver.plan_checks import mixed_tensor_group
from hetcc.solver.problem import PartitionProblem, PartitionSolution
from hetcc.solver.schedules import least_warmups, recorded_warmup, warmup_forwards
from hetcc.solver.simulate import simulate, step_floor

REFINE_SIMULATIONS = 1000  # simulations (and memory-rejected moves) spent refining, at most
REFINE_ACTIONS = 60_000  # ... and about this many replayed microbatch-replica actions in all
REJECTED_COST = 0.1  # of the budget, for a plan that does not fit in memory (costed, not simulated)
REFINED_STARTS = 3  # the fastest simulated plans each refinement climbs from, while its budget lasts


def refine_by_simulation(
    problem: PartitionProblem, starts: list[tuple[PartitionSolution, float]], budget: int
) -> tuple[PartitionSolution, float]:
    """The fastest simulated plan found by local moves from ``starts`` ((plan, simulated step), fastest
    first), each climbed in turn while the budget lasts, then, with budget left, by climbs restarted
    two random moves away from the best (a fixed seed: the same plans every time).

    A climb takes the first move of ``_moves`` that improves the simulated step until none does
    (memory must still fit; where no move improves, a stage that overflows may recompute, if
    allowed): move one cut by one or two blocks; with replicas allowed, merge two neighbouring stages
    into one group, move one device to the neighbouring stage's group, or add an idle device to a
    group (moves that make a group of mixed types, uneven shares by speed, which the search's
    interchangeable groups never propose; never of tensor groups of different degrees); swap two
    devices of different classes between stages, put an idle device of another class in a device's
    place, leave a device out, or give an idle device half a stage, or split a group in two stages;
    switch one stage's recomputation; give one stage one more or one fewer forward before its first
    backward, or 1F1B's, ZB-H2's or the most it may take (a move that changes the stages or their
    replica counts takes the schedule's warm-up, fewer where memory is short). The objective is a
    formula; where it and the simulator disagree (a replicated stage overlaps more than the formula
    credits, an order or cut it ranks lower simulates faster, a warm-up it does not model), the
    simulator decides."""
    first = starts[0][0]
    climber = _Climber(problem, budget)
    best, best_s = None, math.inf
    for plan, simulated_s in starts:
        if climber.budget <= 0:
            break
        current, simulated_s = climber.climb(_key(plan), simulated_s)
        if simulated_s < best_s:
            best, best_s = current, simulated_s
    kicks = random.Random(0)
    while climber.budget > 0 and best is not None:
        kicked = best
        for _ in range(2):
            options = list(_moves(problem, *kicked))
            kicked = kicks.choice(options) if options else kicked
        climber.budget -= 1  # a kick costs one, even to a plan already simulated
        kicked, simulated_s = climber.simulated(kicked)
        if simulated_s < math.inf:
            current, simulated_s = climber.climb(kicked, simulated_s)
            if simulated_s < best_s:
                best, best_s = current, simulated_s
    if best is None:
        return starts[0]
    if best == _key(first):
        return first, best_s
    bounds, groups, recompute, warmup = best
    return evaluate(problem, bounds, groups, recompute, first.lower_bound_s, warmup=warmup), best_s


def _key(plan: PartitionSolution):
    return plan.boundaries, plan.groups, plan.recompute, plan.warmup


class _Climber:
    """First-improvement hill climbing over ``_moves`` with a budget of simulations (a plan memory
    rejects costs ``REJECTED_COST`` of one); each plan is simulated once."""

    def __init__(self, problem: PartitionProblem, budget: int):
        self.problem, self.budget = problem, budget
        self._simulated: dict[tuple, tuple] = {}
        self._memo: dict = {}  # ``stage_costs``'s, shared by every plan the climbs cost

    def climb(self, current, simulated_s: float):
        """(the plan the climb from ``current`` ends on, its simulated step). Where no move improves
        it, the moves that overflow memory are tried again with the overflowing stages recomputing
        (where recomputation is allowed)."""
        repairs = (False, True) if self.problem.recompute and self.problem.training else (False,)
        improved = True
        while improved and self.budget > 0:
            improved = False
            for repair in repairs:
                for moved in _moves(self.problem, *current):
                    if self.budget <= 0:
                        break
                    moved, time_s = self.simulated(moved, repair, beat_s=simulated_s)
                    if time_s < simulated_s * (1 - 1e-12):
                        simulated_s, current, improved = time_s, moved, True
                        break
                if improved:
                    break
        return current, simulated_s

    def simulated(self, plan, repair: bool = False, beat_s: float = math.inf):
        """(plan, its simulated step; inf where memory overflows); with ``repair``, an overflowing stage
        recomputes instead. A plan whose ``step_floor`` is not below ``beat_s`` is not simulated: its
        floor stands for its step, which cannot beat ``beat_s`` either, until a caller asks with a higher
        ``beat_s`` (a climb from a slower start) or none (a kick). Each plan costs the budget once,
        simulated or not, so skipping changes no plan the refinement returns, only its time."""
        key = (tuple(plan[0]), tuple(map(tuple, plan[1])), tuple(plan[2]), _tuple(plan[3]), repair)
        known = self._simulated.get(key)
        if known is None:
            known = self._simulated[key] = self._simulate(plan, repair, beat_s)
        elif known[2] is not None and known[1] < beat_s * (1 - 1e-12):  # floored; may beat this caller
            known = self._simulated[key] = (known[0], self._replay(known[0], known[2]), None)
        return known[:2]

    def _simulate(self, plan, repair: bool, beat_s: float):
        """(the plan with the warm-ups its stages took; its simulated step, its floor, or inf; its stages
        where the floor stood for the step, else None)."""
        bounds, groups, recompute, warmup = plan
        stages = stage_costs(self.problem, bounds, groups, recompute, warmup=warmup, memo=self._memo)
        if repair and not all(stage.fits for stage in stages):
            recompute = [r or not stage.fits for r, stage in zip(recompute, stages)]
            stages = stage_costs(self.problem, bounds, groups, recompute, warmup=warmup, memo=self._memo)
        plan = (bounds, groups, recompute, recorded_warmup(stages))
        if not all(stage.fits for stage in stages):
            self.budget -= REJECTED_COST
            return plan, math.inf, None
        self.budget -= 1
        floor_s = step_floor(self.problem, stages)
        if floor_s >= beat_s * (1 - 1e-12):
            return plan, floor_s, stages
        return plan, self._replay(plan, stages), None

    def _replay(self, plan, stages) -> float:
        bounds, groups, recompute, _ = plan
        return simulate(self.problem, bounds, groups, recompute, events=False, stages=stages).step_time_s


def _tuple(values) -> tuple | None:
    return None if values is None else tuple(values)


def _moves(problem: PartitionProblem, bounds, groups, recompute, warmup):
    """Plans one move from ``(bounds, groups, recompute, warmup)``: the moves of ``_layouts`` (no more
    stages than ``problem.max_stages``), each with the schedule's warm-up (None) where it changes the
    stages' replica counts, else with ``warmup``; then warm-up moves. A group's replicas are tensor
    groups of one degree (``plan_checks.mixed_tensor_group``)."""
    counts, cap = [len(g) for g in groups], problem.stage_limit()
    for moved_bounds, moved_groups, moved_recompute in _layouts(problem, bounds, groups, recompute):
        if len(moved_groups) > cap or mixed_tensor_group(problem, moved_groups):
            continue
        same = len(moved_groups) == len(counts) and all(len(g) == c for g, c in zip(moved_groups, counts))
        yield moved_bounds, moved_groups, moved_recompute, warmup if same else None
    if not problem.training or problem.schedule == "gpipe":  # no backward, or every forward first
        return
    if warmup is None:  # a plan not simulated yet (a kick's first move): the schedule's own
        warmup = warmup_forwards(problem.schedule, counts, problem.microbatches)
    least = least_warmups(problem.schedule, counts, problem.microbatches)
    for j, w in enumerate(warmup):  # from 1F1B's to M, none above the stage before's (``stage_warmups``)
        low = max(least[j], warmup[j + 1] if j + 1 < len(warmup) else 0)
        high = warmup[j - 1] if j else problem.microbatches
        options = (w + 1, w - 1, least[j], 2 * least[j] - 1, high)
        for option in dict.fromkeys(o for o in options if o != w and low <= o <= high):
            yield bounds, groups, recompute, [*warmup[:j], option, *warmup[j + 1 :]]


def _layouts(problem: PartitionProblem, bounds, groups, recompute):
    """Plans one move from ``(bounds, groups, recompute)``: cuts first, then regrouping, then which
    devices run which stage, then recomputation."""
    for j in range(1, len(bounds) - 1):
        for step in (-2, -1, 1, 2):
            moved = list(bounds)
            moved[j] += step
            if moved[j - 1] < moved[j] < moved[j + 1]:
                yield moved, groups, recompute
    groups = [tuple(g) for g in groups]
    if problem.replicate:
        yield from _regroupings(problem, bounds, groups, recompute)
    yield from _exchanges(problem, bounds, groups, recompute)
    if problem.recompute and not problem.recompute_all and problem.training:  # recompute=True pins them all
        for j in range(len(groups)):
            yield bounds, groups, [r != (i == j) for i, r in enumerate(recompute)]


def _exchanges(problem: PartitionProblem, bounds, groups, recompute):
    """Moves that change which devices run a stage: two devices of different classes (type and memory)
    in different stages swap; an idle device of another class takes a device's place; in a group of
    mixed classes, another class's device goes first (microbatches are routed in group order); a
    device leaves (a replica its group, or a stage's only device, its blocks joining the next or
    previous stage); an idle device takes the first or second half of a stage as a stage of its own.
    Devices of one class are interchangeable, so each move is made with the first device of its
    class."""

    def kind(d: int) -> tuple[str, float]:
        return problem.devices[d].type, problem.devices[d].memory_bytes

    used = {d for g in groups for d in g}
    idle: dict[tuple[str, float], int] = {}
    for d in range(len(problem.devices)):
        if d not in used:
            idle.setdefault(kind(d), d)
    places = [
        (j, i, d) for j, g in enumerate(groups) for i, d in enumerate(g) if kind(d) not in map(kind, g[:i])
    ]
    for j, i, d in places:
        for other, e in idle.items():
            if other != kind(d):
                yield bounds, _with(groups, (j, i, e)), recompute
        for j2, i2, e in places:
            if j2 > j and kind(e) != kind(d):
                yield bounds, _with(_with(groups, (j, i, e)), (j2, i2, d)), recompute
    for j, i, _ in places:  # in a group of mixed classes, another class goes first (routing follows order)
        if i > 0:
            g = groups[j]
            yield bounds, _replaced(groups, j, (g[i], *g[:i], *g[i + 1 :])), recompute
    for j, i, _ in places:  # a device leaves: one of a group's replicas, or a stage to its neighbours
        if len(groups[j]) > 1:
            yield bounds, _replaced(groups, j, (*groups[j][:i], *groups[j][i + 1 :])), recompute
            continue
        rest, flags = [*groups[:j], *groups[j + 1 :]], [*recompute[:j], *recompute[j + 1 :]]
        if j + 1 < len(groups):
            yield [*bounds[: j + 1], *bounds[j + 2 :]], rest, flags
        if j > 0:
            yield [*bounds[:j], *bounds[j + 1 :]], rest, flags
    for j in range(len(groups)):
        halved = _halved(bounds, recompute, j)
        for e in idle.values() if halved else ():
            for at in (j, j + 1):  # the new stage runs the first half, or the second
                yield halved[0], [*groups[:at], (e,), *groups[at:]], halved[1]


def _replaced(groups: list[tuple[int, ...]], j: int, group: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``groups`` with group ``j`` replaced by ``group``."""
    return [group if k == j else g for k, g in enumerate(groups)]


def _with(groups: list[tuple[int, ...]], change: tuple[int, int, int]) -> list[tuple[int, ...]]:
    """``groups`` with device ``change[1]`` of group ``change[0]`` replaced by device ``change[2]``."""
    j, i, d = change
    return _replaced(groups, j, (*groups[j][:i], d, *groups[j][i + 1 :]))


def _halved(bounds, recompute, j: int):
    """(cuts, recompute flags) with stage ``j`` cut at its middle into two stages that recompute as it
    did; None where it has a single block."""
    a, b = bounds[j], bounds[j + 1]
    if b - a < 2:
        return None
    return [*bounds[: j + 1], (a + b) // 2, *bounds[j + 1 :]], [
        *recompute[: j + 1],
        recompute[j],
        *recompute[j + 1 :],
    ]


def _regroupings(problem: PartitionProblem, bounds, groups, recompute):
    """With replicas allowed: an idle device joins a group, two neighbouring stages merge into one
    group, a device at a group's edge moves to the neighbouring stage's group, or a group splits in two
    (its first or last device takes the first or second half of the stage)."""
    used = {d for g in groups for d in g}
    for d in (d for d in range(len(problem.devices)) if d not in used):  # an idle device joins a group
        for j in range(len(groups)):
            yield bounds, groups[:j] + [(*groups[j], d)] + groups[j + 1 :], recompute
    for j in range(len(groups) - 1):
        merged = groups[:j] + [groups[j] + groups[j + 1]] + groups[j + 2 :]
        flags = list(recompute[:j]) + [recompute[j] or recompute[j + 1]] + list(recompute[j + 2 :])
        yield list(bounds[: j + 1]) + list(bounds[j + 2 :]), merged, flags
        if len(groups[j]) > 1:  # its last device joins the next stage
            yield (
                bounds,
                groups[:j] + [groups[j][:-1], (groups[j][-1], *groups[j + 1])] + groups[j + 2 :],
                recompute,
            )
        if len(groups[j + 1]) > 1:  # the next stage's first device joins this one
            yield (
                bounds,
                groups[:j] + [(*groups[j], groups[j + 1][0]), groups[j + 1][1:]] + groups[j + 2 :],
                recompute,
            )
    for j, group in enumerate(groups):  # a group splits in two: the inverse of a merge
        halved = _halved(bounds, recompute, j)
        if len(group) < 2 or halved is None:
            continue
        for i in dict.fromkeys((0, len(group) - 1)):
            alone, rest = (group[i],), (*group[:i], *group[i + 1 :])
            for halves in ((alone, rest), (rest, alone)):
                yield halved[0], [*groups[:j], *halves, *groups[j + 1 :]], halved[1]
