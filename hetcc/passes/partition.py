"""The partition problem: blocks -> stages -> devices, from numbers alone (no torch).

A chain of N blocks is cut into K contiguous stages, each run by its own device. The planner's
step-time model (DESIGN.md, "The partition problem") is

    T = sum_j (T_j + C_j) + (M - 1) * P,    P = max(max_j max(T_j, C_j), max_{j throttled} R_j / q_j)

with T_j the forward+backward seconds of stage j's blocks on its device type (per microbatch) and C_j
the seconds to move the cut activations to the next stage and, when training, their gradients back:
``2 * (latency + x / bandwidth)`` (``latency + x / bandwidth`` for inference; 0 for the last stage).
P is the steady-state period: no stage or link can take less, and a 1F1B stage that may hold only
q_j < M microbatches cannot start them faster than their round trip R_j allows (see ``step_time``).
Stage j fits when ``sum w + inflight_j * sum a <= memory``, inflight_j = M for GPipe and
min(M, K - j) for 1F1B. Inference keeps one microbatch's activations alive (inflight 1).

``solve`` returns the best plan (see ``partition_search`` for the exact method and the heuristic
beyond ``config.exact_order_limit`` device orders); ``evaluate`` scores any plan (baselines use it);
``lower_bound`` is a bound no plan can beat, so every plan reports its gap to it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from hetcc.errors import InfeasiblePlanError, PlanFormatError
from hetcc.schedules import SCHEDULES

# Relative slack on memory capacity, so that a plan filling a device exactly is not lost to rounding.
MEMORY_RTOL = 1e-9


@dataclass(frozen=True)
class ProblemDevice:
    """One device as the solver sees it: usable ``memory_bytes`` after runtime reserves."""

    name: str
    type: str
    memory_bytes: float
    node: str


@dataclass
class PartitionProblem:
    """Everything the solver needs, in seconds and bytes (per microbatch where it says so)."""

    blocks: list[str]
    fwd_s: dict[str, list[float]]
    bwd_s: dict[str, list[float]]
    state_bytes: list[float]
    act_bytes: list[float]
    cut_bytes: list[float]
    devices: list[ProblemDevice]
    bandwidth_bps: list[list[float]]
    latency_s: list[list[float]]
    microbatches: int
    schedule: str = "1f1b"
    training: bool = True

    def validate(self) -> None:
        """Raise PlanFormatError naming the first inconsistent field."""
        from hetcc.passes.partition_problem import validate_problem

        validate_problem(self)

    def block_cost_s(self, device_type: str) -> list[float]:
        """Seconds per microbatch of each block on ``device_type`` (forward, plus backward if training)."""
        if not self.training:
            return list(self.fwd_s[device_type])
        return [f + b for f, b in zip(self.fwd_s[device_type], self.bwd_s[device_type])]

    def to_json(self) -> str:
        data = asdict(self)
        data["bandwidth_bps"] = [[_encode(v) for v in row] for row in self.bandwidth_bps]
        data["latency_s"] = [[_encode(v) for v in row] for row in self.latency_s]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PartitionProblem:
        from hetcc.passes.partition_problem import problem_from_json

        return problem_from_json(cls, text)


def _encode(value: float) -> float | str:
    return "inf" if value == math.inf else value


@dataclass(frozen=True)
class StagePlan:
    """One stage of a plan: its blocks ``[start, stop)``, its device and its costs per microbatch."""

    blocks: tuple[int, int]
    device: int
    device_name: str
    fwd_s: float
    bwd_s: float
    compute_s: float
    comm_s: float
    state_bytes: float
    act_bytes: float
    inflight: int
    memory_bytes: float
    memory_capacity_bytes: float

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_capacity_bytes * (1 + MEMORY_RTOL)


@dataclass(frozen=True)
class PartitionSolution:
    """A plan with its predicted step time, a lower bound no plan beats, and the gap between them.

    ``period_s`` is P, the steady-state seconds per microbatch of the model (``step_time``): at least
    ``bottleneck_s``, more when a 1F1B round trip limits the pipeline.
    """

    stages: tuple[StagePlan, ...]
    step_time_s: float
    period_s: float
    lower_bound_s: float
    gap: float
    exact: bool = True
    orders_searched: int = 1

    @property
    def boundaries(self) -> list[int]:
        return [s.blocks[0] for s in self.stages] + [self.stages[-1].blocks[1]]

    @property
    def devices(self) -> list[int]:
        return [s.device for s in self.stages]

    @property
    def bottleneck_s(self) -> float:
        return max(max(s.compute_s, s.comm_s) for s in self.stages)

    def to_dict(self) -> dict:
        """Plain JSON-able data (infinite step times stay floats; json writes them as Infinity)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PartitionSolution:
        stages = tuple(StagePlan(**{**s, "blocks": tuple(s["blocks"])}) for s in data["stages"])
        known = {f.name for f in fields(cls)} - {"stages"}
        return cls(stages=stages, **{k: data[k] for k in known if k in data})


