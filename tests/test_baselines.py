"""Baseline partitions: their cuts, their device use, and that the solver never loses to them."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetcc.solver.baselines import balanced_boundaries, baselines, uniform_boundaries
from hetcc.solver.problem import PartitionProblem, ProblemDevice
from hetcc.solver.solve import solve


def problem_on(devices: list[ProblemDevice], n: int, **overrides) -> PartitionProblem:
    types = {d.type for d in devices}
    speed = {"fast": 1.0, "slow": 3.0}
    fields = dict(
        blocks=[f"b{i}" for i in range(n)],
        fwd_s={t: [speed[t] * (1 + i % 3) for i in range(n)] for t in types},
        bwd_s={t: [2 * speed[t] * (1 + i % 3) for i in range(n)] for t in types},
        state_bytes=[float(1 + (i * 7) % 5) for i in range(n)],
        act_bytes=[1.0] * n,
        cut_bytes=[1.0] * (n - 1),
        devices=devices,
        bandwidth_bps=[[math.inf if a is b else 10.0 for b in devices] for a in devices],
        latency_s=[[0.0] * len(devices) for _ in devices],
        microbatches=4,
    )
    fields.update(overrides)
    return PartitionProblem(**fields)


def cards(*types: str, memory: float = 1e9) -> list[ProblemDevice]:
    return [ProblemDevice(f"{t}{k}", t, memory, "n0") for k, t in enumerate(types)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8), st.integers(1, 8))
def test_balanced_boundaries_minimise_the_largest_part(weights, parts):
    parts = min(parts, len(weights))
    bounds = balanced_boundaries(weights, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(weights)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))

    def largest(cut):
        return max(sum(weights[a:b]) for a, b in zip(cut, cut[1:]))

    best = min(
        largest([0, *cuts, len(weights)])
        for cuts in itertools.combinations(range(1, len(weights)), parts - 1)
    )
    assert largest(bounds) == pytest.approx(best)


def test_uniform_boundaries_spread_the_remainder():
    assert uniform_boundaries(10, 4) == [0, 3, 6, 8, 10]
    assert uniform_boundaries(3, 3) == [0, 1, 2, 3]


def test_baselines_use_every_device_in_listed_order():
    problem = problem_on(cards("slow", "fast", "fast"), n=9)
    plans = baselines(problem)
    assert set(plans) == {"uniform", "parameters", "flops"}
    for plan in plans.values():
        assert plan.devices == [0, 1, 2]
    assert plans["uniform"].boundaries == [0, 3, 6, 9]
    # Equal parameter bytes: state bytes 1 3 5 | 2 4 1 | 3 5 2 is a best split (largest part 10).
    assert [s.state_bytes for s in plans["parameters"].stages] == [9.0, 7.0, 10.0]
    # The solver's search space contains every baseline, so it is never slower.
    best = solve(problem).step_time_s
    assert all(best <= plan.step_time_s * (1 + 1e-12) for plan in plans.values())
    assert best < plans["uniform"].step_time_s  # the slow first card is overloaded by equal blocks


def test_fewer_blocks_than_devices_uses_the_first_devices():
    plans = baselines(problem_on(cards("fast", "fast", "slow", "slow"), n=2))
    assert all(plan.devices == [0, 1] for plan in plans.values())


def test_baseline_that_overflows_memory_reports_infinity():
    problem = problem_on(cards("fast", "fast", memory=12.0), n=6, schedule="gpipe")
    plans = baselines(problem)
    assert plans["uniform"].step_time_s == math.inf
    overflowing = [s for s in plans["uniform"].stages if s.memory_bytes > s.memory_capacity_bytes]
    assert overflowing and all(s.memory_capacity_bytes == 12.0 for s in overflowing)
