"""``solve``: the plan of least step time, or an error naming the tightest memory shortfall.

The search is exact per sequence of replica groups (``solver.search``; a heuristic beyond
``config.exact_order_limit`` sequences) for the objective (``solver.objective``). With ``rerank`` the
best few sequences' plans (and, with replicas allowed, the best pure pipelines') are replayed in the
simulator (``solver.simulate``), which is the judge: each search's fastest simulated plan is refined
by local moves while its simulated step improves, and the faster of those wins. Every plan reports
its simulated step and its gap to ``solver.bound.lower_bound``, a bound on the simulated step.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np

from hetcc.errors import InfeasiblePlanError, format_bytes
from hetcc.solver.baselines import min_max_split
from hetcc.solver.bound import lower_bound
from hetcc.solver.objective import evaluate, stage_costs
from hetcc.solver.problem import PartitionProblem, PartitionSolution, inflight_microbatches
from hetcc.solver.search import search
from hetcc.solver.sharding import sharded_whole_chain
from hetcc.solver.simulate import simulate


def solve(problem: PartitionProblem, rerank: int = 0) -> PartitionSolution:
    """The plan of least objective (exact per sequence; see ``solver.search``), or with ``rerank`` > 0
    the fastest simulated plan among the best ``rerank`` sequences the search found (with replicas
    allowed, and the best ``rerank`` pure pipelines; where the search is heuristic, the single-best
    search's plan too), each search's fastest refined by simulation (``_refine_by_simulation``).
    ``simulated_s`` is filled in either way; ``gap`` is simulated step / lower bound - 1."""
    problem.validate()
    found = search(problem, keep=max(1, rerank))
    if found is None:
        raise _infeasible_error(problem)
    candidates = list(found.candidates)
    if rerank > 1 and not found.exact:
        # Keeping runners-up, the heuristic search searches less far (``search.RERANKED_EVALUATIONS``):
        # the sequence the single-best search finds joins the re-ranking, so re-ranking never loses it.
        single = search(problem, keep=1)
        candidates += single.candidates if single is not None else []
    searches = [(problem, candidates)]
    if rerank and problem.replicate:
        # Pure pipelines are plans too: the search with replicas is heuristic on large clusters, and its
        # formula and the simulator can disagree, so the best pure pipelines join the re-ranking.
        pure_problem = replace(problem, replicate=False)
        pure = search(pure_problem, keep=rerank)
        searches.append((pure_problem, pure.candidates if pure is not None else []))
    bound_s = lower_bound(problem)
    seen, best = set(), None
    for space, candidates in searches:
        scored = []
        for boundaries, groups, recompute, shard in candidates:
            key = (tuple(boundaries), tuple(map(tuple, groups)), tuple(recompute), tuple(shard))
            if key in seen:  # a pure pipeline may be found by both searches
                continue
            seen.add(key)
            plan = evaluate(problem, boundaries, groups, recompute, bound_s, shard=shard)
            simulated = simulate(
                problem, boundaries, groups, recompute, events=False, shard=shard
            ).step_time_s
            scored.append((simulated if rerank else 0.0, plan.step_time_s, plan, simulated))
        if not scored:
            continue
        scored.sort(key=lambda item: item[:2])
        winner = scored[0]
        if rerank:
            # Each search's fastest simulated plans are refined in its own plan space: moving cuts can be
            # worth several percent, so a runner-up before refinement can win after it, and the plan is
            # never slower than the pure pipeline replicate=False gives; a pure one is then regrouped too.
            starts = [(plan, simulated) for _, _, plan, simulated in scored[:REFINED_STARTS]]
            for moves in (space, problem) if space is not problem else (problem,):
                lanes = sum(len(stage.group) for stage in starts[0][0].stages)
                budget = max(8, min(REFINE_SIMULATIONS, REFINE_ACTIONS // (lanes * problem.microbatches)))
                starts = [_refine_by_simulation(moves, starts, budget=budget)]
            plan, simulated = starts[0]
            winner = (simulated, plan.step_time_s, plan, simulated)
        best = winner if best is None or winner[:2] < best[:2] else best
    _, _, plan, simulated = best
    gap = simulated / plan.lower_bound_s - 1 if plan.lower_bound_s > 0 else math.inf
    return replace(plan, exact=found.exact, orders_searched=found.solved, simulated_s=simulated, gap=gap)


REFINE_SIMULATIONS = 1000  # simulations (and memory-rejected moves) spent refining, at most
REFINE_ACTIONS = 60_000  # ... and about this many replayed microbatch-replica actions in all
REJECTED_COST = 0.1  # of the budget, for a plan that does not fit in memory (costed, not simulated)
REFINED_STARTS = 3  # the fastest simulated plans each refinement climbs from, while its budget lasts


def _refine_by_simulation(
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
    interchangeable groups never propose); swap two devices of different classes between stages, put
    an idle device of another class in a device's place, leave a device out, or give an idle device
    half a stage; switch one stage's recomputation. The objective is a formula; where it and the
    simulator disagree (a replicated stage overlaps more than the formula credits, an order or cut it
    ranks lower simulates faster), the simulator decides."""
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
    while climber.budget > 0:
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
    return (first if best == _key(first) else evaluate(problem, *best, first.lower_bound_s)), best_s


def _key(plan: PartitionSolution):
    return plan.boundaries, plan.groups, plan.recompute


class _Climber:
    """First-improvement hill climbing over ``_moves`` with a budget of simulations (a plan memory
    rejects costs ``REJECTED_COST`` of one); each plan is simulated once."""

    def __init__(self, problem: PartitionProblem, budget: int):
        self.problem, self.budget = problem, budget
        self._simulated: dict[tuple, tuple] = {}

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
                    moved, time_s = self.simulated(moved, repair)
                    if time_s < simulated_s * (1 - 1e-12):
                        simulated_s, current, improved = time_s, moved, True
                        break
                if improved:
                    break
        return current, simulated_s

    def simulated(self, plan, repair: bool = False):
        """(plan, its simulated step; inf where memory overflows); with ``repair``, an overflowing stage
        recomputes instead."""
        key = (tuple(plan[0]), tuple(map(tuple, plan[1])), tuple(plan[2]), repair)
        if key not in self._simulated:
            self._simulated[key] = self._simulate(plan, repair)
        return self._simulated[key]

    def _simulate(self, plan, repair: bool):
        stages = stage_costs(self.problem, *plan)
        if repair and not all(stage.fits for stage in stages):
            plan = (plan[0], plan[1], [r or not stage.fits for r, stage in zip(plan[2], stages)])
            stages = stage_costs(self.problem, *plan)
        if not all(stage.fits for stage in stages):
            self.budget -= REJECTED_COST
            return plan, math.inf
        self.budget -= 1
        return plan, simulate(self.problem, *plan, events=False, stages=stages).step_time_s


def _moves(problem: PartitionProblem, bounds, groups, recompute):
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
    if problem.recompute and problem.training:
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
            yield (
                bounds,
                [(g[i], *g[:i], *g[i + 1 :]) if k == j else g for k, g in enumerate(groups)],
                recompute,
            )
    for j, i, _ in places:  # a device leaves: one of a group's replicas, or a stage to its neighbours
        if len(groups[j]) > 1:
            yield bounds, [(*g[:i], *g[i + 1 :]) if k == j else g for k, g in enumerate(groups)], recompute
            continue
        rest, flags = [*groups[:j], *groups[j + 1 :]], [*recompute[:j], *recompute[j + 1 :]]
        if j + 1 < len(groups):
            yield [*bounds[: j + 1], *bounds[j + 2 :]], rest, flags
        if j > 0:
            yield [*bounds[:j], *bounds[j + 1 :]], rest, flags
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b - a < 2:
            continue
        middle = (a + b) // 2
        for e in idle.values():
            for at in (j, j + 1):  # the new stage runs the first half, or the second
                yield (
                    [*bounds[: j + 1], middle, *bounds[j + 1 :]],
                    [*groups[:at], (e,), *groups[at:]],
                    [*recompute[: j + 1], recompute[j], *recompute[j + 1 :]],
                )


def _with(groups: list[tuple[int, ...]], change: tuple[int, int, int]) -> list[tuple[int, ...]]:
    """``groups`` with device ``change[1]`` of group ``change[0]`` replaced by device ``change[2]``."""
    j, i, d = change
    return [(*g[:i], d, *g[i + 1 :]) if k == j else g for k, g in enumerate(groups)]


def _regroupings(problem: PartitionProblem, bounds, groups, recompute):
    """With replicas allowed: an idle device joins a group, two neighbouring stages merge into one
    group, or a device at a group's edge moves to the neighbouring stage's group."""
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


def _infeasible_error(problem: PartitionProblem) -> InfeasiblePlanError:
    shortfall = tightest_shortfall(problem)
    hints = ["more or larger devices"]
    if problem.training and not problem.recompute:
        hints.insert(0, "recompute=True (keeps each stage's inputs, rebuilds activations in backward)")
    sharding = problem.shard or problem.shard_all
    optimizer = any(any(problem.optimizer_for(d.type)) for d in problem.devices)
    if problem.training and problem.replicate and optimizer and not sharding:
        hints.insert(0, "shard=True (replicas split their optimizer state, ZeRO-1)")
    if problem.training and problem.schedule == "gpipe":
        hints.insert(0, "schedule='1f1b' (holds fewer microbatches' activations)")
    elif problem.training:
        hints.insert(0, "more, smaller microbatches (1F1B holds at most K of them)")
    return InfeasiblePlanError(
        f"no partition of {len(problem.blocks)} blocks over {len(problem.devices)} device(s) fits in memory: "
        f"{shortfall}",
        hint="try " + ", ".join(hints),
    )


def tightest_shortfall(problem: PartitionProblem) -> str:
    """Describe the smallest memory overflow found: which blocks, which device, how many bytes short.

    Devices are taken largest first (1F1B's early stages hold the most microbatches) and, for each
    number of stages, a DP finds the cut that minimises the largest overflow; the worst stage of the
    best such cut is reported. Where replicas may shard their optimizer state, the whole chain on one
    sharding replica group (``sharding.sharded_whole_chain``) is reported instead when it is closer.
    """
    order = sorted(range(len(problem.devices)), key=lambda d: -problem.devices[d].memory_bytes)
    best = None
    for k in range(1, min(len(order), len(problem.blocks)) + 1):
        inflight = [inflight_microbatches(problem, j, k) for j in range(k)]
        overflow, stages = _min_max_overflow(problem, [problem.devices[d] for d in order[:k]], inflight)
        if best is None or overflow < best[0]:
            best = (overflow, stages, order[:k])
    overflow, stages, devices = best
    j, (start, stop), used = max(
        ((j, rng, used) for j, (rng, used) in enumerate(stages)),
        key=lambda item: item[2] - problem.devices[devices[item[0]]].memory_bytes,
    )
    device, replicas = problem.devices[devices[j]], ""
    group = sharded_whole_chain(problem)
    if group is not None and group[2] - problem.devices[group[0]].memory_bytes < used - device.memory_bytes:
        (start, stop), used = (0, len(problem.blocks)), group[2]
        device, replicas = problem.devices[group[0]], f" and {group[1] - 1} more sharding its optimizer state"
    names = (
        problem.blocks[start] if stop - start == 1 else f"{problem.blocks[start]}..{problem.blocks[stop - 1]}"
    )
    return (
        f"the closest plan found still needs {format_bytes(used)} for blocks {names} on device "
        f"{device.name}{replicas} ({device.type}, {format_bytes(device.memory_bytes)} usable): "
        f"{format_bytes(used - device.memory_bytes)} missing"
    )


def _min_max_overflow(problem: PartitionProblem, devices: list, inflight: list[int]):
    """The cut of a fixed device sequence minimising max_j (memory_j - cap_j): (overflow, stages)
    with each stage's block range and the bytes it uses (those of its device's type)."""
    used = []
    for device, q in zip(devices, inflight):
        w = np.concatenate([[0.0], np.cumsum(problem.state_for(device.type))])
        a = np.concatenate([[0.0], np.cumsum(problem.act_for(device.type))])
        used.append((w[None, :] - w[:, None]) + q * (a[None, :] - a[:, None]))  # [start, stop)
    overflow, bounds = min_max_split([u - device.memory_bytes for u, device in zip(used, devices)])
    stages = [((b0, b1), float(u[b0, b1])) for u, b0, b1 in zip(used, bounds, bounds[1:])]
    return overflow, stages
