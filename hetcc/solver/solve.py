"""``solve``: the plan of least step time, or an error naming the tightest memory shortfall.

The search is exact per sequence of replica groups (``solver.search``; a heuristic beyond
``config.exact_order_limit`` sequences) for the objective (``solver.objective``). With ``rerank`` the
best few sequences' plans (and, with replicas allowed, the best pure pipelines') are replayed in the
simulator (``solver.simulate``), which is the judge: each search's fastest simulated plans are refined
by local moves and restarts (``solver.refine``), and the faster of those wins. Every plan reports
its simulated step and its gap to ``solver.bound.lower_bound``, a bound on the simulated step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from hetcc.errors import InfeasiblePlanError, format_bytes
from hetcc.solver.baselines import min_max_split, span_sums
from hetcc.solver.bound import lower_bound
from hetcc.solver.objective import evaluate
from hetcc.solver.problem import PartitionProblem, PartitionSolution, inflight_microbatches
from hetcc.solver.refine import REFINE_ACTIONS, REFINE_SIMULATIONS, REFINED_STARTS, refine_by_simulation
from hetcc.solver.search import Solved, search
from hetcc.solver.sharding import sharded_whole_chain
from hetcc.solver.simulate import simulate


def solve(problem: PartitionProblem, rerank: int = 0) -> PartitionSolution:
    """The plan of least objective (exact per sequence; see ``solver.search``), or with ``rerank`` > 0
    the fastest simulated plan among the best ``rerank`` sequences the search found (with replicas
    allowed, and the best ``rerank`` pure pipelines; where the search is heuristic, the single-best
    search's plan too), each search's fastest refined by simulation (``refine.refine_by_simulation``).
    ``simulated_s`` is filled in either way; ``gap`` is simulated step / lower bound - 1."""
    problem.validate()
    return solve_searched(problem, search_plans(problem, rerank), rerank)


class Searched(NamedTuple):
    """What ``solve``'s searches found (``search_plans``): per plan space, whether it allows replicas and
    its candidate plans (boundaries, groups, recompute, shard), best first; whether the first search was
    exhaustive and how many sequences it solved.

    The searches see a schedule only as GPipe or not (a stage holds 1F1B's microbatches under every
    other: ``problem.inflight_microbatches``; the formula has no warm-up or deferral), so one
    ``Searched`` serves 1f1b, zb-h1 and zb-h2 alike (``solve_searched``), which differ in what the
    simulator replays."""

    gpipe: bool
    exact: bool
    solved: int
    spaces: tuple[tuple[bool, tuple], ...]


def search_plans(problem: PartitionProblem, rerank: int = 0) -> Searched:
    """``solve``'s searches; InfeasiblePlanError naming the tightest shortfall where no plan fits."""
    solved = Solved(problem)  # the single-best search below meets some of this one's sequences
    found = search(problem, keep=max(1, rerank), solved=solved)
    if found is None:
        raise _infeasible_error(problem)
    candidates = list(found.candidates)
    if rerank > 1 and not found.exact:
        # Keeping runners-up, the heuristic search searches less far (``search.RERANKED_EVALUATIONS``):
        # the sequence the single-best search finds joins the re-ranking, so re-ranking never loses it.
        single = search(problem, keep=1, solved=solved)
        candidates += single.candidates if single is not None else []
    spaces = [(problem.replicate, tuple(candidates))]
    if rerank and problem.replicate:
        # Pure pipelines are plans too: the search with replicas is heuristic on large clusters, and its
        # formula and the simulator can disagree, so the best pure pipelines join the re-ranking.
        pure = search(replace(problem, replicate=False), keep=rerank)
        spaces.append((False, tuple(pure.candidates) if pure is not None else ()))
    return Searched(problem.schedule == "gpipe", found.exact, found.solved, tuple(spaces))


def solve_searched(problem: PartitionProblem, searched: Searched, rerank: int = 0) -> PartitionSolution:
    """``solve`` from what ``search_plans`` found for ``problem`` under this schedule or another that
    the searches see alike (``Searched``): the candidates scored, re-ranked and refined under
    ``problem.schedule``."""
    if searched.gpipe != (problem.schedule == "gpipe"):
        raise ValueError(
            f"plans searched {'with' if searched.gpipe else 'without'} GPipe replayed under {problem.schedule}"
        )
    bound_s = lower_bound(problem)
    seen, best = set(), None
    for replicate, candidates in searched.spaces:
        space = problem if replicate == problem.replicate else replace(problem, replicate=replicate)
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
                starts = [refine_by_simulation(moves, starts, budget=budget)]
            plan, simulated = starts[0]
            winner = (simulated, plan.step_time_s, plan, simulated)
        best = winner if best is None or winner[:2] < best[:2] else best
    _, _, plan, simulated = best
    bound = lower_bound(problem, within_s=simulated)  # no plan as fast as this one beats it
    gap = simulated / bound - 1 if bound > 0 else math.inf
    return replace(
        plan, exact=searched.exact, orders_searched=searched.solved, simulated_s=simulated, lower_bound_s=bound,
        gap=gap,
    )  # fmt: skip


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
    limit = problem.stage_limit()
    capped = f" in at most {limit} stages" if limit < min(len(problem.blocks), len(problem.devices)) else ""
    return InfeasiblePlanError(
        f"no partition of {len(problem.blocks)} blocks over {len(problem.devices)} device(s){capped} fits in "
        f"memory: {shortfall}",
        hint="try " + ", ".join(hints),
    )


def tightest_shortfall(problem: PartitionProblem) -> str:
    """Describe the smallest memory overflow found: which blocks, which device, how many bytes short.

    Devices are taken largest first (1F1B's early stages hold the most microbatches) and, for each
    number of stages the problem allows (``stage_limit``), a DP finds the cut that minimises the largest
    overflow; the worst stage of the best such cut is reported. Where replicas may shard their optimizer
    state, the whole chain on one sharding replica group (``sharding.sharded_whole_chain``) is reported
    instead when it is closer.
    """
    order = sorted(range(len(problem.devices)), key=lambda d: -problem.devices[d].memory_bytes)
    best = None
    for k in range(1, problem.stage_limit() + 1):
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
    used = [
        span_sums(problem.state_for(device.type)) + q * span_sums(problem.act_for(device.type))
        for device, q in zip(devices, inflight)
    ]
    overflow, bounds = min_max_split([u - device.memory_bytes for u, device in zip(used, devices)])
    stages = [((b0, b1), float(u[b0, b1])) for u, b0, b1 in zip(used, bounds, bounds[1:])]
    return overflow, stages
