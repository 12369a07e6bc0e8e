"""A plain simulator-driven local search over one problem's plan space, to check ``solve`` against:
random feasible starts, then random single moves kept while the simulated step falls."""

from __future__ import annotations

import math
import random

from hetcc.solver.objective import stage_costs
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.schedules import warmup_forwards
from hetcc.solver.simulate import simulate

# (cuts, replica groups, recompute, each stage's forwards before its first backward: None, the schedule's)
Plan = tuple[list[int], list[tuple[int, ...]], list[bool], list[int] | None]


def simulated(problem: PartitionProblem, plan: Plan) -> tuple[float, Plan]:
    """The plan's simulated step (inf where a stage's memory overflows), and the plan with the warm-ups
    its stages took."""
    bounds, groups, recompute, warmup = plan
    stages = stage_costs(problem, bounds, groups, recompute, warmup=warmup)
    plan = (bounds, groups, recompute, [s.warmup for s in stages] if problem.training else None)
    if not all(stage.fits for stage in stages):
        return math.inf, plan
    return simulate(problem, bounds, groups, recompute, events=False, stages=stages).step_time_s, plan


def local_search(
    problem: PartitionProblem, restarts: int, simulations: int, seed: int = 0, patience: int = 60
) -> tuple[float, Plan | None]:
    """The fastest simulated plan found: ``restarts`` random starts sharing ``simulations``, each
    climbing by random moves (cuts, devices between groups or in from the idle ones, recompute, a
    stage's warm-up) until
    ``patience`` moves in a row fail to improve it."""
    rng = random.Random(seed)
    best: tuple[float, Plan | None] = (math.inf, None)
    per_start = max(1, simulations // restarts)
    for _ in range(restarts):
        current, spent = None, 0
        while current is None and spent < per_start:
            spent += 1
            time_s, plan = simulated(problem, random_plan(problem, rng))
            current = (time_s, plan) if time_s < math.inf else None
        failed = 0
        while current is not None and spent < per_start and failed < patience:
            moved = _move(problem, current[1], rng)
            if moved is None:
                failed += 1
                continue
            spent += 1
            time_s, moved = simulated(problem, moved)
            if time_s < current[0] * (1 - 1e-12):
                current, failed = (time_s, moved), 0
            else:
                failed += 1
        if current is not None and current[0] < best[0]:
            best = current
    return best


def random_plan(problem: PartitionProblem, rng: random.Random) -> Plan:
    n, devices = len(problem.blocks), list(range(len(problem.devices)))
    k = rng.randint(1, min(n, len(devices)))
    rng.shuffle(devices)
    used = devices[: rng.randint(k, len(devices))] if problem.replicate else devices[:k]
    groups = [[d] for d in used[:k]]
    for d in used[k:]:
        rng.choice(groups).append(d)
    cuts = sorted(rng.sample(range(1, n), k - 1))
    recompute = [problem.recompute and rng.random() < 0.3 for _ in range(k)]
    return [0, *cuts, n], [tuple(g) for g in groups], recompute, None


def _move(problem: PartitionProblem, plan: Plan, rng: random.Random) -> Plan | None:
    """One random change of ``plan``, or None where the drawn kind of move does not apply; a change of
    the replica counts takes the schedule's warm-up."""
    bounds, groups, recompute = list(plan[0]), [list(g) for g in plan[1]], list(plan[2])
    warmup = None if plan[3] is None else list(plan[3])
    k = len(groups)
    idle = [d for d in range(len(problem.devices)) if all(d not in g for g in groups)]
    kind = rng.randrange(8)
    if kind == 0 and k > 1:  # move a cut
        j = rng.randint(1, k - 1)
        bounds[j] += rng.choice((-2, -1, 1, 2))
        if not bounds[j - 1] < bounds[j] < bounds[j + 1]:
            return None
    elif kind == 1 and k > 1:  # swap two devices of different stages
        a, b = rng.sample(range(k), 2)
        i, j = rng.randrange(len(groups[a])), rng.randrange(len(groups[b]))
        groups[a][i], groups[b][j] = groups[b][j], groups[a][i]
    elif kind == 2 and idle:  # an idle device takes a stage's device's place
        a = rng.randrange(k)
        groups[a][rng.randrange(len(groups[a]))] = rng.choice(idle)
    elif kind == 3 and problem.replicate and idle:  # an idle device joins a group
        rng.choice(groups).append(rng.choice(idle))
    elif kind == 4 and problem.replicate:  # a device leaves its group (for another, or idle)
        a = rng.randrange(k)
        if len(groups[a]) < 2:
            return None
        d = groups[a].pop(rng.randrange(len(groups[a])))
        if k > 1 and rng.random() < 0.5:
            groups[rng.choice([b for b in range(k) if b != a])].append(d)
    elif kind == 5 and problem.recompute and problem.training:  # toggle recompute
        j = rng.randrange(k)
        recompute[j] = not recompute[j]
    elif kind == 6:  # split a stage onto an idle device, or merge two neighbours
        j = rng.randrange(k)
        if idle and bounds[j + 1] - bounds[j] > 1 and rng.random() < 0.5:
            bounds.insert(j + 1, rng.randint(bounds[j] + 1, bounds[j + 1] - 1))
            groups.insert(j + 1, [rng.choice(idle)])
            recompute.insert(j + 1, recompute[j])
        elif j < k - 1:
            del bounds[j + 1]
            merged = groups[j] + groups[j + 1] if problem.replicate else groups[rng.choice((j, j + 1))]
            groups[j : j + 2] = [merged]
            recompute[j : j + 2] = [recompute[j] or recompute[j + 1]]
        else:
            return None
    elif kind == 7 and warmup is not None and problem.schedule != "gpipe":  # a stage's warm-up
        j = rng.randrange(k)
        least = warmup_forwards("1f1b", [len(g) for g in groups], problem.microbatches)[j]
        low = max([least, *warmup[j + 1 :]])
        warmup[j] = rng.randint(low, warmup[j - 1] if j else problem.microbatches)
    else:
        return None
    if [len(g) for g in groups] != [len(g) for g in plan[1]]:
        warmup = None
    return bounds, [tuple(g) for g in groups], recompute, warmup