def inflight_microbatches(problem: PartitionProblem, stage: int, num_stages: int) -> int:
    """Microbatches whose saved activations stage ``stage`` holds at its peak."""
    if not problem.training:
        return 1
    if problem.schedule == "gpipe":
        return problem.microbatches
    return min(problem.microbatches, num_stages - stage)


def round_trip_slots(problem: PartitionProblem, stage: int, num_stages: int) -> int | None:
    """q_j when stage ``stage`` must finish a backward before it may start another forward, else None.

    That is a training 1F1B stage whose in-flight limit min(M, K - j) is below M. GPipe stages, stages
    whose warm-up already covers all M microbatches, and inference never wait on a backward.
    """
    inflight = inflight_microbatches(problem, stage, num_stages)
    if problem.training and problem.schedule == "1f1b" and inflight < problem.microbatches:
        return inflight
    return None


def link_time_s(problem: PartitionProblem, src: int, dst: int, nbytes: float) -> float:
    """C_j: activations forward and (training) gradients back over the src -> dst link."""
    one_way = problem.latency_s[src][dst] + nbytes / problem.bandwidth_bps[src][dst]
    return 2 * one_way if problem.training else one_way


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


def _stage_plans(problem, boundaries, devices) -> tuple[StagePlan, ...]:
    _check_plan(problem, boundaries, devices)
    return tuple(_stage_plan(problem, boundaries, devices, k, len(devices)) for k in range(len(devices)))


def _objective_s(problem: PartitionProblem, stages: tuple[StagePlan, ...]) -> tuple[float, float]:
    """(T, P) of a plan; T is infinite when a stage does not fit."""
    period = max(max(s.compute_s, s.comm_s) for s in stages)
    round_trip = 0.0  # R_j, accumulated from the last stage backwards
    for j in range(len(stages) - 1, -1, -1):
        round_trip += stages[j].compute_s + stages[j].comm_s  # comm_s of the last stage is 0
        slots = round_trip_slots(problem, j, len(stages))
        if slots is not None:
            period = max(period, round_trip / slots)
    if not all(s.fits for s in stages):
        return math.inf, period
    return round_trip + (problem.microbatches - 1) * period, period


def _gap(step_s: float, bound_s: float) -> float:
    return step_s / bound_s - 1 if bound_s > 0 else (0.0 if step_s == 0 else math.inf)


def _stage_plan(problem, boundaries, devices, k: int, num_stages: int) -> StagePlan:
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
    return StagePlan(
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


def solve(problem: PartitionProblem) -> PartitionSolution:
    """The plan of least step time (exact per device order; see ``partition_search.search``)."""
    from hetcc.passes.partition_search import search

    problem.validate()
    found = search(problem)
    if found is None:
        raise _infeasible_error(problem)
    boundaries, devices, exact, orders = found
    plan = evaluate(problem, boundaries, devices)
    return replace(plan, exact=exact, orders_searched=orders)


def _infeasible_error(problem: PartitionProblem) -> InfeasiblePlanError:
    from hetcc.passes.partition_problem import tightest_shortfall

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


__all__ = [
    "SCHEDULES",
    "PartitionProblem",
    "PartitionSolution",
    "ProblemDevice",
    "StagePlan",
    "evaluate",
    "lower_bound",
    "round_trip_slots",
    "solve",
    "step_time",
]
