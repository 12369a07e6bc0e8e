"""``hetcc.compile``: the whole compiler, one named step after another."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetcc import config, ir, verify
from hetcc.analysis import Analysis, analyze
from hetcc.baselines import baselines
from hetcc.cluster import Cluster
from hetcc.dump import Dumper
from hetcc.errors import HetccError
from hetcc.kernels import FUSION_META_KEY, write_kernel
from hetcc.passes.blocks import collect_blocks
from hetcc.passes.cost import cost
from hetcc.passes.fuse import fuse, install_code_comments
from hetcc.passes.partition import PartitionProblem, PartitionSolution, solve
from hetcc.plan import MemoryBreakdown, Plan, Stage
from hetcc.problem import build_problem, state_multiplier
from hetcc.simulate import simulate


@dataclass
class Compiled:
    """What ``hetcc.compile`` returns: the plan, the problem it solved, and the annotated graph."""

    plan: Plan
    problem: PartitionProblem
    analysis: Analysis
    cluster: Cluster
    solution: PartitionSolution
    optimizer: str = "adam"
    _pipeline: Any = field(default=None, repr=False, compare=False)

    def explain(self) -> str:
        return self.plan.explain()

    @property
    def graph(self) -> torch.fx.GraphModule:
        return self.analysis.graph

    def pipeline(self):
        """The plan as per-stage graphs with send/recv ops (``hetcc.runtime.Pipeline``), built once."""
        if self._pipeline is None:
            from hetcc.passes.comm import split_stages
            from hetcc.runtime.store import Pipeline

            stage_of = {name: s.index for s in self.plan.stages for name in s.nodes}
            stages = split_stages(self.graph, stage_of, len(self.plan.stages))
            for stage in stages:  # fused groups print the ops they replaced in stage<k>.py
                install_code_comments(stage.module)
            if config.check:
                verify.check_pipeline(stages)
            self._pipeline = Pipeline(stages, self._run_meta())
        return self._pipeline

    def _run_meta(self) -> dict[str, Any]:
        vendors = [self.cluster.device(s.device).vendor for s in self.plan.stages]
        return {
            "schedule": self.plan.schedule, "microbatches": self.plan.microbatches,
            "optimizer": {"name": self.optimizer}, "loss": "model", "vendors": vendors,
        }  # fmt: skip

    def save_plan(self, folder: str | Path) -> Path:
        """Write ``plan.json``, ``problem.json`` and ``explain.txt`` (what a model without weights has)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(self.plan.to_json())
        (folder / "problem.json").write_text(self.problem.to_json())
        (folder / "explain.txt").write_text(self.explain() + "\n")
        return folder

    def save(self, folder: str | Path, inputs: dict[str, torch.Tensor] | None = None, targets=None) -> Path:
        """Write the plan (``save_plan``) and the runnable pipeline: ``stage<k>.py``
        (readable), ``stage<k>.graph.json`` and ``stage<k>.safetensors`` (loading never unpickles code).
        ``inputs`` (one step's batch by input name) are saved for ``hetcc run`` / ``hetcc.launch``."""
        from hetcc.runtime.store import save_stages

        folder = self.save_plan(folder)
        pipeline = self.pipeline()
        save_stages(pipeline.stages, str(folder), pipeline.meta, inputs=inputs, targets=targets)
        return folder

    def to_torch_pipeline(self, rank: int, loss_fn=None):
        """This rank's ``torch.distributed.pipelining`` stage and schedule for the same split (for users
        already on it; chain-shaped splits only)."""
        from hetcc.runtime.interop import pipelining_schedule

        return pipelining_schedule(
            self.pipeline().stages, rank, self.plan.microbatches, self.plan.schedule, loss_fn
        )


def compile(  # noqa: A001 - the public name DESIGN.md gives
    model: torch.nn.Module,
    cluster: Cluster | str | Path,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    microbatches: int = 8,
    schedule: str = "1f1b",
    training: bool = True,
    optimizer: str = "adam",
    dtype: object | None = None,
    dump_dir: str | Path | None = None,
) -> Compiled:
    """Plan ``model`` over ``cluster``. ``example_inputs`` are one step's batch; dim 0 is split into
    ``microbatches`` equal microbatches, and every cost is per microbatch."""
    cluster = cluster if isinstance(cluster, Cluster) else Cluster.from_file(cluster)
    state_multiplier(training, optimizer)  # reject an unknown optimizer before the slow steps
    args, kwargs = first_microbatch(example_inputs, example_kwargs or {}, microbatches)
    dumper = Dumper(dump_dir)
    analysis = analyze(model, args, kwargs, dump_dir=dump_dir, training=training, dumper=dumper)
    gm = analysis.graph
    if config.fuse:
        with dumper.step("fuse", "fuse.txt", lambda: gm.code):
            fuse(gm)
            analysis.blocks, analysis.tied_params = collect_blocks(gm)
        _dump_kernels(gm, dumper)
    with dumper.step("cost", "cost.txt", lambda: ir.format(gm)):
        cost(gm, device_types=cluster.types, dtype=dtype, training=training)
    if config.check:
        verify.check_graph(gm, after="cost")
    problem = build_problem(
        analysis,
        cluster,
        microbatches=microbatches,
        schedule=schedule,
        training=training,
        optimizer=optimizer,
    )
    compiled: Compiled | None = None
    with dumper.step("partition", "partition.txt", lambda: compiled.explain()):
        solution = solve(problem)
        plan = _plan(problem, solution, analysis, training, optimizer)
        _annotate_stages(gm, plan)
        if config.check:
            verify.check_stages(gm, plan)
        compiled = Compiled(plan, problem, analysis, cluster, solution, optimizer)
    dumper.write("plan.json", plan.to_json(), numbered=False)
    dumper.write("problem.json", problem.to_json(), numbered=False)
    if config.debug >= 1:
        print(plan.explain(), file=sys.stderr)
    return compiled


