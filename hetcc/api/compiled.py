"""``Compiled``: what ``hetcc.compile`` returns, the plan and the pipeline that runs it, and how both are
saved."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hetcc.api.analysis import Analysis
from hetcc.api.checks import writable_folder
from hetcc.hardware.cluster import Cluster
from hetcc.passes.comm import StageGraph
from hetcc.plan import Plan
from hetcc.report import write_report
from hetcc.runtime.contract import placement_json
from hetcc.runtime.interop import pipelining_schedule
from hetcc.runtime.store import Pipeline, save_stages
from hetcc.solver.problem import PartitionProblem, PartitionSolution


@dataclass
class Compiled:
    """What ``hetcc.compile`` returns: the plan, the problem it solved, the annotated graph, and the
    pipeline (one ``StageGraph`` per stage, with its send/recv ops) that runs it."""

    plan: Plan
    problem: PartitionProblem
    analysis: Analysis
    cluster: Cluster
    solution: PartitionSolution
    pipeline: Pipeline
    optimizer: str = "adam"

    def explain(self) -> str:
        return self.plan.explain()

    @property
    def graph(self) -> torch.fx.GraphModule:
        return self.analysis.graph

    @property
    def stages(self) -> list[StageGraph]:
        return self.pipeline.stages

    def save_plan(self, folder: str | Path) -> Path:
        """Write ``plan.json``, ``problem.json``, ``explain.txt``, ``placement.json`` (rank -> stage,
        device, node, local GPU index: what ``hetcc launch`` prints torchrun commands from) and
        ``report.html`` (with the ``cluster.json`` it reads)."""
        folder = writable_folder(folder)
        placement = placement_json(self.pipeline.meta.placement)
        (folder / "placement.json").write_text(json.dumps(placement, indent=1))
        (folder / "plan.json").write_text(self.plan.to_json())
        (folder / "problem.json").write_text(self.problem.to_json())
        (folder / "explain.txt").write_text(self.explain() + "\n")
        write_report(folder, self.cluster)
        return folder

    def save(self, folder: str | Path, inputs: dict[str, torch.Tensor] | None = None, targets=None) -> Path:
        """Write the plan (``save_plan``) and the runnable pipeline: ``stage<k>.py``
        (readable), ``stage<k>.graph.json`` and ``stage<k>.safetensors`` (loading never unpickles code).
        ``inputs`` (one step's batch by input name) are saved for ``hetcc run`` / ``hetcc.launch``."""
        folder = self.save_plan(folder)
        save_stages(self.pipeline.stages, str(folder), self.pipeline.meta, inputs=inputs, targets=targets)
        return folder

    def to_torch_pipeline(self, rank: int, loss_fn=None):
        """This rank's ``torch.distributed.pipelining`` stage and schedule for the same split (for users
        already on it; chain-shaped splits only)."""
        return pipelining_schedule(
            self.pipeline.stages,
            rank,
            self.plan.microbatches,
            self.plan.schedule,
            loss_fn,
            ranks=self.plan.ranks,
        )
