"""Re-price a saved plan for the devices its ranks found (``hetcc.launch --allow-substitute``).

A rank that finds another GPU than its placement names still runs; rank 0 then says what that costs.
The found name maps to a hardware preset (``preset_for_device_name``). Where that type is one the plan's
problem already prices, its per-block seconds are used as they are; otherwise they are the planned
type's scaled by the ratio of the two types' dense peak FLOP/s for the plan's precision. That is an
approximation (it ignores memory bandwidth, efficiency and per-kernel overhead), and the lines say so.
The plan is then replayed in the simulator on those devices, and every stage's memory is checked
against the found devices' usable memory (their memory less the cluster's reserve). A GPU plan run on
CPU ranks, or a GPU hetcc has no preset for, is not re-priced: the lines say why instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetcc.errors import ClusterError, HetccError, PlanFormatError, format_bytes
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.measure import preset_for_device_name
from hetcc.hardware.presets import PRESETS, flops_key, type_key
from hetcc.plan import Plan, read_plan, recorded_warmup
from hetcc.report.data import CLUSTER_FILE, plan_layout, read_problem
from hetcc.solver.objective import replica_seconds, stage_costs
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.schedules import rank_stages
from hetcc.solver.simulate import simulate

PREFIX = "hetcc.launch:"


@dataclass(frozen=True)
class Substitution:
    """One rank on another device than planned, the type it is priced as, and what that does to its stages."""

    rank: int
    stages: tuple[int, ...]  # every stage the rank runs: one, or several when interleaved
    replica: int
    replicas: int  # of its stage
    planned_device: str
    planned_type: str
    found_name: str
    found_memory_bytes: float
    priced_as: str  # the problem's type whose seconds it gets
    pricing: str  # how those seconds were found (a type of the plan, or a peak ratio)
    slowdown: float  # its stages' forward+backward seconds per microbatch on it / as planned

    @property
    def stage(self) -> int:
        """The rank's first stage (its pipeline position)."""
        return self.stages[0]


@dataclass(frozen=True)
class Overflow:
    """Stages whose fullest replica no longer fits its (found) device: one, or every stage that device
    holds when interleaved, whose memory is counted together."""

    stages: tuple[int, ...]
    needs_bytes: float
    usable_bytes: float

    @property
    def stage(self) -> int:
        """The first of them."""
        return self.stages[0]


@dataclass(frozen=True)
class Repricing:
    """The plan's simulated step against the one on the devices found; ``not_repriced`` says why
    there is no re-priced step (``step_s`` is then nan)."""

    planned_step_s: float
    step_s: float
    substitutions: tuple[Substitution, ...] = ()
    overflows: tuple[Overflow, ...] = ()
    not_repriced: str = ""


def reprice(directory: str | Path, found: Mapping[int, Mapping[str, Any]]) -> Repricing:
    """The plan in ``directory`` (``hetcc compile --out``) re-priced with pipeline rank r on the device
    ``found[r]`` (``{"vendor", "name", "memory_bytes"}``, as ``hetcc.runtime.torchrun.found_device`` gives it).
    Ranks are numbered as ``placement.placement`` numbers them: stage order, replicas next to each other."""
    on_cpu = [str(rank) for rank in sorted(found) if found[rank]["vendor"] == "cpu"]
    if on_cpu:
        which = f"rank{'s' if len(on_cpu) > 1 else ''} {', '.join(on_cpu)}"
        why = f"running a GPU plan on CPU ({which}): times are not re-priced"
        return Repricing(math.nan, math.nan, not_repriced=why)
    plan, problem, cluster = _read(Path(directory))
    split = [s.index for s in plan.stages if s.tensor > 1]
    if split:  # a device of a tensor group prices the group's composite row, not its own
        why = f"stages {split} are tensor parallel: a plan with tensor-parallel stages is not re-priced"
        return Repricing(plan.step_time_s, math.nan, not_repriced=why)
    # The ranks are the first plan.ranks stages' devices (a rank of an interleaved or ZB-V plan runs its
    # other stages on the same device: substituting the device re-prices them all).
    ranks = [(s.index, r, name) for s in plan.stages[: plan.ranks] for r, name in enumerate(s.devices)]
    if any(not 0 <= rank < len(ranks) for rank in found):
        raise PlanFormatError(f"ranks {sorted(found)}: the plan has ranks 0..{len(ranks) - 1}")
    priced = {rank: _price(problem, cluster, ranks[rank][2], found[rank], rank) for rank in sorted(found)}
    reasons = [p for p in priced.values() if isinstance(p, str)]
    if reasons:
        return Repricing(plan.step_time_s, math.nan, not_repriced="; ".join(reasons))
    substituted = problem
    for rank, pricing in priced.items():
        substituted = _substitute(substituted, ranks[rank][2], pricing)
    boundaries, groups, recompute = plan_layout(plan.stages, problem)
    layout = (boundaries, groups, recompute)
    subs = tuple(
        _describe(problem, substituted, ranks[rank], rank, found[rank], priced[rank], plan, layout)
        for rank in priced
    )
    codecs = [s.codecs for s in plan.stages] if problem.codecs is not None else None
    stages = stage_costs(
        substituted, *layout, codecs=codecs, warmup=recorded_warmup(plan.stages), chunks=plan.chunks
    )
    overflows = tuple(  # a rank's stages share its memory: said once, for its first stage
        Overflow(_rank_stages(plan, j), s.memory_bytes, s.memory_capacity_bytes)
        for j, s in enumerate(stages[: plan.ranks])
        if not s.fits
    )
    step = simulate(substituted, *layout, events=False, stages=stages, chunks=plan.chunks).step_time_s
    return Repricing(plan.step_time_s, step, subs, overflows)


