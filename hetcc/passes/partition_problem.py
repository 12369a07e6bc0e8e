"""Checks and diagnostics for a PartitionProblem: field validation, JSON decoding, memory shortfall."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import numpy as np

from hetcc.errors import PlanFormatError
from hetcc.schedules import SCHEDULES

if TYPE_CHECKING:
    from hetcc.passes.partition import PartitionProblem


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


def problem_from_json(cls, text: str) -> PartitionProblem:
    """Inverse of ``PartitionProblem.to_json`` (``"inf"`` strings become float infinity)."""
    from hetcc.passes.partition import ProblemDevice

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


def tightest_shortfall(problem: PartitionProblem) -> str:
    """Describe the smallest memory overflow found: which blocks, which device, how many bytes short.

    A block that fits no device alone is named directly. Otherwise, devices are taken largest first
    (1F1B's early stages hold the most microbatches) and, for each number of stages, a DP finds the
    cut that minimises the largest overflow; the best such stage is reported.
    """
    from hetcc.passes.partition import inflight_microbatches

    order = sorted(range(len(problem.devices)), key=lambda d: -problem.devices[d].memory_bytes)
    best = None
    for k in range(1, min(len(order), len(problem.blocks)) + 1):
        caps = [problem.devices[d].memory_bytes for d in order[:k]]
        inflight = [inflight_microbatches(problem, j, k) for j in range(k)]
        overflow, stages = _min_max_overflow(problem, caps, inflight)
        if best is None or overflow < best[0]:
            best = (overflow, stages, order[:k])
    overflow, stages, devices = best
    j, (start, stop), used = max(
        ((j, rng, used) for j, (rng, used) in enumerate(stages)),
        key=lambda item: item[2] - problem.devices[devices[item[0]]].memory_bytes,
    )
    device = problem.devices[devices[j]]
    names = (
        problem.blocks[start] if stop - start == 1 else f"{problem.blocks[start]}..{problem.blocks[stop - 1]}"
    )
    return (
        f"the closest plan found still needs {used:.4g} bytes for blocks {names} on device {device.name} "
        f"({device.type}, {device.memory_bytes:.4g} usable): {used - device.memory_bytes:.4g} bytes missing"
    )


def _min_max_overflow(problem, caps: list[float], inflight: list[int]):
    """DP over cuts for a fixed device sequence minimising max_j (memory_j - cap_j)."""
    n = len(problem.blocks)
    w = np.concatenate([[0.0], np.cumsum(problem.state_bytes)])
    a = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
    best = np.full(n + 1, math.inf)
    best[0] = -math.inf
    choice = []
    for cap, q in zip(caps, inflight):
        used = (w[None, :] - w[:, None]) + q * (a[None, :] - a[:, None])  # [start, stop)
        over = np.where(np.triu(np.ones((n + 1, n + 1), bool), 1), used - cap, math.inf)
        total = np.maximum(best[:, None], over)
        choice.append(total.argmin(axis=0))
        best = total.min(axis=0)
    stages, stop = [], n
    for j in range(len(caps) - 1, -1, -1):
        start = int(choice[j][stop])
        used = (w[stop] - w[start]) + inflight[j] * (a[stop] - a[start])
        stages.append(((start, stop), float(used)))
        stop = start
    return float(best[n]), stages[::-1]
