"""ZeRO-1 as a plan dimension: replicated stages may shard their optimizer state (numbers only, no
torch). Checked against brute force over cuts x groups x recompute x shard, the bound and the
simulator."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan_space import homogeneous_groups, solves_like_brute_force

from hetcc.errors import InfeasiblePlanError, PlanFormatError
from hetcc.solver.bound import lower_bound
from hetcc.solver.dp import Chain, solve_sequence
from hetcc.solver.objective import evaluate, step_time
from hetcc.solver.problem import PartitionProblem, PartitionSolution, ProblemDevice
from hetcc.solver.sharding import shard_choices
from hetcc.solver.simulate import simulate
from hetcc.solver.solve import solve


def _pair_problem(memory: float, *, blocks: int = 2, bandwidth: float = 100.0, **changes) -> PartitionProblem:
    """Two identical devices on one node; each block: 1 s forward, 2 s backward, 4 bytes of state of
    which 3 are optimizer state (1 byte of parameters), 1 byte of activations per microbatch."""
    devices = [ProblemDevice(f"g{i}", "gpu", memory, "n0") for i in range(2)]
    problem = PartitionProblem(
        blocks=[f"b{i}" for i in range(blocks)], fwd_s={"gpu": [1.0] * blocks}, bwd_s={"gpu": [2.0] * blocks},
        state_bytes=[4.0] * blocks, act_bytes=[1.0] * blocks, cut_bytes=[0.5] * (blocks - 1), devices=devices,
        bandwidth_bps=[[math.inf, bandwidth], [bandwidth, math.inf]], latency_s=[[0.0, 0.001], [0.001, 0.0]],
        microbatches=2, replicate=True, param_bytes=[1.0] * blocks, optimizer_bytes=[3.0] * blocks,
    )  # fmt: skip
    return dataclasses.replace(problem, **changes)


def test_the_problem_round_trips_through_json_with_its_optimizer_bytes():
    problem = _pair_problem(9.0, shard=True, shard_all=True)
    back = PartitionProblem.from_json(problem.to_json())
    assert back == problem and back.optimizer_bytes == [3.0, 3.0] and back.shard and back.shard_all
    assert (
        PartitionProblem.from_json(_pair_problem(9.0, optimizer_bytes=None).to_json()).optimizer_bytes is None
    )


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"optimizer_bytes": [3.0]}, "optimizer_bytes.*1 entries, expected 2"),
        ({"optimizer_bytes": [3.0, 4.5]}, r"optimizer_bytes.*entry 1 \(4.5\) exceeds .*state_bytes \(4.0\)"),
        ({"optimizer_bytes": [3.0, -1.0]}, "optimizer_bytes.*entry 1"),
        ({"shard": "yes"}, "'shard'"),
        ({"shard_all": 1}, "'shard_all'"),
    ],
)
def test_invalid_sharding_fields_are_named(changes, match):
    with pytest.raises(PlanFormatError, match=match):
        _pair_problem(9.0, **changes).validate()


def test_a_single_device_stage_cannot_shard():
    with pytest.raises(PlanFormatError, match="True only for a replicated stage"):
        evaluate(_pair_problem(9.0, shard=True), [0, 1, 2], [0, 1], shard=[False, True])
    with pytest.raises(PlanFormatError, match=r"one flag per stage \(1\)"):
        evaluate(_pair_problem(9.0, shard=True), [0, 2], [(0, 1)], shard=[True, False])


def test_sharding_makes_a_replica_group_fit_where_it_would_not():
    # One replicated stage holds 8 bytes of state (6 of them optimizer state) + 2 of activations: 10 > 9.
    # Sharded over 2 replicas each holds 8 - 6 / 2 + 2 = 7, and the group beats the pipeline.
    whole = solve(_pair_problem(9.0))
    assert whole.groups == [(0,), (1,)] and whole.shard == [False, False]
    assert evaluate(_pair_problem(9.0), [0, 2], [(0, 1)]).step_time_s == math.inf  # the group without ZeRO-1
    problem = _pair_problem(9.0, shard=True)
    found = solve(problem)
    (stage,) = found.stages
    assert found.groups == [(0, 1)] and found.shard == [True]
    assert stage.memory_bytes == pytest.approx(8 - 6 / 2 + 2) and stage.sharded_bytes == pytest.approx(3)
    assert stage.fits and stage.memory_bytes <= stage.memory_capacity_bytes
    assert stage.allgather_s == pytest.approx(0.001 + 2 / 2 / 100.0)  # (r - 1) (latency + params / r / bw)
    assert found.step_time_s < whole.step_time_s
    assert PartitionSolution.from_dict(found.to_dict()).stages == found.stages  # plan files keep it
    sim = simulate(
        problem, found.boundaries, found.groups, found.recompute, shard=found.shard, warmup=found.warmup
    )
    assert sim.step_time_s == pytest.approx(found.simulated_s)
    for replica in (0, 1):  # the all-gather runs right after the all-reduce, and ends the step
        reduce, gather = (
            next(e for e in sim.events if e.kind == kind and e.replica == replica)
            for kind in ("ALLREDUCE", "ALLGATHER")
        )
        assert gather.start_s == pytest.approx(reduce.end_s)
        assert gather.end_s - gather.start_s == pytest.approx(stage.allgather_s)
        assert gather.end_s == pytest.approx(sim.step_time_s)
    assert found.simulated_s >= lower_bound(problem) * (1 - 1e-9)


def test_a_replica_group_may_need_both_recomputation_and_sharding():
    # GPipe, 4 microbatches: a replica of the group holds 2 of them. On 11 bytes, from block 0 the
    # stage reaches block 1 as it is, block 2 recomputing (keeps one microbatch's activations: the
    # stage has no input) or sharding (holds 1/2 of the optimizer state), and all three blocks with
    # both (12 - 4.5 + 3 = 10.5): the DP weighs all four modes, and the group beats any pipeline.
    problem = _pair_problem(11.0, blocks=3, schedule="gpipe", microbatches=4, recompute=True, shard=True)
    (slot,) = Chain(problem).stages([(0, 1)])
    assert [int(m.hi_memory[0]) for m in slot.modes] == [1, 2, 2, 3]  # (recompute, shard): FF, FT, TF, TT
    found = solve(problem)
    (stage,) = found.stages
    assert found.groups == [(0, 1)] and found.recompute == [True] and found.shard == [True]
    assert stage.memory_bytes == pytest.approx(10.5)
    by_groups, _ = _brute_force(problem)
    assert found.step_time_s == pytest.approx(min(by_groups.values()), rel=1e-12)
    pipeline = solve(dataclasses.replace(problem, shard=False))
    assert pipeline.groups == [(0,), (1,)] and found.step_time_s < pipeline.step_time_s


def test_with_plenty_of_memory_sharding_is_chosen_only_when_asked_for():
    # One block on two replicas over a slow link: the all-gather costs 0.5 s and saves nothing needed.
    problem = _pair_problem(100.0, blocks=1, bandwidth=1.0, shard=True)
    free = solve(problem)
    assert free.groups == [(0, 1)] and free.shard == [False] and free.stages[0].allgather_s == 0.0
    forced = solve(dataclasses.replace(problem, shard_all=True))
    (stage,) = forced.stages
    assert forced.groups == [(0, 1)] and forced.shard == [True]
    assert stage.allgather_s == pytest.approx(0.001 + 1 / 2 / 1.0)
    assert forced.step_time_s == pytest.approx(free.step_time_s + stage.allgather_s, rel=1e-12)
    assert forced.simulated_s == pytest.approx(free.simulated_s + stage.allgather_s, rel=1e-12)
    pinned = evaluate(problem, [0, 1], [(0, 1)], shard=[True])  # the same plan, pinned
    assert pinned.stages == forced.stages and pinned.step_time_s == forced.step_time_s


def test_an_infeasible_problem_points_at_sharding():
    problem = _pair_problem(4.5, blocks=1)  # one block: 4 bytes of state + 1 of activations > 4.5
    with pytest.raises(InfeasiblePlanError, match="shard=True"):
        solve(problem)
    problem = _pair_problem(2.5, blocks=1, shard=True)  # sharded: 4 - 1.5 + 1 = 3.5, still 1 B short
    with pytest.raises(InfeasiblePlanError, match="on device g0 and 1 more sharding its optimizer state"):
        solve(problem)


@st.composite
def problems(draw, max_blocks: int = 4, max_devices: int = 4) -> PartitionProblem:
    """Replicas of up to two types (a node each), optimizer state a random part of each block's state,
    memory tight enough that sharding and recomputation matter."""
    n = draw(st.integers(2, max_blocks))
    counts = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2)))]
    while sum(counts) > max_devices:
        counts[counts.index(max(counts))] -= 1
    types = [f"t{k}" for k in range(len(counts))]
    fwd = {t: draw(st.lists(st.floats(0.2, 2.0), min_size=n, max_size=n)) for t in types}
    state = draw(st.lists(st.floats(0.5, 8.0), min_size=n, max_size=n))
    parts = draw(st.lists(st.floats(0.0, 0.9), min_size=n, max_size=n))
    devices = []
    optimizer = [s * p for s, p in zip(state, parts)]
    for t, c in zip(types, counts):  # about what the whole chain needs sharded: sharding decides a group
        memory = sum(state) - draw(st.floats(0.0, 1.0)) * sum(optimizer) / 2 + draw(st.floats(0.5, 4.0))
        devices += [ProblemDevice(f"{t}_{i}", t, memory, f"node_{t}") for i in range(c)]
    d = len(devices)
    inter = draw(st.floats(0.5, 20.0))
    intra = draw(st.floats(0.5, 40.0))
    return PartitionProblem(
        blocks=[f"b{i}" for i in range(n)], fwd_s=fwd, bwd_s={t: [2 * f for f in fwd[t]] for t in types},
        state_bytes=state, act_bytes=draw(st.lists(st.floats(0.2, 3.0), min_size=n, max_size=n)),
        cut_bytes=draw(st.lists(st.floats(0.1, 4.0), min_size=n - 1, max_size=n - 1)), devices=devices,
        bandwidth_bps=[[math.inf if a == b else (intra if devices[a].node == devices[b].node else inter)
                        for b in range(d)] for a in range(d)],
        latency_s=[[0.0 if a == b else 0.01 for b in range(d)] for a in range(d)],
        microbatches=draw(st.integers(1, 5)), schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
        replicate=True, recompute=draw(st.booleans()), param_bytes=[s / 4 for s in state],
        optimizer_bytes=optimizer, shard=True, shard_all=draw(st.integers(0, 3)) == 3,
    )  # fmt: skip


def _brute_force(problem: PartitionProblem):
    """Per group sequence, the least objective over cuts x recompute x shard in the plan space; and
    every feasible plan."""
    n, best, plans = len(problem.blocks), {}, []
    recompute_choices = [True] if problem.recompute_all else [False, True] if problem.recompute else [False]
    for groups in homogeneous_groups(problem):
        if len(groups) > n:
            continue
        shards = itertools.product(*(shard_choices(problem, len(g)) for g in groups))
        key = tuple(groups)
        best[key] = math.inf
        for cuts, flags, shard in itertools.product(
            itertools.combinations(range(1, n), len(groups) - 1),
            list(itertools.product(recompute_choices, repeat=len(groups))),
            list(shards),
        ):
            bounds = [0, *cuts, n]
            t = step_time(problem, bounds, groups, flags, shard)
            if t < math.inf:
                plans.append((bounds, groups, flags, shard))
            best[key] = min(best[key], t)
    return best, plans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_the_dp_and_solve_with_sharding_match_brute_force(problem):
    by_groups, feasible = _brute_force(problem)
    chain = Chain(problem)
    for groups, best in by_groups.items():  # the DP on each sequence of replica groups
        found = solve_sequence(chain, list(groups))
        if best == math.inf:
            assert found is None
            continue
        assert found.step_s == pytest.approx(best, rel=1e-9, abs=1e-12)
        plan = chain.backtrack(chain.stages(list(groups)), found.term_bound_s, found.trip_bound_s, shard=True)
        assert step_time(problem, plan[0], list(groups), *plan[1:]) == pytest.approx(
            best, rel=1e-9, abs=1e-12
        )
    found = solves_like_brute_force(problem, min(by_groups.values()))
    if found is None:
        return
    assert all(s.fits for s in found.stages)
    # The DP shards a stage only where it must (or is told to): what ``evaluate`` chooses for its cuts.
    assert evaluate(problem, found.boundaries, found.groups, found.recompute).shard == found.shard
    bound = lower_bound(problem)
    for bounds, groups, flags, shard in feasible[:: max(1, len(feasible) // 15)]:  # no plan beats the bound
        simulated = simulate(problem, bounds, groups, flags, events=False, shard=shard)
        assert bound <= simulated.step_time_s * (1 + 1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(["1f1b", "gpipe", "zb-h1"]))
def test_sharded_plans_simulate_no_faster_than_the_bound(problem, schedule):
    problem = dataclasses.replace(problem, schedule=schedule, shard_all=False)
    if schedule == "zb-h1":
        problem.wgrad_s = {t: [0.4 * b for b in times] for t, times in problem.bwd_s.items()}
    try:
        solution = solve(problem, rerank=3)
    except InfeasiblePlanError:
        return
    assert solution.simulated_s >= lower_bound(problem) * (1 - 1e-9)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_without_sharding_no_stage_shards(problem, data):
    problem = dataclasses.replace(problem, shard=False, shard_all=False)
    groups = data.draw(st.sampled_from(list(homogeneous_groups(problem))[:40]))
    k = min(len(groups), len(problem.blocks))
    groups = groups[:k]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(problem.blocks) - 1), min_size=k - 1, max_size=k - 1)))
    bounds, flags = [0, *cuts, len(problem.blocks)], [False] * k
    chosen = evaluate(problem, bounds, groups, flags)
    pinned = evaluate(problem, bounds, groups, flags, shard=[False] * k)
    assert chosen.stages == pinned.stages and not any(chosen.shard)
    assert (chosen.step_time_s, chosen.period_s, chosen.lower_bound_s) == (
        pinned.step_time_s,
        pinned.period_s,
        pinned.lower_bound_s,
    )
    # Optimizer bytes change nothing unless replicas may shard.
    plain = dataclasses.replace(problem, optimizer_bytes=None)
    assert lower_bound(plain) == lower_bound(problem)
    assert evaluate(plain, bounds, groups, flags).stages == chosen.stages
