"""The event-driven simulator: closed forms, causality of its timeline, agreement with the planner."""

from __future__ import annotations

import math
import random

import pytest

from hetcc.baselines import baselines
from hetcc.passes.partition import PartitionProblem, ProblemDevice, solve
from hetcc.simulate import simulate


def homogeneous(stages: int, microbatches: int, schedule: str, training: bool = True) -> PartitionProblem:
    devices = [ProblemDevice(f"gpu{k}", "t", 1e12, "n0") for k in range(stages)]
    return PartitionProblem(
        blocks=[f"b{i}" for i in range(stages)],
        fwd_s={"t": [1.0] * stages},
        bwd_s={"t": [2.0] * stages},
        state_bytes=[0.0] * stages,
        act_bytes=[0.0] * stages,
        cut_bytes=[0.0] * (stages - 1),
        devices=devices,
        bandwidth_bps=[[math.inf] * stages for _ in devices],
        latency_s=[[0.0] * stages for _ in devices],
        microbatches=microbatches,
        schedule=schedule,
        training=training,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 5), (4, 4), (4, 8), (5, 3)])
def test_equal_stages_without_communication_match_the_closed_form(schedule, stages, microbatches):
    problem = homogeneous(stages, microbatches, schedule)
    bounds, devices = list(range(stages + 1)), list(range(stages))
    sim = simulate(problem, bounds, devices)
    assert sim.step_time_s == pytest.approx((microbatches + stages - 1) * 3.0)
    assert sim.busy_s == tuple([3.0 * microbatches] * stages)
    assert sim.overall_bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))
    inference = simulate(homogeneous(stages, microbatches, schedule, training=False), bounds, devices)
    assert inference.step_time_s == pytest.approx(microbatches + stages - 1)


def mixed_problem(seed: int, schedule: str, microbatches: int) -> PartitionProblem:
    """Twelve uneven blocks on two nodes of two cards each (fast/slow), modest links."""
    rng = random.Random(seed)
    devices = [
        ProblemDevice(f"{t}{k}", t, 1e12, f"n{k // 2}")
        for k, t in enumerate(["fast", "fast", "slow", "slow"])
    ]
    base = [rng.uniform(0.5, 2.0) for _ in range(12)]
    return PartitionProblem(
        blocks=[f"b{i}" for i in range(12)],
        fwd_s={"fast": [b / 3 for b in base], "slow": [b for b in base]},
        bwd_s={"fast": [2 * b / 3 for b in base], "slow": [2 * b for b in base]},
        state_bytes=[1.0] * 12,
        act_bytes=[1.0] * 12,
        cut_bytes=[rng.uniform(0.0, 4.0) for _ in range(11)],
        devices=devices,
        bandwidth_bps=[
            [math.inf if a is b else (20.0 if a.node == b.node else 4.0) for b in devices] for a in devices
        ],
        latency_s=[[0.0 if a is b else 0.01 for b in devices] for a in devices],
        microbatches=microbatches,
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulator_agrees_with_the_planner_within_ten_percent(schedule):
    for seed in range(4):
        for microbatches in (2, 6, 12):
            problem = mixed_problem(seed, schedule, microbatches)
            plans = [solve(problem), *baselines(problem).values()]
            for plan in plans:
                sim = simulate(problem, plan.boundaries, plan.devices)
                assert sim.step_time_s == pytest.approx(plan.step_time_s, rel=0.10)


def test_timeline_is_causal_and_links_carry_one_transfer_at_a_time():
    problem = mixed_problem(1, "1f1b", 6)
    plan = solve(problem)
    sim = simulate(problem, plan.boundaries, plan.devices)
    at = {(e.stage, e.kind, e.microbatch): e for e in sim.events}
    stages = len(plan.stages)
    assert len([e for e in sim.events if e.kind in ("F", "B")]) == 2 * stages * 6
    for m in range(6):
        for s in range(stages - 1):
            assert at[(s + 1, "F", m)].start_s >= at[(s, "SEND_F", m)].end_s >= at[(s, "F", m)].end_s
            assert at[(s, "B", m)].start_s >= at[(s + 1, "SEND_B", m)].end_s >= at[(s + 1, "B", m)].end_s
    for s in range(stages):
        compute = sorted(
            (e for e in sim.events if e.stage == s and e.kind in ("F", "B")), key=lambda e: e.start_s
        )
        assert all(a.end_s <= b.start_s for a, b in zip(compute, compute[1:]))
    for link in range(stages - 1):
        sends = [e for e in sim.events if (e.kind, e.stage) in (("SEND_F", link), ("SEND_B", link + 1))]
        sends.sort(key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(sends, sends[1:]))
