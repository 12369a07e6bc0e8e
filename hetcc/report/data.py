"""What a report or a timeline needs, read from a saved folder (``plan.json`` through ``read_plan``,
``problem.json``, ``cluster.json``).

Plans of older hetcc versions read as ``Plan.from_json`` reads them: fields a version lacks (replica
groups, recompute, precision, the simulated step) take their defaults and are simply not shown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetcc.errors import HetccError, PlanFormatError
from hetcc.plan import Plan, PlanStage, read_plan, read_saved, recorded_warmup
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.tensor import composite_problem, group_name

CLUSTER_FILE = "cluster.json"  # the cluster the plan was made for, as Cluster.to_spec() writes it


@dataclass
class SavedPlan:
    """A build or dump folder's plan, the problem it solved, and (when saved) the cluster."""

    folder: Path
    plan: Plan
    problem: PartitionProblem
    cluster: dict[str, Any] | None = None
    simulation: Any = None  # hetcc.solver.simulate.Simulation, or None when it could not be replayed
    simulation_error: str | None = None
    baselines: dict[str, Any] = field(default_factory=dict)  # name -> PartitionSolution

    @property
    def stages(self) -> tuple[PlanStage, ...]:
        return self.plan.stages

    @property
    def rows(self) -> dict[tuple[int, int], str]:
        """(stage, replica) -> device name (a tensor group's names joined): one timeline row each."""
        return {
            (s.index, r): group_name(s.devices[i : i + s.tensor])
            for s in self.stages
            for r, i in enumerate(range(0, len(s.devices), s.tensor))
        }

    @property
    def used_devices(self) -> dict[str, int]:
        """Device name -> the stage it runs."""
        return {name: s.index for s in self.stages for name in s.devices}


def load(folder: str | Path) -> SavedPlan:
    """Read a folder written by ``hetcc compile`` (build folder or dump folder)."""
    folder = Path(folder)
    plan = read_plan(folder)
    problem = read_problem(folder)
    cluster_path = folder / CLUSTER_FILE
    cluster = _read_json(cluster_path) if cluster_path.exists() else None
    saved = SavedPlan(folder, plan, problem, cluster)
    try:
        saved.simulation = simulate_plan(plan, problem)
    except (HetccError, ValueError, KeyError, IndexError, TypeError) as exc:
        saved.simulation_error = f"{type(exc).__name__}: {exc}"
    try:
        from hetcc.solver.baselines import baselines

        saved.baselines = baselines(problem)
    except (HetccError, ValueError) as exc:  # a report without the per-stage baseline chart
        saved.simulation_error = saved.simulation_error or f"baselines: {exc}"
    return saved


def simulate_plan(plan: Plan, problem: PartitionProblem):
    """The event-driven replay (``hetcc.solver.simulate``) of a saved plan's stages: each on its replica
    group, recomputing where the plan says so, with the codecs it chose."""
    from hetcc.solver.simulate import simulate

    codecs = [s.codecs for s in plan.stages] if problem.codecs is not None else None
    solved = solved_problem(plan.stages, problem)
    return simulate(
        solved, *plan_layout(plan.stages, solved), codecs=codecs, warmup=recorded_warmup(plan.stages),
        chunks=plan.chunks,
    )  # fmt: skip


def solved_problem(stages: Sequence[PlanStage], problem: PartitionProblem) -> PartitionProblem:
    """``problem`` as the plan solved it: with tensor-parallel stages, its composite problem at their
    degrees (``solver.tensor.composite_problem``: each group of t devices is one device)."""
    by_name = {d.name: d for d in problem.devices}
    assignment = {}
    for stage in stages:
        if stage.tensor > 1:
            if stage.devices[0] not in by_name:
                raise PlanFormatError(
                    f"stage {stage.index}'s device {stage.devices[0]!r} is not in problem.json"
                )
            device = by_name[stage.devices[0]]
            assignment[device.type, device.memory_bytes] = stage.tensor
    return composite_problem(problem, assignment)[0] if assignment else problem


def plan_layout(stages: Sequence[PlanStage], problem: PartitionProblem):
    """(boundaries, replica groups as device indices, recompute flags) of a plan's stages on
    ``problem``'s devices (the solved problem's: a tensor group is one device)."""
    boundaries = [0]
    for stage in stages:
        boundaries.append(boundaries[-1] + len(stage.blocks))
    names = [d.name for d in problem.devices]
    groups: list[tuple[int, ...]] = []
    for stage in stages:
        t, devices = stage.tensor, stage.devices
        replicas = [group_name(devices[i : i + t]) for i in range(0, len(devices), t)]
        missing = [name for name in replicas if name not in names]
        if missing:
            raise PlanFormatError(f"stage {stage.index}'s devices {missing} are not in problem.json")
        groups.append(tuple(names.index(name) for name in replicas))
    return boundaries, groups, [stage.recompute for stage in stages]


def read_problem(folder: Path) -> PartitionProblem:
    """The ``problem.json`` of a saved folder, validated."""
    return PartitionProblem.from_json(read_saved(folder / "problem.json", "partition problem"))


def number(value: Any, default: float = math.nan) -> float:
    """A JSON number (``"inf"`` strings and missing values included) as a float."""
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float (10**400)
        return default


def _read_json(path: Path) -> dict[str, Any]:
    text = read_saved(path, path.name)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PlanFormatError(f"{path} is not valid JSON: {exc}", hint="compile the model again") from exc
