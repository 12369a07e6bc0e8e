"""The planner's step-time model: what one plan costs.

    T = sum_j (T_j + C_j) + (M - 1) * P,    P = max(max_j max(T_j, C_j), max_{j throttled} R_j / q_j)

with T_j the forward+backward seconds of stage j's blocks on its device type (per microbatch) and C_j
the seconds to move the cut activations to the next stage and, when training, their gradients back:
``2 * (latency + x / bandwidth)`` (``latency + x / bandwidth`` for inference; 0 for the last stage).
P is the steady-state period: no stage or link can take less, and a 1F1B stage that may hold only
q_j < M microbatches cannot start them faster than their round trip R_j allows (see ``step_time``).
Stage j fits when ``sum w + inflight_j * sum a <= memory``, inflight_j = M for GPipe and
min(M, K - j) for 1F1B. Inference keeps one microbatch's activations alive (inflight 1).

``evaluate`` scores any plan (the search's winner, the baselines); ``step_time`` is its T.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetcc.errors import PlanFormatError
from hetcc.solver.bound import lower_bound
from hetcc.solver.problem import (
    PartitionProblem,
    PartitionSolution,
    StageCost,
    inflight_microbatches,
    link_time_s,
    round_trip_slots,
)


def evaluate(
    problem: PartitionProblem, boundaries: Sequence[int], devices: Sequence[int]
) -> PartitionSolution:
    """Score one plan: stage k runs blocks ``[boundaries[k], boundaries[k+1])`` on ``devices[k]``.

    Memory that does not fit makes ``step_time_s`` infinite rather than raising, so baselines that
    overflow a device can still be reported. ``period_s`` is the plan's P (see ``step_time``).
    """
    stages = _stage_plans(problem, boundaries, devices)
    step, period = _objective_s(problem, stages)
    bound = lower_bound(problem)
    return PartitionSolution(stages, step, period, bound, _gap(step, bound))


def _stage_plans(problem, boundaries, devices) -> tuple[StageCost, ...]:
    _check_plan(problem, boundaries, devices)
    return tuple(_stage_plan(problem, boundaries, devices, k, len(devices)) for k in range(len(devices)))


def _objective_s(problem: PartitionProblem, stages: tuple[StageCost, ...]) -> tuple[float, float]:
    """(T, P) of a plan; T is infinite when a stage does not fit."""
    k = len(stages)
    slots = [round_trip_slots(problem, j, k) or math.inf for j in range(k)]
    fill_drain, period = step_terms([s.compute_s for s in stages], [s.comm_s for s in stages], slots)
    if not all(s.fits for s in stages):
        return math.inf, period
    return fill_drain + (problem.microbatches - 1) * period, period


def step_terms(
    compute_s: Sequence[float], comm_s: Sequence[float], slots: Sequence[float]
) -> tuple[float, float]:
    """(S, P) of stages with T_j = ``compute_s[j]``, C_j = ``comm_s[j]`` (0 for the last) and round-trip
    slots q_j = ``slots[j]`` (inf where no round trip limits the stage): S = sum_j (T_j + C_j) and
    P = max_j max(T_j, C_j, R_j / q_j), R_j accumulated from the last stage backwards. The one
    place the formula lives: the DP scores its plans with it too."""
    period, round_trip = 0.0, 0.0
    for j in range(len(compute_s) - 1, -1, -1):
        round_trip += compute_s[j] + comm_s[j]
        period = max(period, compute_s[j], comm_s[j], round_trip / slots[j])
    return round_trip, period


def _gap(step_s: float, bound_s: float) -> float:
    return step_s / bound_s - 1 if bound_s > 0 else (0.0 if step_s == 0 else math.inf)


def _stage_plan(problem, boundaries, devices, k: int, num_stages: int) -> StageCost:
    start, stop = boundaries[k], boundaries[k + 1]
    device = problem.devices[devices[k]]
    fwd = math.fsum(problem.fwd_s[device.type][start:stop])
    bwd = math.fsum(problem.bwd_s[device.type][start:stop]) if problem.training else 0.0
    comm = 0.0
    if k + 1 < num_stages:
        comm = link_time_s(problem, devices[k], devices[k + 1], problem.cut_bytes[stop - 1])
    state = math.fsum(problem.state_bytes[start:stop])
    act = math.fsum(problem.act_bytes[start:stop])
    inflight = inflight_microbatches(problem, k, num_stages)
    return StageCost(
        blocks=(start, stop),
        device=devices[k],
        device_name=device.name,
        fwd_s=fwd,
        bwd_s=bwd,
        compute_s=fwd + bwd,
        comm_s=comm,
        state_bytes=state,
        act_bytes=act,
        inflight=inflight,
        memory_bytes=state + inflight * act,
        memory_capacity_bytes=device.memory_bytes,
    )


def _check_plan(problem: PartitionProblem, boundaries: Sequence[int], devices: Sequence[int]) -> None:
    n = len(problem.blocks)
    if len(boundaries) != len(devices) + 1 or not devices:
        raise PlanFormatError(
            f"a plan with {len(devices)} device(s) needs {len(devices) + 1} boundaries, got {len(boundaries)}",
            hint="pass boundaries [0, ..., num_blocks] with one more entry than devices",
        )
    if boundaries[0] != 0 or boundaries[-1] != n or any(a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise PlanFormatError(
            f"boundaries {list(boundaries)} must rise strictly from 0 to {n} (every stage non-empty)",
            hint="give each stage at least one block",
        )
    if len(set(devices)) != len(devices) or not all(0 <= d < len(problem.devices) for d in devices):
        raise PlanFormatError(
            f"devices {list(devices)} must be distinct indices below {len(problem.devices)}",
            hint="use each device at most once",
        )


def step_time(problem: PartitionProblem, boundaries: Sequence[int], devices: Sequence[int]) -> float:
    """The objective T = S + (M - 1) * P of one plan; ``inf`` when a stage does not fit its memory.

    S = sum_j (T_j + C_j) is the time one microbatch needs to cross the pipeline forward and back
    (the fill and drain); every further microbatch adds one steady-state period P. P is the largest
    of three rates, each a lower bound on the spacing of consecutive microbatches:

    - a stage computes one microbatch at a time: P >= T_j;
    - a link carries one transfer at a time in either direction: P >= C_j;
    - round trips (1F1B, training, where q_j = min(M, K - j) < M): stage j starts the forward of
      microbatch m + q_j only after the backward of m, so at most q_j microbatches are between their
      forward's start and their backward's end at stage j. Each spends at least
      R_j = sum_{i >= j} T_i + sum_{j <= i < K-1} C_i there (its forward and backward through every
      later stage and over every later link, one after the other), so by Little's law stage j
      completes at most q_j microbatches per R_j: P >= R_j / q_j.

    GPipe gets no round-trip term: it starts all M forwards without waiting for a backward. Neither
    does a 1F1B stage whose warm-up covers all M microbatches (K - j >= M); S already contains R_j.
    The term matters over slow links, where R_0 / K exceeds every T_j and C_j: four 5.75 ms stages
    over 25 Gb/s Ethernet (C = 1.75, 0.19, 1.75 ms), M = 8, simulate to 75.7 ms; the first two
    terms alone predict 66.9 ms, all three 73.4 ms.
    """
    return _objective_s(problem, _stage_plans(problem, boundaries, devices))[0]
