"""A step time no plan can beat, so every plan reports its gap to it."""

from __future__ import annotations

import math

import numpy as np

from hetcc.solver.problem import PartitionProblem


def lower_bound(problem: PartitionProblem) -> float:
    """A step time no plan can beat under this model.

    Communication only adds (C_j >= 0) and P >= max_j T_j, so T >= sum_j T_j + (M - 1) * max_j T_j.
    Two bounds on that:

    - integrality: every block runs on some device, so sum_j T_j >= sum_i min_t c_t[i], and one stage
      holds the costliest block, so max_j T_j >= max_i min_t c_t[i];
    - balance: relax "each block on one device" to fractions x[i, d] >= 0 summing to 1 and let B be
      the largest device load; min sum c x + (M - 1) * B is a lower bound. By LP duality, for any
      weights lambda_d >= 0 with sum_d lambda_d = M - 1 it is at least
      sum_i min_d (1 + lambda_d) * c_d[i]. Weights start proportional to device speed (giving
      "total work over total speed" when costs are proportional across types) and are improved by
      exponentiated-gradient steps; whichever weights are used, the value stays a valid bound.
    """
    types = sorted({d.type for d in problem.devices})
    costs = np.array([problem.block_cost_s(t) for t in types], dtype=float)
    counts = np.array([sum(d.type == t for d in problem.devices) for t in types], dtype=float)
    return compute_bound_s(costs, counts, problem.microbatches - 1)


def compute_bound_s(costs: np.ndarray, counts: np.ndarray, slope: int) -> float:
    """``lower_bound`` for devices of types ``costs[t]`` (seconds per block), ``counts[t]`` of each."""
    cheapest = costs.min(axis=0)
    integral = float(cheapest.sum()) + slope * float(cheapest.max())
    return max(integral, _balance_bound(costs, counts, slope))


def _balance_bound(costs: np.ndarray, counts: np.ndarray, slope: int, rounds: int = 200) -> float:
    """max over type weight shares of sum_i min_t (1 + slope * share_t / count_t) * c_t[i]."""
    if slope == 0:
        return float(costs.min(axis=0).sum())
    speed = counts / np.maximum(costs.sum(axis=1), 1e-300)
    share = speed / speed.sum()
    columns = np.arange(costs.shape[1])
    best = 0.0
    for step in range(rounds):
        scaled = (1 + slope * share / counts)[:, None] * costs
        best = max(best, float(scaled.min(axis=0).sum()))
        owner = scaled.argmin(axis=0)
        per_device = np.bincount(owner, weights=costs[owner, columns], minlength=len(counts)) / counts
        gradient = per_device / max(float(per_device.max()), 1e-300)
        share = share * np.exp(gradient / math.sqrt(step + 1))
        share = share / share.sum()
    return best
