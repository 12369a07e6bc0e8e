"""``hetcc.Plan``: the stages hetcc chose, what each costs, and how that compares with the baselines."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from hetcc.errors import PlanFormatError

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes one stage holds on its device."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # saved activations of the in-flight microbatches

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


@dataclass(frozen=True)
class PlanStage:
    index: int
    device: str
    device_type: str
    blocks: tuple[str, ...]
    nodes: tuple[str, ...]
    fwd_flops: float  # per microbatch
    bwd_flops: float
    fwd_s: float  # per microbatch on its device
    bwd_s: float
    compute_s: float
    comm_s: float  # activations to the next stage and gradients back, per microbatch
    inflight: int  # microbatches whose activations are held at the peak
    memory: MemoryBreakdown
    device_memory_bytes: float  # usable memory of the device
    bubble: float = 0.0  # share of the step this stage's device idles (from the simulator)

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total_bytes


@dataclass(frozen=True)
class Plan:
    stages: tuple[PlanStage, ...]
    step_time_s: float  # the planner's objective (hetcc.solver.objective)
    lower_bound_s: float
    gap: float  # step_time / lower_bound - 1
    baselines: dict[str, float]  # name -> step time in s (inf when it does not fit in memory)
    microbatches: int
    schedule: str
    training: bool
    simulated_step_s: float = math.nan  # the event-driven simulator's step time for the same plan
    exact: bool = True  # whether the device-order search was exhaustive
    notes: tuple[str, ...] = field(default=())

    @property
    def stage_of(self) -> dict[str, int]:
        """Node name -> the stage that runs it."""
        return {name: s.index for s in self.stages for name in s.nodes}

    def speedup(self, baseline: str) -> float:
        return self.baselines[baseline] / self.step_time_s

    def to_json(self) -> str:
        return json.dumps({"format": PLAN_FORMAT_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
            version = data.pop("format")
            if version != PLAN_FORMAT_VERSION:
                raise ValueError(f"format {version}, this hetcc reads {PLAN_FORMAT_VERSION}")
            stages = tuple(_stage_from_dict(s) for s in data.pop("stages"))
            return cls(stages=stages, **{**data, "notes": tuple(data.get("notes", ()))})
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanFormatError(f"not a hetcc plan: {exc}", hint="write plans with Plan.to_json()") from exc

    def explain(self) -> str:
        return explain(self)


def _stage_from_dict(data: dict) -> PlanStage:
    known = {f.name for f in fields(PlanStage)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown stage fields {sorted(unknown)}")
    return PlanStage(
        **{
            **data,
            "blocks": tuple(data["blocks"]),
            "nodes": tuple(data["nodes"]),
            "memory": MemoryBreakdown(**data["memory"]),
        }
    )


def _block_range(blocks: tuple[str, ...]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"


def explain(plan: Plan) -> str:
    """A table a person reads in ten seconds, and the one line that matters."""
    total_flops = sum(s.fwd_flops + s.bwd_flops for s in plan.stages) or 1.0
    header = (
        f"{'stage':<5} {'device':<14} {'type':<11} {'blocks':<42} {'FLOPs':>5} "
        f"{'memory used/avail':>22} {'compute ms':>10} {'comm ms':>8} {'bubble':>6}"
    )
    lines = [
        f"hetcc plan: {len(plan.stages)} stages, {plan.schedule}, {plan.microbatches} microbatches",
        header,
    ]
    for s in plan.stages:
        used, avail = s.peak_memory_bytes / 2**30, s.device_memory_bytes / 2**30
        memory = f"{used:.2f}/{avail:.1f} GiB ({used / avail:.0%})" if avail else "-"
        lines.append(
            f"{s.index:<5} {s.device:<14} {s.device_type:<11} {_block_range(s.blocks):<42} "
            f"{(s.fwd_flops + s.bwd_flops) / total_flops:>5.0%} {memory:>22} "
            f"{s.compute_s * 1e3:>10.2f} {s.comm_s * 1e3:>8.2f} {s.bubble:>6.0%}"
        )
    lines.append(_headline(plan))
    lines.append(
        "baselines (same devices, listed order): "
        + ", ".join(f"{name} {_ms(t)}" for name, t in plan.baselines.items())
    )
    if not math.isnan(plan.simulated_step_s):
        lines.append(
            f"simulated step {plan.simulated_step_s * 1e3:.2f} ms (event-driven {plan.schedule} run)"
        )
    lines.extend(plan.notes)
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "does not fit" if math.isinf(seconds) else f"{seconds * 1e3:.2f} ms"


def _headline(plan: Plan) -> str:
    uniform = plan.baselines.get("uniform", math.nan)
    if math.isinf(uniform):
        versus = "uniform does not fit in memory"
    else:
        versus = f"{uniform / plan.step_time_s:.2f}x faster than uniform"
    return (
        f"predicted step {plan.step_time_s * 1e3:.2f} ms, {versus}, "
        f"{plan.gap:.1%} above the lower bound ({plan.lower_bound_s * 1e3:.2f} ms)"
    )
