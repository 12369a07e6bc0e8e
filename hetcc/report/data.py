"""What a report or a timeline needs, read from a saved folder (``plan.json``, ``problem.json``,
``cluster.json``) as plain data.

The plan is read as a dict rather than through ``Plan.from_json`` so that a report can show folders
written by older or newer hetcc versions: fields a version lacks (replica groups, recompute, precision,
the simulated step) are simply not shown.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetcc.errors import HetccError, PlanFormatError
from hetcc.hardware.schema import read_text
from hetcc.solver.problem import PartitionProblem

CLUSTER_FILE = "cluster.json"  # the cluster the plan was made for, as Cluster.to_spec() writes it
MAX_PLAN_BYTES = 64 * 2**20  # plan.json / problem.json: a 70B model's are a few MB


@dataclass
class SavedPlan:
    """A build or dump folder's plan, the problem it solved, and (when saved) the cluster."""

    folder: Path
    plan: dict[str, Any]
    problem: PartitionProblem
    cluster: dict[str, Any] | None = None
    simulation: Any = None  # hetcc.solver.simulate.Simulation, or None when it could not be replayed
    simulation_error: str | None = None
    baselines: dict[str, Any] = field(default_factory=dict)  # name -> PartitionSolution

    @property
    def stages(self) -> list[dict[str, Any]]:
        return self.plan.get("stages", [])

    def stage_devices(self, stage: dict[str, Any]) -> tuple[str, ...]:
        """The device names of a stage: its replica group where the plan has one, else its device."""
        return tuple(stage.get("devices") or (stage["device"],))

    @property
    def rows(self) -> dict[tuple[int, int], str]:
        """(stage, replica) -> device name: one timeline row each."""
        return {(s["index"], r): name for s in self.stages for r, name in enumerate(self.stage_devices(s))}

    @property
    def used_devices(self) -> dict[str, int]:
        """Device name -> the stage it runs."""
        return {name: s["index"] for s in self.stages for name in self.stage_devices(s)}


def load(folder: str | Path) -> SavedPlan:
    """Read a folder written by ``hetcc compile`` (build folder or dump folder)."""
    folder = Path(folder)
    plan = _read_json(folder / "plan.json")
    _check_plan(plan, folder / "plan.json")
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


def simulate_plan(plan: dict[str, Any], problem: PartitionProblem):
    """The event-driven replay (``hetcc.solver.simulate``) of a saved plan's stages: each on its replica
    group, recomputing where the plan says so."""
    from hetcc.solver.simulate import simulate

    return simulate(problem, *plan_layout(plan["stages"], problem))


def plan_layout(stages: list[dict[str, Any]], problem: PartitionProblem):
    """(boundaries, replica groups as device indices, recompute flags) of a saved plan's stages (as
    dicts: ``blocks``, ``devices`` or ``device``, ``recompute``) on ``problem``'s devices."""
    boundaries = [0]
    for stage in stages:
        boundaries.append(boundaries[-1] + len(stage["blocks"]))
    names = [d.name for d in problem.devices]
    groups: list[tuple[int, ...]] = []
    for stage in stages:
        group = list(stage.get("devices") or [stage["device"]])
        missing = [name for name in group if name not in names]
        if missing:
            raise PlanFormatError(f"stage {stage['index']}'s devices {missing} are not in problem.json")
        groups.append(tuple(names.index(name) for name in group))
    return boundaries, groups, [bool(s.get("recompute")) for s in stages]


def read_saved(path: Path, what: str) -> str:
    """The text of a file ``hetcc compile`` wrote: it must exist, be UTF-8 and at most MAX_PLAN_BYTES."""
    if not path.exists():
        raise PlanFormatError(f"{path} does not exist", hint="run `hetcc compile ... --out DIR` first")
    return read_text(path, what, error=PlanFormatError, max_bytes=MAX_PLAN_BYTES)


def read_problem(folder: Path) -> PartitionProblem:
    """The ``problem.json`` of a saved folder, validated."""
    return PartitionProblem.from_json(read_saved(folder / "problem.json", "partition problem"))


def number(value: Any, default: float = math.nan) -> float:
    """A JSON number (``"inf"`` strings and missing values included) as a float."""
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _check_plan(plan: Any, path: Path) -> None:
    """The shape the report relies on (other fields are read with defaults): stages in order, each with
    its device(s) and blocks as strings."""

    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    stages = plan.get("stages") if isinstance(plan, dict) else None
    problem = None if isinstance(stages, list) and stages else "no stages"
    for k, stage in enumerate(stages if problem is None else []):
        if not isinstance(stage, dict) or stage.get("index") != k or not isinstance(stage.get("device"), str):
            problem = f"stage {k} has no index {k} or no device name"
        elif not strings(stage.get("blocks")) or not stage["blocks"]:
            problem = f"stage {k}'s blocks are not a list of block names"
        elif "devices" in stage and not strings(stage["devices"]):
            problem = f"stage {k}'s devices are not a list of device names"
        if problem:
            break
    if problem:
        raise PlanFormatError(f"{path}: {problem}", hint="compile the model again with `hetcc compile`")


def _read_json(path: Path) -> dict[str, Any]:
    text = read_saved(path, path.name)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PlanFormatError(f"{path} is not valid JSON: {exc}", hint="compile the model again") from exc
