"""The partition problem: blocks -> stages -> devices, from numbers alone (no torch).

A chain of N blocks is cut into K contiguous stages, each run by its own device. ``PartitionProblem``
holds every number the solver needs (per-block seconds per device type, state and activation bytes,
cut bytes, device memory, link bandwidth and latency); it round-trips through JSON exactly, so an outside
planner can be fed the same numbers. ``StageCost`` and ``PartitionSolution`` are what a plan costs; the
model behind those costs is ``solver.objective``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from hetcc.errors import PlanFormatError
from hetcc.solver.schedules import SCHEDULES

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
        """Inverse of ``to_json`` (``"inf"`` strings become float infinity), validated."""
        try:
            data = json.loads(text)
            data["devices"] = [ProblemDevice(**dev) for dev in data["devices"]]
            for key in ("bandwidth_bps", "latency_s"):
                data[key] = [[math.inf if v == "inf" else v for v in row] for row in data[key]]
            problem = cls(**data)
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanFormatError(
                f"not a partition problem: {exc}", hint="write it with PartitionProblem.to_json"
            ) from exc
        problem.validate()
        return problem


def _encode(value: float) -> float | str:
    return "inf" if value == math.inf else value


@dataclass(frozen=True)
class StageCost:
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

    stages: tuple[StageCost, ...]
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
        stages = tuple(StageCost(**{**s, "blocks": tuple(s["blocks"])}) for s in data["stages"])
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


def _fail(field: str, reason: str, hint: str) -> PlanFormatError:
    return PlanFormatError(f"partition problem field {field!r}: {reason}", hint=hint)


def validate_problem(problem: PartitionProblem) -> None:
    """Raise PlanFormatError naming the first field whose length or values are inconsistent."""
    n, d = len(problem.blocks), len(problem.devices)
    if n == 0 or d == 0:
        raise _fail("blocks" if n == 0 else "devices", "is empty", "a problem needs blocks and devices")
    if problem.schedule not in SCHEDULES:
        raise _fail(
            "schedule", f"unknown schedule {problem.schedule!r}", f"use one of {', '.join(SCHEDULES)}"
        )
    m = problem.microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise _fail("microbatches", f"must be a positive integer, got {m!r}", "pass microbatches >= 1")
    _check_vector("state_bytes", problem.state_bytes, n)
    _check_vector("act_bytes", problem.act_bytes, n)
    _check_vector("cut_bytes", problem.cut_bytes, n - 1)
    for device in problem.devices:
        for table in ("fwd_s", "bwd_s"):
            if device.type not in getattr(problem, table):
                raise _fail(
                    table,
                    f"has no entry for device type {device.type!r} ({device.name})",
                    "cost every block on every device type in the cluster",
                )
            _check_vector(f"{table}[{device.type!r}]", getattr(problem, table)[device.type], n)
        if not device.memory_bytes >= 0:
            raise _fail(
                "devices",
                f"{device.name}: memory_bytes {device.memory_bytes!r} is negative",
                "give usable memory in bytes",
            )
    if len({dev.name for dev in problem.devices}) != d:
        raise _fail("devices", "device names repeat", "name every device uniquely")
    _check_matrix("bandwidth_bps", problem.bandwidth_bps, d, positive=True)
    _check_matrix("latency_s", problem.latency_s, d, positive=False)


def _check_vector(field: str, values, length: int) -> None:
    if len(values) != length:
        raise _fail(
            field, f"has {len(values)} entries, expected {length}", "one entry per block (cuts: blocks - 1)"
        )
    for i, v in enumerate(values):
        if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
            raise _fail(field, f"entry {i} is {v!r}", "use finite, non-negative numbers")


def _check_matrix(field: str, rows, size: int, *, positive: bool) -> None:
    if len(rows) != size or any(len(r) != size for r in rows):
        raise _fail(
            field, f"must be {size}x{size} (one row and column per device)", "rebuild it from the cluster"
        )
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            ok = (v > 0) if positive else (0 <= v < math.inf)
            if i != j and not ok:
                raise _fail(
                    field, f"entry [{i}][{j}] is {v!r}", "bandwidths must be > 0, latencies finite >= 0"
                )
