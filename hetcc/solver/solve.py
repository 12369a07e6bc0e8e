"""``solve``: the plan of least step time, or an error naming the tightest memory shortfall.

The search is exact per device order (``solver.search``; a heuristic beyond ``config.exact_order_limit``
orders); the winner is scored by ``solver.objective.evaluate`` against ``solver.bound.lower_bound``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hetcc.errors import InfeasiblePlanError
from hetcc.solver.baselines import min_max_split
from hetcc.solver.objective import evaluate
from hetcc.solver.problem import PartitionProblem, PartitionSolution, inflight_microbatches
from hetcc.solver.search import search


def solve(problem: PartitionProblem) -> PartitionSolution:
    """The plan of least step time (exact per device order; see ``solver.search``)."""
    problem.validate()
    found = search(problem)
    if found is None:
        raise _infeasible_error(problem)
    boundaries, devices, exact, orders = found
    plan = evaluate(problem, boundaries, devices)
    return replace(plan, exact=exact, orders_searched=orders)


def _infeasible_error(problem: PartitionProblem) -> InfeasiblePlanError:
    shortfall = tightest_shortfall(problem)
    hints = ["activation recomputation", "more or larger devices"]
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
    best such cut is reported.
    """
    order = sorted(range(len(problem.devices)), key=lambda d: -problem.devices[d].memory_bytes)
    best = None
    for k in range(1, min(len(order), len(problem.blocks)) + 1):
        caps = [problem.devices[d].memory_bytes for d in order[:k]]
        inflight = [inflight_microbatches(problem, j, k) for j in range(k)]
        overflow, stages = _min_max_overflow(problem, caps, inflight)
        if best is None or overflow < best[0]:
            best = (overflow, stages, order[:k])
    overflow, stages, devices = best
    j, (start, stop), used = max(
        ((j, rng, used) for j, (rng, used) in enumerate(stages)),
        key=lambda item: item[2] - problem.devices[devices[item[0]]].memory_bytes,
    )
    device = problem.devices[devices[j]]
    names = (
        problem.blocks[start] if stop - start == 1 else f"{problem.blocks[start]}..{problem.blocks[stop - 1]}"
    )
    return (
        f"the closest plan found still needs {used:.4g} bytes for blocks {names} on device {device.name} "
        f"({device.type}, {device.memory_bytes:.4g} usable): {used - device.memory_bytes:.4g} bytes missing"
    )


def _min_max_overflow(problem: PartitionProblem, caps: list[float], inflight: list[int]):
    """The cut of a fixed device sequence minimising max_j (memory_j - cap_j): (overflow, stages)
    with each stage's block range and the bytes it uses."""
    w = np.concatenate([[0.0], np.cumsum(problem.state_bytes)])
    a = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
    used = [(w[None, :] - w[:, None]) + q * (a[None, :] - a[:, None]) for q in inflight]  # [start, stop)
    overflow, bounds = min_max_split([u - cap for u, cap in zip(used, caps)])
    stages = [((b0, b1), float(u[b0, b1])) for u, b0, b1 in zip(used, bounds, bounds[1:])]
    return overflow, stages
