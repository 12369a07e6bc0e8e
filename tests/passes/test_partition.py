"""The partition solver: optimal against brute force (round trips too), true lower bound, memory, errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetcc import config
from hetcc.errors import InfeasiblePlanError, PlanFormatError
from hetcc.solver.bound import lower_bound, objective_bound
from hetcc.solver.dp import solve_sequence
from hetcc.solver.objective import evaluate, step_time
from hetcc.solver.problem import PartitionProblem, PartitionSolution, ProblemDevice
from hetcc.solver.screen import Screen
from hetcc.solver.search import (
    Solved,
    _all_sequences,
    _neighbours,
    _Search,
    count_sequences,
    interchangeable_groups,
)
from hetcc.solver.solve import solve

TYPES = ("fast", "mid", "slow")


@st.composite
def problems(draw, max_blocks: int = 9, max_devices: int = 4) -> PartitionProblem:
    """Random chains on up to 3 types over 1-2 nodes; memory sometimes tight, sometimes absent."""
    n = draw(st.integers(1, max_blocks))
    num_devices = draw(st.integers(1, max_devices))
    types = TYPES[: draw(st.integers(1, 3))]
    cost = st.one_of(st.just(0.0), st.floats(0.05, 4.0))
    memory = st.sampled_from([1e12, 40.0, 60.0, 90.0, 150.0])
    devices = [
        ProblemDevice(
            f"d{k}", draw(st.sampled_from(types)), draw(memory), draw(st.sampled_from(["n0", "n1"]))
        )
        for k in range(num_devices)
    ]
    fwd = {t: draw(st.lists(cost, min_size=n, max_size=n)) for t in types}
    ratio = draw(st.floats(1.0, 3.0))
    same, other = draw(st.floats(5.0, 100.0)), draw(st.floats(0.5, 5.0))
    return PartitionProblem(
        blocks=[f"b{i}" for i in range(n)],
        fwd_s=fwd,
        bwd_s={t: [ratio * f for f in fwd[t]] for t in types},
        state_bytes=draw(st.lists(st.floats(0.0, 25.0), min_size=n, max_size=n)),
        act_bytes=draw(st.lists(st.floats(0.0, 6.0), min_size=n, max_size=n)),
        cut_bytes=draw(st.lists(st.floats(0.0, 20.0), min_size=n - 1, max_size=n - 1)),
        devices=devices,
        bandwidth_bps=[
            [math.inf if a is b else (same if a.node == b.node else other) for b in devices] for a in devices
        ],
        latency_s=[
            [0.0 if a is b else (0.001 if a.node == b.node else 0.05) for b in devices] for a in devices
        ],
        microbatches=draw(st.integers(1, 8)),
        schedule=draw(st.sampled_from(["gpipe", "1f1b"])),
        training=draw(st.booleans()),
    )


@st.composite
def round_trip_problems(draw, max_blocks: int = 8, max_devices: int = 4) -> PartitionProblem:
    """1F1B training with even compute and links about as slow as a stage: round trips bind."""
    problem = draw(problems(max_blocks, max_devices))
    n = len(problem.blocks)
    problem.fwd_s = {t: draw(st.lists(st.floats(0.3, 1.0), min_size=n, max_size=n)) for t in problem.fwd_s}
    problem.bwd_s = {t: [2 * f for f in problem.fwd_s[t]] for t in problem.fwd_s}
    problem.cut_bytes = draw(st.lists(st.floats(0.0, 6.0), min_size=n - 1, max_size=n - 1))
    problem.latency_s = [
        [0.0 if a == b else 0.01 for b in range(len(row))] for a, row in enumerate(problem.latency_s)
    ]
    problem.bandwidth_bps = [
        [math.inf if v == math.inf else min(v, 4.0) for v in row] for row in problem.bandwidth_bps
    ]
    problem.microbatches = draw(st.integers(2, 9))
    problem.schedule, problem.training = "1f1b", True
    return problem


def brute_force(problem: PartitionProblem) -> float:
    """Least step time over every cut set and every ordered subset of devices."""
    n, best = len(problem.blocks), math.inf
    for k in range(1, min(n, len(problem.devices)) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            for order in itertools.permutations(range(len(problem.devices)), k):
                best = min(best, step_time(problem, [0, *cuts, n], order))
    return best


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_solve_matches_brute_force_and_respects_memory(problem):
    best = brute_force(problem)
    assert objective_bound(problem) <= best * (1 + 1e-9)
    if best == math.inf:
        with pytest.raises(InfeasiblePlanError, match="missing"):
            solve(problem)
        return
    plan = solve(problem)
    assert plan.exact
    assert plan.step_time_s == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.step_time_s == pytest.approx(step_time(problem, plan.boundaries, plan.devices), rel=1e-12)
    assert all(s.memory_bytes <= s.memory_capacity_bytes * (1 + 1e-9) for s in plan.stages)
    assert plan.lower_bound_s <= plan.simulated_s * (1 + 1e-9)  # the bound is on the simulated step


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_trip_problems(max_blocks=7))
def test_solve_is_exact_when_round_trips_set_the_period(problem):
    best = brute_force(problem)
    assert objective_bound(problem) <= best * (1 + 1e-9)
    if best == math.inf:
        return
    plan = solve(problem)
    assert plan.step_time_s == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.period_s >= plan.bottleneck_s


@settings(max_examples=25, deadline=None)
@given(problems(max_blocks=7, max_devices=4))
def test_heuristic_search_returns_a_feasible_plan_no_better_than_exact(problem):
    with config.patch(exact_order_limit=1):
        try:
            heuristic = solve(problem)
        except InfeasiblePlanError:
            return
    sizes = [len(g) for g in interchangeable_groups(problem)]
    assert heuristic.exact == (count_sequences(sizes, len(problem.blocks), 10**6) <= 1)
    assert heuristic.step_time_s >= solve(problem).step_time_s * (1 - 1e-9)
    assert all(s.memory_bytes <= s.memory_capacity_bytes * (1 + 1e-9) for s in heuristic.stages)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(max_blocks=8), round_trip_problems(max_blocks=8)), st.booleans())
def test_screen_is_a_plans_step_and_reusing_suffixes_changes_nothing(problem, replicate):
    problem.replicate = replicate
    solved = Solved(problem)
    chain = solved.chain
    groups = interchangeable_groups(problem)
    state = _Search(solved, groups, min(len(problem.blocks), len(problem.devices)))
    incumbent = tuple((g, 1) for g in range(len(groups)))[: state.max_length]
    optimum = solve_sequence(chain, state.devices(incumbent))
    if optimum is None:
        return
    screen = Screen.around(chain, chain.stages(state.devices(incumbent)), optimum.period_s)
    neighbours = [n for n in _neighbours(incumbent, [len(g) for g in groups], replicate) if n]
    for labels in [incumbent, *neighbours[:12]]:
        if len(labels) > state.max_length:
            continue
        stages = chain.stages(state.devices(labels))
        screened = screen.step_s(stages)
        assert screened == Screen(chain, screen.bounds_s).step_s(stages)  # no suffix kept
        if math.isfinite(screened):  # some plan achieves it, so the sequence's optimum is no worse
            exact = solve_sequence(chain, state.devices(labels))
            assert exact is not None and exact.step_s <= screened * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_problem_json_round_trip_is_exact(problem):
    assert PartitionProblem.from_json(problem.to_json()) == problem


def chain(costs: dict[str, float], counts: dict[str, int], n: int = 12, **overrides) -> PartitionProblem:
    """n equal blocks; ``counts[t]`` devices of type t (one node), block cost ``costs[t]`` seconds."""
    devices = [ProblemDevice(f"{t}{k}", t, 1e12, "n0") for t, c in counts.items() for k in range(c)]
    fields = dict(
        blocks=[f"layer{i}" for i in range(n)],
        fwd_s={t: [c / 3] * n for t, c in costs.items()},
        bwd_s={t: [2 * c / 3] * n for t, c in costs.items()},
        state_bytes=[10.0] * n,
        act_bytes=[1.0] * n,
        cut_bytes=[0.0] * (n - 1),
        devices=devices,
        bandwidth_bps=[[math.inf if a is b else 1e12 for b in devices] for a in devices],
        latency_s=[[0.0] * len(devices) for _ in devices],
        microbatches=8,
    )
    fields.update(overrides)
    return PartitionProblem(**fields)


def test_fast_devices_get_more_blocks():
    problem = chain({"fast": 1.0, "slow": 2.0}, {"slow": 2, "fast": 2})
    plan = solve(problem)
    sizes = {s.device_name: s.blocks[1] - s.blocks[0] for s in plan.stages}
    assert sizes == {"slow0": 2, "slow1": 2, "fast0": 4, "fast1": 4}
    # Perfect balance (4 x 1 s = 2 x 2 s) with no communication: the plan meets the lower bound.
    assert plan.step_time_s == pytest.approx(4 * 4 + 7 * 4)
    assert objective_bound(problem) == pytest.approx(plan.step_time_s)  # the search's bound is met
    # the gap is to the bound for plans no slower than this one, no lower than the bound for every plan
    assert plan.gap == pytest.approx(plan.simulated_s / lower_bound(problem, within_s=plan.simulated_s) - 1)
    assert lower_bound(problem) <= plan.lower_bound_s <= plan.simulated_s


def test_a_useless_slow_device_is_left_out():
    plan = solve(chain({"fast": 1.0, "slow": 100.0}, {"fast": 2, "slow": 1}, n=4, microbatches=2))
    assert sorted(s.device_name for s in plan.stages) == ["fast0", "fast1"]


def test_evaluate_reports_the_stage_breakdown():
    problem = chain({"t": 3.0}, {"t": 3}, n=3, cut_bytes=[100.0, 50.0], microbatches=4)
    problem.bandwidth_bps = [[math.inf if a == b else 10.0 for b in range(3)] for a in range(3)]
    problem.latency_s = [[0.0 if a == b else 0.5 for b in range(3)] for a in range(3)]
    plan = evaluate(problem, [0, 1, 2, 3], [2, 0, 1])
    assert [s.comm_s for s in plan.stages] == [2 * (0.5 + 10.0), 2 * (0.5 + 5.0), 0.0]
    assert [s.inflight for s in plan.stages] == [3, 2, 1]  # 1F1B: min(M, K - j)
    assert [s.memory_bytes for s in plan.stages] == [13.0, 12.0, 11.0]
    assert plan.step_time_s == pytest.approx((3 + 21) + (3 + 11) + 3 + 3 * 21)
    assert plan.devices == [2, 0, 1] and plan.boundaries == [0, 1, 2, 3]
    assert PartitionSolution.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize(
    ("schedule", "microbatches", "period"),
    [
        ("1f1b", 8, 12 / 3),  # stage 0 holds 3 microbatches, each 3 + 1.5 + 3 + 1.5 + 3 s in flight
        ("1f1b", 3, 7.5 / 2),  # stage 0 may hold all 3: only stages 1 and 2 wait on round trips
        ("1f1b", 2, 3.0),  # only the last stage is throttled, and its round trip is T_2 itself
        ("gpipe", 8, 3.0),  # GPipe never waits on a backward before a forward
    ],
)
def test_round_trips_set_the_1f1b_period(schedule, microbatches, period):
    problem = chain({"t": 3.0}, {"t": 3}, n=3, schedule=schedule, microbatches=microbatches)
    problem.cut_bytes = [1.0, 1.0]  # one message each way per cut, priced by its latency
    problem.latency_s = [[0.0 if a == b else 0.75 for b in range(3)] for a in range(3)]  # C_j = 1.5 s
    plan = evaluate(problem, [0, 1, 2, 3], [0, 1, 2])
    assert plan.bottleneck_s == 3.0
    assert plan.period_s == pytest.approx(period)
    assert plan.step_time_s == pytest.approx(12 + (microbatches - 1) * period)
    assert solve(problem).step_time_s <= plan.step_time_s * (1 + 1e-12)


def test_memory_overflow_makes_a_plan_infinite_and_solve_explains():
    problem = chain({"t": 1.0}, {"t": 2}, n=4, schedule="gpipe")
    problem.devices = [ProblemDevice("small", "t", 25.0, "n0"), ProblemDevice("big", "t", 40.0, "n0")]
    assert step_time(problem, [0, 2, 4], [0, 1]) == math.inf  # 20 + 8 * 2 > 25
    with pytest.raises(InfeasiblePlanError, match=r"(?s) B missing.*1f1b.*recompute=True"):
        solve(problem)


def test_objective_bound_balances_work_and_fill_and_is_tight_here():
    problem = chain({"fast": 1.0, "slow": 3.0}, {"fast": 1, "slow": 3}, n=12, microbatches=5)
    # Fractional optimum of sum_j T_j + (M - 1) max_j T_j: 6 blocks on the fast card (6 s) and 2 on
    # each slow one (6 s each): 24 + 4 * 6. Work over speed alone would give only 12 + 4 * 6.
    assert objective_bound(problem) == pytest.approx(48, rel=1e-6)
    assert solve(problem).step_time_s == pytest.approx(48)


def test_simulated_step_bound_counts_memory():
    problem = chain({"fast": 1.0, "slow": 3.0}, {"fast": 1, "slow": 3}, n=12, microbatches=5)
    # Work over speed: 60 block-microbatches at 1 + 3 * (1/3) blocks per second.
    assert lower_bound(problem) == pytest.approx(30, rel=1e-3)
    # The fast card now holds at most 3 blocks' state: 9 blocks go to the slow ones (45 s of work).
    problem.devices[0] = ProblemDevice("fast0", "fast", 3.0 * problem.state_bytes[0], "n0")
    # (the subgradient approaches the LP's 45 from below; any value it reports is a valid bound)
    assert 42 < lower_bound(problem) <= 45 * (1 + 1e-9)
    assert lower_bound(problem) <= solve(problem).simulated_s


def test_identical_devices_are_grouped_and_orders_counted():
    problem = chain({"a": 1.0, "b": 2.0}, {"a": 3, "b": 2})
    problem.devices[4] = ProblemDevice("b1", "b", 1e12, "n1")  # another node: not interchangeable
    assert interchangeable_groups(problem) == [[0, 1, 2], [3], [4]]
    # A slow link between a0 and a1: they still mirror each other, but a2 no longer matches them.
    problem.bandwidth_bps[0][1] = problem.bandwidth_bps[1][0] = 5.0
    assert interchangeable_groups(problem) == [[0, 1], [2], [3], [4]]
    for sizes, length in (([3, 1, 1], 5), ([2, 2], 3), ([1, 1, 1, 1], 4)):
        assert count_sequences(sizes, length, 10**6) == len(list(_all_sequences(sizes, length)))


def test_validate_names_the_bad_field():
    problem = chain({"t": 1.0}, {"t": 2})
    problem.cut_bytes = [1.0]
    with pytest.raises(PlanFormatError, match="'cut_bytes': has 1 entries, expected 11"):
        solve(problem)
    problem = chain({"t": 1.0}, {"t": 2}, schedule="zb")
    with pytest.raises(PlanFormatError, match="unknown schedule 'zb'"):
        problem.validate()
    problem = chain({"t": 1.0}, {"t": 2})
    problem.fwd_s = {"other": [1.0] * 12}
    with pytest.raises(PlanFormatError, match="no entry for device type 't'"):
        problem.validate()
    with pytest.raises(PlanFormatError, match="rise strictly"):
        evaluate(chain({"t": 1.0}, {"t": 2}), [0, 12, 12], [0, 1])
