"""What a training run reports: per step loss, learning rate, gradient norm, step time, tokens/s and
achieved FLOP/s per device type against that type's peak; at the end the measured step next to the
plan's simulated one, per stage, with the ratio.

FLOPs are the plan's (``plan.json``: each stage's forward and backward FLOPs per microbatch, counted by
``hetcc.passes.flops``), times the microbatches each rank ran (a recomputing stage runs its forward
twice). Every rank of a step shares its wall time, so the reporting rank computes every device type's
figure alone. The peak is that of the device a rank runs on: the plan's type on its GPU, the ``cpu``
preset (and the plan's type named beside it) when a plan for GPUs runs on CPU processes.

Records go to ``metrics.jsonl`` (one JSON object per step, appended by a resumed run) and, when the
``tensorboard`` package is installed, to TensorBoard event files beside it.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetcc.errors import ClusterError, HetccError
from hetcc.hardware.presets import get_preset
from hetcc.plan import PLAN_FILE, PRECISIONS, Plan, read_plan
from hetcc.runtime.layout import RankLayout

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class RankWork:
    """One rank's share of a step as the plan prices it."""

    stage: int
    replica: int
    planned_type: str  # the device type the plan put it on
    ran_on: str  # the device type it runs on ("cpu" for a GPU plan checked on CPU processes)
    flops: float  # per step
    peak_flops: float | None  # of the device it runs on, at the run's precision (None: unknown type)
    planned_busy_s: float  # the simulator's busy time of its stage per step
    chunks: tuple[int, ...] = ()  # under interleaved 1F1B: every stage it runs (its busy time: theirs)


@dataclass(frozen=True)
class RunFigures:
    """The plan's side of the comparison: each rank's work, the simulated step, tokens per step."""

    ranks: tuple[RankWork, ...]
    simulated_step_s: float | None
    tokens_per_step: int
    samples_per_step: int

    @classmethod
    def of(cls, directory: str, layout: RankLayout, types: Sequence[str | None], on_cpu: bool, tokens: int,
           samples: int, training: bool) -> RunFigures:  # fmt: skip
        """From the build's ``plan.json`` (absent: no FLOPs and no simulated figures); ``types``: each
        rank's planned device type where the placement records it (a replica group may mix types)."""
        plan = _read_plan(directory)
        if plan is None or len(plan.stages) != len(layout.routing):  # no plan, or another split's
            return cls((), None, tokens, samples)
        key = PRECISIONS[plan.precision] or "fp32"  # the FLOP/s peak of the run's matmuls
        work = []
        for rank, placement in enumerate(layout.ranks):
            flops = 0.0
            for k in placement.stages:  # one stage, or its chunks' under interleaved 1F1B
                stage = plan.stages[k]
                runs = sum(1 for replica in layout.routing[k] if replica == placement.replica)
                forwards = 1 + (stage.recompute and training)
                # a tensor-parallel replica's t ranks share its model FLOPs
                flops += (
                    runs
                    * (forwards * stage.fwd_flops + (stage.bwd_flops if training else 0.0))
                    / stage.tensor
                )
            stage = plan.stages[placement.stage]
            planned = types[rank] if rank < len(types) and types[rank] else stage.device_type
            ran_on = "cpu" if on_cpu else planned
            idle = sum(plan.stages[k].bubble for k in placement.stages) - (len(placement.stages) - 1)
            busy = plan.step_time_s * (1.0 - idle) if training else None
            work.append(RankWork(placement.stage, placement.replica, planned, ran_on, flops, _peak(ran_on, key),
                                 busy if busy is not None else float("nan"), placement.chunks))  # fmt: skip
        return cls(tuple(work), plan.step_time_s if training else None, tokens, samples)

    def step_record(self, step_s: float) -> dict[str, Any]:
        """Throughput of one step: tokens/s, samples/s, achieved FLOP/s and its share of peak per type."""
        record: dict[str, Any] = {"step_s": step_s, "samples_per_s": self.samples_per_step / step_s}
        if self.tokens_per_step:
            record["tokens_per_s"] = self.tokens_per_step / step_s
        for kind, (flops, peak) in self.by_type().items():
            record[f"tflops/{kind}"] = flops / step_s / 1e12
            if peak:
                record[f"util/{kind}"] = flops / step_s / peak
        return record

    def by_type(self) -> dict[str, tuple[float, float | None]]:
        """Per device type as ``"<ran on>"`` (or ``"<ran on> (planned <type>)"``): FLOPs per step, and
        the peak FLOP/s of all its ranks together."""
        kinds: dict[str, tuple[float, float | None]] = {}
        for work in self.ranks:
            kind = (
                work.ran_on
                if work.ran_on == work.planned_type
                else f"{work.ran_on} (planned {work.planned_type})"
            )
            flops, peak = kinds.get(kind, (0.0, 0.0))
            peak = None if peak is None or work.peak_flops is None else peak + work.peak_flops
            kinds[kind] = (flops + work.flops, peak)
        return kinds