def repricing_lines(directory: str | Path, found: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """What rank 0 prints about the devices found; a folder that cannot be read is one line, not an error."""
    try:
        return format_repricing(reprice(directory, found))
    except HetccError as error:
        return [f"{PREFIX} cannot re-price the plan for the devices found: {error}"]


def format_repricing(repricing: Repricing) -> list[str]:
    """A headline with both simulated steps, then one line per substituted rank and per stage that no
    longer fits."""
    if repricing.not_repriced:
        return [f"{PREFIX} {repricing.not_repriced}"]
    lines = [
        f"{PREFIX} re-priced for the devices found: simulated step {_ms(repricing.step_s)} "
        f"(plan: {_ms(repricing.planned_step_s)})"
    ]
    for s in repricing.substitutions:
        replica = f" replica {s.replica}" if s.replicas > 1 else ""
        change = _change(s.slowdown)
        noun = "stage" if len(s.stages) == 1 else "stages"
        lines.append(
            f"  {_stages(s.stages)}{replica} on {s.found_name} ({format_bytes(s.found_memory_bytes)}) "
            f"instead of {s.planned_type} ({s.planned_device}): {noun} forward+backward {change} ({s.pricing})"
        )
    for o in repricing.overflows:
        fits = "fits" if len(o.stages) == 1 else "fit (one device)"
        lines.append(
            f"  {_stages(o.stages)} no longer {fits}: needs {format_bytes(o.needs_bytes)}, "
            f"has {format_bytes(o.usable_bytes)} usable"
        )
    return lines


def _stages(stages: tuple[int, ...]) -> str:
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"


def _rank_stages(plan: Plan, stage: int) -> tuple[int, ...]:
    """The stages the device of ``stage`` (one of the first ``plan.ranks``) runs: it alone, or its chunks."""
    return rank_stages(plan.schedule, plan.ranks, stage, plan.chunks) if plan.chunks > 1 else (stage,)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _change(slowdown: float) -> str:
    if abs(slowdown - 1) < 0.005:
        return "as fast as planned"
    return f"{slowdown:.3g}x slower" if slowdown > 1 else f"{1 / slowdown:.3g}x faster"


def _read(folder: Path) -> tuple[Plan, PartitionProblem, Cluster]:
    """The plan, the problem it solved and the cluster it was made for, as ``hetcc compile`` saved them."""
    plan = read_plan(folder)
    problem = read_problem(folder)
    if not (folder / CLUSTER_FILE).is_file():
        raise PlanFormatError(
            f"{folder / CLUSTER_FILE} does not exist", hint="run `hetcc compile ... --out DIR` first"
        )
    return plan, problem, Cluster.from_file(folder / CLUSTER_FILE)


@dataclass(frozen=True)
class _Pricing:
    """The problem type a found device is priced as, with its per-block seconds where the problem has none."""

    kind: str
    how: str
    usable_bytes: float
    fwd_s: list[float] | None = None
    bwd_s: list[float] | None = None


def _price(problem: PartitionProblem, cluster: Cluster, device: str, found, rank: int) -> _Pricing | str:
    """How the device ``found`` in place of ``device`` is priced, or why it cannot be."""
    preset = preset_for_device_name(str(found["name"]), found.get("memory_bytes") or None)
    if preset is None:
        gpus = ", ".join(name for name, t in PRESETS.items() if t.vendor != "cpu")
        return (f"rank {rank} found {found['name']!r}, which names no GPU hetcc has figures for ({gpus}): "
                "the plan cannot be re-priced for it")  # fmt: skip
    memory = float(found.get("memory_bytes") or PRESETS[preset].memory_bytes)
    usable = memory * (1.0 - cluster.memory_reserve)
    kind = next((t for t in problem.fwd_s if type_key(t) == type_key(preset)), None)
    if kind is not None:
        return _Pricing(kind, f"{kind}: a type of the plan", usable)
    planned = cluster.device(device).type
    try:
        key = flops_key(problem.precision.removesuffix("-mixed"))
        ratio = planned.peak(key) / PRESETS[preset].peak(key)
    except ClusterError as error:
        return f"rank {rank} found {found['name']!r} ({preset}): {str(error).splitlines()[0]}"
    how = (
        f"{preset}: {planned.name}'s times x its {key} peak over {preset}'s, "
        f"{planned.peak(key) / 1e12:g}/{PRESETS[preset].peak(key) / 1e12:g} TFLOP/s, an approximation"
    )
    fwd_s = [t * ratio for t in problem.fwd_s[planned.name]]
    bwd_s = [t * ratio for t in problem.bwd_s[planned.name]]
    return _Pricing(f"{preset} (from {planned.name})", how, usable, fwd_s, bwd_s)


def _substitute(problem: PartitionProblem, device: str, pricing: _Pricing) -> PartitionProblem:
    """``problem`` with ``device`` of the type and usable memory ``pricing`` gives it."""
    index = next((i for i, d in enumerate(problem.devices) if d.name == device), None)
    if index is None:
        raise PlanFormatError(f"the plan's device {device!r} is not in problem.json")
    devices = list(problem.devices)
    devices[index] = dataclasses.replace(devices[index], type=pricing.kind, memory_bytes=pricing.usable_bytes)
    if pricing.fwd_s is None:
        return dataclasses.replace(problem, devices=devices)
    fwd_s = {**problem.fwd_s, pricing.kind: pricing.fwd_s}
    bwd_s = {**problem.bwd_s, pricing.kind: pricing.bwd_s}
    planned = problem.devices[index].type  # a codec's encode and decode keep the planned type's seconds
    codecs = [
        dataclasses.replace(
            row,
            **{
                table: {**getattr(row, table), pricing.kind: getattr(row, table)[planned]}
                for table in _CODEC_TIMES
            },
        )
        for row in problem.codecs or ()
    ]
    changes = {"codecs": codecs} if problem.codecs is not None else {}
    return dataclasses.replace(problem, devices=devices, fwd_s=fwd_s, bwd_s=bwd_s, **changes)


_CODEC_TIMES = ("encode_s_per_byte", "decode_s_per_byte", "call_s")


def _describe(problem, substituted, where, rank, found, pricing, plan: Plan, layout) -> Substitution:
    """One substituted rank: its stages' forward+backward seconds per microbatch before and after."""
    (stage, replica, device), (boundaries, groups, recompute) = where, layout
    mine = _rank_stages(plan, stage)
    index = groups[stage][replica]

    def seconds(priced: PartitionProblem) -> float:
        return sum(sum(replica_seconds(priced, *boundaries[j : j + 2], index, recompute[j])) for j in mine)

    before, after = seconds(problem), seconds(substituted)
    return Substitution(
        rank=rank, stages=mine, replica=replica, replicas=len(groups[stage]), planned_device=device,
        planned_type=problem.devices[index].type, found_name=str(found["name"]),
        found_memory_bytes=float(found.get("memory_bytes") or 0), priced_as=pricing.kind,
        pricing=pricing.how, slowdown=after / before if before > 0 else 1.0,
    )  # fmt: skip