def run_local(
    compiled_or_dir: Compiled | str | Path,
    inputs: dict[str, Any] | tuple,
    targets: torch.Tensor | None = None,
    loss_fn=None,
    steps: int = 1,
    optimizer: dict[str, Any] | None = None,
):
    """Train ``steps`` steps with one local process per stage (gloo) and return ``RunResult``
    (``.losses`` per step, ``.outputs`` of the last step, ``.grads`` by the model's parameter names).
    ``inputs`` is one step's batch; schedule and microbatches come from the plan."""
    from hetcc.runtime.local import run_local as run_pipeline
    from hetcc.runtime.store import pipeline_meta

    if isinstance(compiled_or_dir, Compiled):
        pipeline = compiled_or_dir.pipeline()
        meta = pipeline.meta
    else:  # the ranks load the folder themselves: only its run settings are read here
        pipeline = str(compiled_or_dir)
        meta = pipeline_meta(pipeline)
    return run_pipeline(
        pipeline, inputs, targets=targets, loss_fn=loss_fn, steps=steps, schedule=meta.get("schedule", "1f1b"),
        microbatches=meta.get("microbatches", 1), optimizer=optimizer or meta.get("optimizer"),
    )  # fmt: skip


def first_microbatch(args: tuple, kwargs: dict[str, Any], microbatches: int) -> tuple[tuple, dict]:
    """Split every batched tensor input along dim 0 and keep the first of ``microbatches`` chunks."""
    if not isinstance(microbatches, int) or microbatches < 1:
        raise HetccError(f"microbatches must be a positive integer, got {microbatches!r}")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors:
        return args, kwargs
    batch = tensors[0].shape[0]
    if batch % microbatches:
        raise HetccError(
            f"the example batch has {batch} rows, which {microbatches} microbatches do not divide",
            hint=f"pass a batch that is a multiple of {microbatches}, or change microbatches",
        )
    size = batch // microbatches

    def chunk(value):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value[:size].clone()  # its own storage: a view would carry the whole batch's
        return value

    return tuple(chunk(a) for a in args), {k: chunk(v) for k, v in kwargs.items()}


def _plan(problem, solution, analysis: Analysis, training: bool, optimizer: str) -> Plan:
    simulation = simulate(problem, solution.boundaries, solution.devices)
    stages = tuple(
        _stage(k, stage_plan, problem, analysis, training, optimizer, simulation.bubble_fraction[k])
        for k, stage_plan in enumerate(solution.stages)
    )
    return Plan(
        stages=stages,
        step_time_s=solution.step_time_s,
        lower_bound_s=solution.lower_bound_s,
        gap=solution.gap,
        baselines={name: s.step_time_s for name, s in baselines(problem).items()},
        microbatches=problem.microbatches,
        schedule=problem.schedule,
        training=training,
        simulated_step_s=simulation.step_time_s,
        exact=solution.exact,
    )


def _stage(k, stage_plan, problem, analysis, training, optimizer, bubble: float) -> Stage:
    start, stop = stage_plan.blocks
    chain = analysis.blocks[start:stop]
    multiplier = state_multiplier(training, optimizer)
    params = stage_plan.state_bytes / multiplier
    device = problem.devices[stage_plan.device]
    memory = MemoryBreakdown(
        params_bytes=params,
        grads_bytes=params if training else 0.0,
        optimizer_bytes=params * (multiplier - 2) if training else 0.0,
        activations_bytes=stage_plan.inflight * stage_plan.act_bytes,
    )
    return Stage(
        index=k,
        device=device.name,
        device_type=device.type,
        blocks=tuple(b.name for b in chain),
        nodes=tuple(n for b in chain for n in b.nodes),
        fwd_flops=float(sum(b.fwd_flops for b in chain)),
        bwd_flops=float(sum(b.bwd_flops for b in chain)) if training else 0.0,
        fwd_s=stage_plan.fwd_s,
        bwd_s=stage_plan.bwd_s,
        compute_s=stage_plan.compute_s,
        comm_s=stage_plan.comm_s,
        inflight=stage_plan.inflight,
        memory=memory,
        device_memory_bytes=stage_plan.memory_capacity_bytes,
        bubble=bubble,
    )


def _dump_kernels(gm: torch.fx.GraphModule, dumper: Dumper) -> None:
    """Each fused group's generated Triton source as ``kernels/<name>.py`` in the dump folder."""
    if dumper.folder is None:
        return
    for node in gm.graph.nodes:
        group = node.meta.get(FUSION_META_KEY)
        if group is not None:
            write_kernel(group, dumper.folder)


def _annotate_stages(gm: torch.fx.GraphModule, plan: Plan) -> None:
    stage_of = {name: s.index for s in plan.stages for name in s.nodes}
    for node in gm.graph.nodes:
        if node.name in stage_of:
            ir.annotate(node, stage=stage_of[node.name])


__all__ = ["Compiled", "compile", "first_microbatch", "run_local"]
