"""The partitions a heterogeneous planner is measured against, scored by the same step-time model.

Each baseline runs on every device in the cluster's listed order (K = number of devices, or the
number of blocks if that is smaller) and cuts the chain blind to device differences:

- ``uniform``: equal numbers of blocks per stage (torch pipelining's default split).
- ``parameters``: equal parameter bytes (DeepSpeed's ``partition_method="parameters"``); balances
  ``state_bytes``, which is parameters + gradients + optimizer state and so proportional to them.
- ``flops``: equal compute, capability-blind: a block's work is its mean fwd+bwd time over the
  cluster's device types, so a block's share does not depend on which device gets it.

Balanced cuts minimise the largest stage total, as DeepSpeed's ``partition_balanced`` does. A baseline
whose stage overflows its device reports ``step_time_s = inf`` rather than failing.
"""

from __future__ import annotations

import math

import numpy as np

from hetcc.solver.objective import evaluate
from hetcc.solver.problem import PartitionProblem, PartitionSolution


def baselines(problem: PartitionProblem) -> dict[str, PartitionSolution]:
    """``uniform``, ``parameters`` and ``flops`` plans on all devices, evaluated like the solver's."""
    problem.validate()
    num_stages = min(len(problem.devices), len(problem.blocks))
    devices = list(range(num_stages))
    types = sorted({problem.devices[d].type for d in range(len(problem.devices))})
    work_s = np.mean([problem.block_cost_s(t) for t in types], axis=0)
    cuts = {
        "uniform": uniform_boundaries(len(problem.blocks), num_stages),
        "parameters": balanced_boundaries(problem.state_bytes, num_stages),
        "flops": balanced_boundaries(list(work_s), num_stages),
    }
    return {name: evaluate(problem, bounds, devices) for name, bounds in cuts.items()}


def uniform_boundaries(num_blocks: int, num_stages: int) -> list[int]:
    """Boundaries giving each stage floor or ceil of num_blocks / num_stages blocks (larger first)."""
    size, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for k in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if k < extra else 0))
    return bounds


def balanced_boundaries(weights: list[float], num_stages: int) -> list[int]:
    """Contiguous non-empty split into ``num_stages`` parts minimising the largest part's weight."""
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    part = prefix[None, :] - prefix[:, None]  # part[a, i] = weight of blocks [a, i)
    return min_max_split([part] * num_stages)[1]


def span_sums(per_block) -> np.ndarray:
    """``sums[a, i]``: the sum of ``per_block`` over blocks ``[a, i)`` (a stage's cost for ``min_max_split``)."""
    prefix = np.concatenate([[0.0], np.cumsum(per_block)])
    return prefix[None, :] - prefix[:, None]


def min_max_split(stage_costs: list[np.ndarray]) -> tuple[float, list[int]]:
    """The contiguous non-empty split of N blocks into ``len(stage_costs)`` stages minimising the
    largest ``stage_costs[j][a, i]`` (stage j holding blocks ``[a, i)``), and that maximum.

    A DP over cut positions (O(K N^2), vectorised); among equal maxima it keeps the earliest cut.
    """
    n = stage_costs[0].shape[0] - 1
    allowed = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    best = np.full(n + 1, math.inf)
    best[0] = -math.inf
    choices = []
    for cost in stage_costs:
        total = np.where(allowed, np.maximum(best[:, None], cost), math.inf)
        choices.append(total.argmin(axis=0))
        best = total.min(axis=0)
    bounds = [n]
    for choice in reversed(choices):
        bounds.append(int(choice[bounds[-1]]))
    return float(best[n]), bounds[::-1]
