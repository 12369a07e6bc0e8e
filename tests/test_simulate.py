"""The event-driven simulator: closed forms, causality of its timeline, agreement with the planner."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from hetcc.errors import PlanFormatError
from hetcc.solver.baselines import baselines
from hetcc.solver.interleave import interleave
from hetcc.solver.objective import evaluate, stage_costs
from hetcc.solver.problem import PartitionProblem, ProblemDevice
from hetcc.solver.schedules import ZBV, interleaved_actions
from hetcc.solver.simulate import simulate, step_floor
from hetcc.solver.solve import solve


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


# Worst planner/simulator disagreement measured on these problems: GPipe 0%, 1F1B 5.2%.
@pytest.mark.parametrize(("schedule", "tolerance"), [("gpipe", 0.01), ("1f1b", 0.06)])
def test_simulator_agrees_with_the_planner(schedule, tolerance):
    for seed in range(4):
        for microbatches in (2, 6, 12):
            problem = mixed_problem(seed, schedule, microbatches)
            plans = [solve(problem), *baselines(problem).values()]
            for plan in plans:
                sim = simulate(problem, plan.boundaries, plan.devices)
                assert sim.step_time_s == pytest.approx(plan.step_time_s, rel=tolerance)


def slow_link_problem(schedule: str, microbatches: int) -> PartitionProblem:
    """A100 -> T4 -> T4 -> A100, one 5.75 ms block each; 25 Gb/s Ethernet between the two nodes."""
    devices = [
        ProblemDevice("a100-0", "A100", 1e12, "a"),
        ProblemDevice("t4-0", "T4", 1e12, "t"),
        ProblemDevice("t4-1", "T4", 1e12, "t"),
        ProblemDevice("a100-1", "A100", 1e12, "a"),
    ]
    return PartitionProblem(
        blocks=[f"layer{i}" for i in range(4)],
        fwd_s={t: [5.75e-3 / 3] * 4 for t in ("A100", "T4")},
        bwd_s={t: [2 * 5.75e-3 / 3] * 4 for t in ("A100", "T4")},
        state_bytes=[0.0] * 4,
        act_bytes=[0.0] * 4,
        cut_bytes=[2.7e6, 17e6, 2.7e6],
        devices=devices,
        bandwidth_bps=[
            [math.inf if a is b else (200e9 if a.node == b.node else 25e9 / 8) for b in devices]
            for a in devices
        ],
        latency_s=[[0.0 if a is b else 1e-5 for b in devices] for a in devices],
        microbatches=microbatches,
        schedule=schedule,
    )


def test_a_link_carries_one_transfer_at_a_time_in_each_direction():
    """Links are full duplex (a cluster's bandwidths are per direction): over the 25 Gb/s link between
    stage 0 and stage 1 an activation forward and a gradient back travel at once, while each direction
    carries its transfers one after another."""
    sim = simulate(slow_link_problem("1f1b", 8), [0, 1, 2, 3, 4], [(0,), (1,), (2,), (3,)])
    forward = sorted((e.start_s, e.end_s) for e in sim.events if e.kind == "SEND_F" and e.stage == 0)
    back = sorted((e.start_s, e.end_s) for e in sim.events if e.kind == "SEND_B" and e.stage == 1)
    for sends in (forward, back):
        assert len(sends) == 8 and all(a[1] <= b[0] + 1e-12 for a, b in zip(sends, sends[1:]))
    assert any(f[0] < b[1] and b[0] < f[1] for f in forward for b in back)


def test_round_trips_over_slow_links_are_in_the_1f1b_step_time():
    problem = slow_link_problem("1f1b", 8)
    plan = evaluate(problem, [0, 1, 2, 3, 4], [0, 1, 2, 3])
    sim = simulate(problem, plan.boundaries, plan.devices)
    # C = 1.75, 0.19, 1.75 ms: no stage or link is busier than 5.75 ms, but stage 0 may hold only 4
    # microbatches and each spends 4 * 5.75 + 3.68 ms in the pipeline: P = 6.67 ms.
    assert plan.period_s == pytest.approx((4 * 5.75e-3 + sum(s.comm_s for s in plan.stages)) / 4)
    without_round_trips = plan.step_time_s - 7 * (plan.period_s - plan.bottleneck_s)
    assert abs(without_round_trips / sim.step_time_s - 1) > 0.05  # 7.7%: 66.9 against 72.6 ms
    assert sim.step_time_s == pytest.approx(plan.step_time_s, rel=0.02)  # 73.4 ms
    gpipe = slow_link_problem("gpipe", 8)
    plan = evaluate(gpipe, [0, 1, 2, 3, 4], [0, 1, 2, 3])
    assert plan.period_s == plan.bottleneck_s
    assert simulate(gpipe, plan.boundaries, plan.devices).step_time_s == pytest.approx(
        plan.step_time_s, rel=0.01
    )


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


def test_a_weight_tied_across_stages_is_summed_over_its_holders_at_step_end():
    problem = homogeneous(3, 4, "1f1b")
    problem.bandwidth_bps = [[math.inf if a == b else 1e9 for b in range(3)] for a in range(3)]
    problem.tied_blocks, problem.tied_bytes = [[0, 1, 2]], [1.5e9]  # used by every stage
    untied = simulate(homogeneous(3, 4, "1f1b"), [0, 1, 2, 3], [0, 1, 2])
    tied = simulate(problem, [0, 1, 2, 3], [0, 1, 2])
    # three holders sum by a ring once all are done: 2 x (3 - 1) steps of 0.5 GB over 1 GB/s
    assert tied.step_time_s == pytest.approx(untied.step_time_s + 2.0)
    sums = [e for e in tied.events if e.kind == "ALLREDUCE"]
    assert sorted(e.stage for e in sums) == [0, 1, 2] and all(e.end_s == tied.step_time_s for e in sums)
    one_stage = simulate(problem, [0, 3], [0])  # one holder: nothing to sum
    assert not any(e.kind == "ALLREDUCE" for e in one_stage.events)


@pytest.mark.parametrize(
    ("nbytes", "lookups", "step"),
    [
        (1e9, None, 18.0 + 1.0),  # the head's part arrives while stage 0 computes (14 + 1 s); 1 GB back
        (1e9, 1e7, 18.0 + 0.04),  # stage 0 looked up 10 MB of rows a microbatch: 4 x 10 MB back
        (5e9, 1e7, 14.0 + 5.0 + 0.04),  # 5 GB: the head's part arrives after stage 0 is done
    ],
)
def test_two_holders_exchange_a_tied_gradient_the_owner_sending_its_rows_back(nbytes, lookups, step):
    problem = homogeneous(3, 4, "1f1b")  # 1F1B of F = 1, B = 2: stage 2 ends at 14 s, stage 0 at 18 s
    problem.bandwidth_bps = [[math.inf if a == b else 1e9 for b in range(3)] for a in range(3)]
    problem.tied_blocks, problem.tied_bytes = [[0, 2]], [nbytes]  # an embedding tied to the head
    problem.tied_grad_bytes = [[lookups, nbytes]] if lookups else None  # the head reads it whole
    sim = simulate(problem, [0, 1, 2, 3], [0, 1, 2])
    assert sim.step_time_s == pytest.approx(step)
    sums = sorted((e for e in sim.events if e.kind == "ALLREDUCE"), key=lambda e: e.stage)
    assert [e.stage for e in sums] == [0, 2] and all(e.end_s == pytest.approx(step) for e in sums)
    assert step_floor(problem, stage_costs(problem, [0, 1, 2, 3], [0, 1, 2])) <= sim.step_time_s + 1e-9


def test_a_skip_tensor_goes_from_its_producer_straight_to_its_consumer():
    problem = homogeneous(3, 1, "1f1b")
    problem.bandwidth_bps = [[math.inf if a == b else 1.0 for b in range(3)] for a in range(3)]
    problem.cut_bytes = [101.0, 101.0]  # the chain model: the skip charged on both links
    chained = simulate(problem, [0, 1, 2, 3], [0, 1, 2])
    problem.cut_tensors = [[0, [1], 1.0, 1.0], [1, [2], 1.0, 1.0], [0, [2], 100.0, 100.0]]
    direct = simulate(problem, [0, 1, 2, 3], [0, 1, 2])

    def first(sim, stage, kind):
        return next(e for e in sim.events if e.stage == stage and e.kind == kind)

    assert first(chained, 1, "F").start_s == 1.0 + 101.0
    assert first(direct, 1, "F").start_s == 1.0 + 1.0  # only its own input crosses the first link
    # stage 2 waits for the skip sent by stage 0 (100 s from t = 1), not for a relay through stage 1
    assert first(direct, 2, "F").start_s == 1.0 + 100.0
    sends = [(e.stage, e.start_s, e.end_s) for e in direct.events if e.kind == "SEND_F"]
    assert (0, 1.0, 101.0) in sends or (0, 2.0, 102.0) in sends  # one link per pair: 0->1 and 0->2
    assert direct.step_time_s < chained.step_time_s


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 5), (4, 4), (4, 8), (6, 16), (8, 8)])
def test_zb_h1_on_equal_stages_has_a_third_of_1f1bs_bubble(stages, microbatches):
    """F = B = W = 1 (a backward of 2 whose weight gradient is half): 1F1B takes 3M + 3(p - 1) units,
    ZB-H1 3M + (p - 1), the paper's (p - 1) / 3M bubble against 1F1B's (p - 1) / M (Qi et al., sec. 3)."""
    one_f_one_b, zb = (homogeneous(stages, microbatches, schedule) for schedule in ("1f1b", "zb-h1"))
    zb.wgrad_s = {"t": [1.0] * stages}
    bounds, devices = list(range(stages + 1)), list(range(stages))
    m, p = microbatches, stages
    assert simulate(one_f_one_b, bounds, devices).step_time_s == pytest.approx(3 * m + 3 * (p - 1))
    sim = simulate(zb, bounds, devices)
    assert sim.step_time_s == pytest.approx(3 * m + (p - 1))
    assert sim.busy_s == tuple([3.0 * m] * p)  # the same work, split in B and W
    kinds = {e.kind for e in sim.events if e.stage == p - 1}
    assert {"F", "B", "W"} <= kinds and not any(e.kind == "W" for e in sim.events if e.stage == 0)
    # the whole backward as B (nothing split): zb-h1's order is 1F1B's
    zb.wgrad_s = None
    assert simulate(zb, bounds, devices).step_time_s == pytest.approx(3 * m + 3 * (p - 1))


def test_a_recomputing_stage_runs_its_backward_whole_under_zb_h1():
    problem = homogeneous(4, 8, "zb-h1")
    problem.wgrad_s = {"t": [1.0] * 4}
    sim = simulate(problem, list(range(5)), list(range(4)), recompute=[False, False, True, False])
    assert not any(e.kind == "W" for e in sim.events if e.stage in (0, 2))
    assert all(
        e.end_s - e.start_s == pytest.approx(3.0) for e in sim.events if e.stage == 2 and e.kind == "B"
    )
    assert sum(e.kind == "W" for e in sim.events) == 2 * 8


def test_zb_h1_defers_only_the_weight_gradients_each_stages_memory_holds():
    """Stage s of 4 holds 1F1B's 4 - s microbatches and one more: ZB-H1 would defer s weight gradients
    (stage 3 holding 4), so the plan defers min(s, 1) (the most that fits, found by bisection), each
    stage fits, and the step lies between 1F1B's and unlimited ZB-H1's."""
    stages, m = 4, 8
    problem = homogeneous(stages, m, "zb-h1")
    problem.wgrad_s = {"t": [1.0] * stages}
    problem.act_bytes = [1.0] * stages
    roomy = dataclasses.replace(problem)
    problem.devices = [
        dataclasses.replace(d, memory_bytes=stages - s + 1.0) for s, d in enumerate(problem.devices)
    ]
    bounds, devices = list(range(stages + 1)), list(range(stages))
    plan = evaluate(problem, bounds, devices)
    assert [s.deferred for s in plan.stages] == [0, 1, 1, 1]
    assert [s.inflight for s in plan.stages] == [4, 4, 3, 2] and all(s.fits for s in plan.stages)
    assert [s.deferred for s in evaluate(roomy, bounds, devices).stages] == [0, 1, 2, 3]
    capped = simulate(problem, bounds, devices)
    held = {}
    for e in sorted(capped.events, key=lambda e: (e.start_s, e.kind != "F")):  # the simulator runs them
        if e.kind in "FW" and e.stage > 0:
            held[e.stage] = held.get(e.stage, 0) + (1 if e.kind == "F" else -1)
            assert held[e.stage] <= stages - e.stage + 1
    one_f_one_b = simulate(dataclasses.replace(problem, schedule="1f1b"), bounds, devices).step_time_s
    unlimited = simulate(roomy, bounds, devices).step_time_s
    assert unlimited < capped.step_time_s < one_f_one_b
    # the search checks memory at 1F1B's depth: zb-h1 plans whatever 1F1B plans
    assert solve(problem).stages[-1].fits


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 5), (4, 8), (6, 16)])
def test_zb_h2_on_equal_stages_takes_what_a_synchronous_step_must(stages, microbatches):
    """F = B = W = 1: ZB-H2 takes 3M + (p - 1) units, the least any schedule takes when the step ends
    together (the last stage's first forward waits for p - 1 others, then it has 3M units of work); the
    paper's zero bubble also lets each stage's optimizer step start early, which hetcc does not. Each
    stage holds up to 2(p - s) - 1 microbatches and its deferred W's (ZB-H1: p), fewer where memory is
    short: ZB-H1's W's first, then the extra forwards."""
    zb = homogeneous(stages, microbatches, "zb-h2")
    zb.wgrad_s = {"t": [1.0] * stages}
    bounds, devices = list(range(stages + 1)), list(range(stages))
    m, p = microbatches, stages
    assert simulate(zb, bounds, devices).step_time_s == pytest.approx(3 * m + (p - 1))
    assert [s.inflight for s in evaluate(zb, bounds, devices).stages] == [
        min(m, 2 * (p - s) - 1 + s) if s else min(m, 2 * p - 1) for s in range(p)
    ]
    # room for ZB-H1's p microbatches only: memory goes to ZB-H1's deferred W's first, so no stage warms
    # up with more than 1F1B's; with room for one more, the stages that can take one more do
    zb.act_bytes = [1.0] * stages
    zb.devices = [dataclasses.replace(d, memory_bytes=float(p)) for d in zb.devices]
    capped = evaluate(zb, bounds, devices)
    assert [s.warmup for s in capped.stages] == [min(m, p - s) for s in range(p)]
    assert [s.deferred for s in capped.stages] == list(range(p)) and all(s.fits for s in capped.stages)
    zb.devices = [dataclasses.replace(d, memory_bytes=p + 1.0) for d in zb.devices]
    roomier = evaluate(zb, bounds, devices)
    assert [s.warmup for s in roomier.stages] == [min(m, p - s + 1, 2 * (p - s) - 1) for s in range(p)]
    assert all(s.fits and s.inflight <= p + 1 for s in roomier.stages)


def test_the_refinement_warms_a_stage_up_to_hide_a_slow_link():
    """Two stages over a link that takes as long as a forward: the first stage warming up with every
    microbatch sends them while the second computes, and the refinement finds that warm-up."""
    problem = homogeneous(2, 8, "1f1b")
    problem.cut_bytes = [1.0]
    problem.bandwidth_bps = [[math.inf, 1.0], [1.0, math.inf]]
    default = simulate(problem, [0, 1, 2], [0, 1]).step_time_s
    found = solve(problem, rerank=2)
    assert found.warmup[0] > 2 and found.simulated_s < default
    assert found.simulated_s == pytest.approx(
        simulate(problem, found.boundaries, found.groups, found.recompute, warmup=found.warmup).step_time_s
    )


def _on_devices(problem: PartitionProblem, count: int) -> PartitionProblem:
    """``problem`` on its first ``count`` devices."""
    return dataclasses.replace(
        problem,
        devices=problem.devices[:count],
        bandwidth_bps=[row[:count] for row in problem.bandwidth_bps[:count]],
        latency_s=[row[:count] for row in problem.latency_s[:count]],
    )


@pytest.mark.parametrize(
    ("ranks", "chunks", "microbatches"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 2, 2), (4, 4, 16)]
)
def test_interleaved_1f1b_on_equal_chunks_has_1f1bs_bubble_over_v(ranks, chunks, microbatches):
    """p devices holding v one-block chunks each (F = 1, B = 2 a block): interleaved 1F1B takes
    3vM + 3(p - 1), 1F1B on v-block stages 3v(M + p - 1): the bubble over v (Narayanan et al., sec. 2.2),
    each device idle 3(p - 1); in inference vM + p - 1 forwards."""
    k = ranks * chunks
    problem = _on_devices(homogeneous(k, microbatches, "1f1b"), ranks)
    bounds, devices = list(range(k + 1)), [j % ranks for j in range(k)]
    sim = simulate(problem, bounds, devices, chunks=chunks)
    assert sim.step_time_s == pytest.approx(3 * chunks * microbatches + 3 * (ranks - 1))
    assert sim.busy_s == tuple([3.0 * microbatches] * k)
    # a stage's bubble is its device's idle, shared by the device's chunks: 3(p - 1) of the step
    idle = 3 * (ranks - 1) / sim.step_time_s
    assert sim.bubble_fraction == pytest.approx([idle] * k) and sim.overall_bubble_fraction == pytest.approx(
        idle
    )
    plain = simulate(problem, list(range(0, k + 1, chunks)), list(range(ranks)))
    assert plain.step_time_s == pytest.approx(3 * chunks * (microbatches + ranks - 1))
    for device in {e.device for e in sim.events}:  # a device runs one of its chunks' actions at a time
        mine = sorted((e.start_s, e.end_s) for e in sim.events if e.device == device and e.kind in "FB")
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
    inference = dataclasses.replace(problem, training=False)
    assert simulate(inference, bounds, devices, chunks=chunks).step_time_s == pytest.approx(
        chunks * microbatches + ranks - 1
    )


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_zbv_on_equal_stages_leaves_p_minus_1_idle_steps(ranks):
    """ZB-V (two one-block stages per device in a V, F = B = W = 1 a block, the first stage's backward
    whole): 6M + p - 1 once M >= 2p - 1, 6M + 4(p - 1) - 2(M - 1) below, as its unit-step replay
    (``grid.unit_step_timeline``) gives; the same stages under 1F1B take 6M + 6(p - 1)."""
    k = 2 * ranks
    problem = _on_devices(homogeneous(k, 1, ZBV), ranks)
    problem.wgrad_s = {"t": [1.0] * k}
    v = [min(j, k - 1 - j) for j in range(k)]
    for m in (ranks, 2 * ranks - 1, 3 * ranks):
        sim = simulate(dataclasses.replace(problem, microbatches=m), list(range(k + 1)), v, chunks=2)
        idle = ranks - 1 if m >= 2 * ranks - 1 else 4 * (ranks - 1) - 2 * (m - 1)
        assert sim.step_time_s == pytest.approx(6 * m + idle)
        assert {e.kind for e in sim.events if e.stage > 0} >= {"F", "B", "W"}


def test_an_interleaved_device_holds_every_chunks_state_and_its_orders_activations():
    """Each chunk's stage reports its device's memory: the state of all its chunks and the most
    activation bytes its order holds at once; a plan whose chunks do not take turns on one device each
    is refused, as is a schedule other than 1f1b."""
    ranks, chunks, microbatches = 2, 2, 4
    problem = _on_devices(homogeneous(ranks * chunks, microbatches, "1f1b"), ranks)
    problem = dataclasses.replace(
        problem, state_bytes=[1.0, 2.0, 4.0, 8.0], act_bytes=[0.5, 0.25, 0.125, 1.0]
    )
    bounds, devices = [0, 1, 2, 3, 4], [0, 1, 0, 1]
    stages = stage_costs(problem, bounds, devices, chunks=chunks)
    held = {}  # per (rank, chunk): the most microbatches its order holds, and the order's peak bytes
    for rank, order in enumerate(interleaved_actions(ranks, chunks, microbatches)):
        live = peak = 0.0
        for action in order:
            live += (1 if action.kind == "F" else -1) * problem.act_bytes[action.chunk * ranks + rank]
            peak = max(peak, live)
        state = sum(problem.state_bytes[rank::ranks])
        for j in (rank, rank + ranks):
            assert stages[j].memory_bytes == pytest.approx(state + peak), (rank, j)
        held[rank] = peak
    assert held[0] < 4 * (0.5 + 4 * 0.125)  # fewer than every microbatch of both chunks at once
    assert [s.inflight for s in stages] == [4, 3, 2, 1]  # K - j microbatches, as 1F1B over K stages holds
    inference = stage_costs(dataclasses.replace(problem, training=False), bounds, devices, chunks=chunks)
    assert [s.inflight for s in inference] == [1] * 4  # one microbatch at a time, its larger chunk's bytes
    assert inference[0].memory_bytes == inference[2].memory_bytes == pytest.approx(1.0 + 4.0 + 0.5)
    for bad_devices, schedule in (
        ([0, 1, 1, 0], "1f1b"),
        ([0, 1, 0, 1], "zb-h1"),
        ([(0, 1), 1, (0, 1), 1], "1f1b"),
    ):
        with pytest.raises(PlanFormatError, match="interleaved"):
            stage_costs(dataclasses.replace(problem, schedule=schedule), bounds, bad_devices, chunks=chunks)


def test_interleave_sizes_chunks_to_their_devices_and_respects_memory():
    """``interleave`` over p devices: on equal devices and blocks the chunks come out equal (the closed
    form above, two blocks a chunk); on a device twice as fast, its chunks hold twice the blocks; where
    memory is short, the plan returned fits; too few blocks or microbatches are named."""
    ranks, chunks, microbatches = 2, 2, 4
    problem = _on_devices(homogeneous(8, microbatches, "1f1b"), ranks)
    cuts, step_s, recompute = interleave(problem, [0, 1], chunks)
    assert cuts == [0, 2, 4, 6, 8] and recompute == (False,) * 4
    assert step_s == pytest.approx(2 * (3 * chunks * microbatches + 3 * (ranks - 1)))
    twelve = _on_devices(homogeneous(12, microbatches, "1f1b"), ranks)
    fast = dataclasses.replace(
        twelve,
        devices=[twelve.devices[0], dataclasses.replace(twelve.devices[1], type="fast")],
        fwd_s={**twelve.fwd_s, "fast": [0.5] * 12},
        bwd_s={**twelve.bwd_s, "fast": [1.0] * 12},
        state_bytes=[1.0] * 12,
    )
    cuts, roomy_s, _ = interleave(fast, [0, 1], chunks)
    assert cuts == [0, 2, 6, 8, 12]  # device 1, twice as fast, holds twice the blocks in each chunk
    short = [dataclasses.replace(d, memory_bytes=6.5) for d in fast.devices]  # 8 blocks' state do not fit
    tight = dataclasses.replace(fast, devices=short)
    cuts, step_s, _ = interleave(tight, [0, 1], chunks)
    assert all(s.fits for s in stage_costs(tight, cuts, [0, 1, 0, 1], chunks=chunks)) and step_s > roomy_s
    for count, m in ((5, 4), (2, 1)):  # 10 chunks of 8 blocks; 1 microbatch over 2 devices
        with pytest.raises(PlanFormatError, match="interleaving"):
            interleave(dataclasses.replace(problem, microbatches=m), [0, 1], count)


def test_interleave_recomputes_the_chunks_of_a_device_whose_memory_needs_it():
    """Eight one-unit blocks in two chunks on each of two devices; device 0 holds 3 bytes, too few for the
    activations its order keeps, so its chunks recompute (keeping only their inputs) and device 1's do
    not; without recomputation nothing fits, and recomputing everywhere costs more."""
    problem = _on_devices(homogeneous(8, 4, "1f1b"), 2)
    devices = [dataclasses.replace(problem.devices[0], memory_bytes=3.0), problem.devices[1]]
    problem = dataclasses.replace(problem, act_bytes=[1.0] * 8, cut_bytes=[0.01] * 7, recompute=True,
                                  devices=devices)  # fmt: skip
    cuts, step_s, recompute = interleave(problem, [0, 1], 2)
    assert recompute == (True, False, True, False)
    assert all(s.fits for s in stage_costs(problem, cuts, [0, 1, 0, 1], list(recompute), chunks=2))
    roomy = [dataclasses.replace(d, memory_bytes=1e12) for d in devices]
    roomy_s = interleave(dataclasses.replace(problem, devices=roomy), [0, 1], 2).step_s
    everywhere = interleave(dataclasses.replace(problem, recompute_all=True), [0, 1], 2)
    assert roomy_s < step_s < everywhere.step_s and everywhere.recompute == (True,) * 4
    assert interleave(dataclasses.replace(problem, recompute=False), [0, 1], 2).step_s == math.inf