def summary_lines(
    figures: RunFigures, step_times: Sequence[float], busy_by_rank: Sequence[float]
) -> list[str]:
    """The end of a run: the median measured step against the simulated one, and per stage the median
    busy time of its ranks against the simulator's, with the ratios."""
    if not step_times:
        return []
    measured = statistics.median(step_times)
    lines = [f"measured step {measured * 1e3:.2f} ms (median of {len(step_times)} steps)"]
    if figures.simulated_step_s:
        lines[0] += (
            f", plan simulated {figures.simulated_step_s * 1e3:.2f} ms: ratio {measured / figures.simulated_step_s:.2f}x"
        )
    if figures.ranks and any(w.ran_on != w.planned_type for w in figures.ranks):
        lines.append(
            "  (the plan is for its GPUs; here every stage ran as a CPU process, so ratios compare devices)"
        )
    stages: dict[int, list[tuple[RankWork, float]]] = {}
    for work, busy in zip(figures.ranks, busy_by_rank):
        stages.setdefault(work.stage, []).append((work, busy))
    for stage, entries in sorted(stages.items()):
        busy = statistics.mean(b for _, b in entries)
        planned = entries[0][0].planned_busy_s
        kind = entries[0][0].planned_type
        chunks = entries[0][0].chunks
        named = f"stages {', '.join(map(str, chunks))}" if chunks else f"stage {stage}"
        line = f"  {named} ({len(entries)} x {kind}): busy {busy * 1e3:.2f} ms"
        if planned == planned:  # not NaN
            line += f", simulated {planned * 1e3:.2f} ms: ratio {busy / planned:.2f}x"
        lines.append(line)
    return lines


def run_lines(result: dict[str, Any], checkpoint_dir: str | None, build: str) -> list[str]:
    """What the reporting rank prints at the end: what a resume continued from, each step's loss, the
    summary, where the weights and the metrics went."""
    lines = list(result["notes"])
    lines += [
        f"step {step} loss {loss!r}" for step, loss in enumerate(result["losses"], start=result["first_step"])
    ]
    lines += [f"eval after step {step}: loss {loss!r}" for step, loss in result["eval_losses"]]
    lines += result["summary"]
    if checkpoint_dir is not None:
        lines.append(
            f"trained weights: {checkpoint_dir} (`hetcc export {build} model.safetensors` merges them)"
        )
    if result.get("metrics"):
        lines.append(f"metrics: {result['metrics']}")
    return lines


class MetricsLog:
    """``metrics.jsonl`` in ``folder`` (and TensorBoard events when the package is installed)."""

    def __init__(self, folder: str | os.PathLike, resume: bool):
        self.path = Path(folder) / METRICS_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a" if resume else "w")  # noqa: SIM115 - closed in close()
        except OSError as error:
            raise HetccError(f"cannot write the run's metrics to {self.path}: {error}") from None
        self.tensorboard = _tensorboard(Path(folder) / "tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _tensorboard(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        return None
    return SummaryWriter(str(folder))


def _read_plan(directory: str) -> Plan | None:
    return read_plan(directory) if (Path(directory) / PLAN_FILE).exists() else None


def _peak(device_type: str, key: str) -> float | None:
    try:
        peaks = get_preset(device_type).peak_flops
    except ClusterError:  # a custom type of the cluster file: its peak is not known here
        return None
    return peaks.get(key) or peaks.get("fp32")
