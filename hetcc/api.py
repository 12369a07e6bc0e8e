"""``hetcc.analyze`` and ``hetcc.compile``: the whole compiler, one named step after another.

    analyze:  trace -> shapes -> flops -> memory -> blocks
    compile:  analyze -> fuse -> cost -> partition -> comm -> codegen

Each step is a function in ``hetcc/passes/<step>.py``. With ``dump_dir=`` (or ``HETCC_DUMP_DIR``) the IR
after each step is written as numbered files; with ``HETCC_CHECK=1`` ``hetcc.verify`` checks it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import sympy
import torch

from hetcc import config, ir, verify
from hetcc.dump import Dumper
from hetcc.errors import AnalysisError, HetccError
from hetcc.hardware.cluster import Cluster
from hetcc.kernels import FUSION_META_KEY, write_kernel
from hetcc.passes.blocks import Block, TiedParam, blocks, collect_blocks, format_blocks
from hetcc.passes.codegen import codegen, stage_source
from hetcc.passes.comm import StageGraph, split_stages
from hetcc.passes.cost import cost
from hetcc.passes.flops import flops, format_flops
from hetcc.passes.fuse import fuse
from hetcc.passes.memory import memory
from hetcc.passes.partition import PlanSettings, partition
from hetcc.passes.partition import optimizer as optimizer_entry
from hetcc.passes.shapes import shapes
from hetcc.passes.trace import trace
from hetcc.plan import Plan
from hetcc.runtime.interop import pipelining_schedule
from hetcc.runtime.local import run_local as run_pipeline
from hetcc.runtime.local import split_microbatches
from hetcc.runtime.store import Pipeline, pipeline_meta, save_stages
from hetcc.solver.problem import PartitionProblem, PartitionSolution

# ------------------------------------------------------------------------------------ analyze


@dataclass
class Analysis:
    """An annotated graph and its block chain. Sizes are per call of the traced example inputs."""

    graph: torch.fx.GraphModule
    blocks: list[Block]
    tied_params: list[TiedParam]
    frontend: str
    dim_symbols: dict[str, Any] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def total_flops(self, backward: bool = False):
        return sum(((b.bwd_flops if backward else b.fwd_flops) for b in self.blocks), 0)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def evaluate(self, **dims: int) -> Analysis:
        """The same analysis with symbolic dims (``torch.export.Dim`` names) set to numbers."""
        unknown = sorted(set(dims) - set(self.dim_symbols))
        if unknown:
            raise AnalysisError(
                f"unknown dynamic dim(s) {unknown}; this analysis has {sorted(self.dim_symbols) or 'none'}",
                hint="name the torch.export.Dim objects passed in dynamic_shapes",
            )
        subs = {self.dim_symbols[name]: value for name, value in dims.items()}
        evaluated = [_substitute_block(b, subs) for b in self.blocks]
        return replace(
            self, blocks=evaluated, dim_symbols={k: v for k, v in self.dim_symbols.items() if k not in dims}
        )

    def summary(self) -> str:
        return format_blocks(self.blocks, self.tied_params)

    def dump(self, folder: str | Path) -> None:
        dumper = Dumper(folder)
        dumper.write("traced.py", self.graph.code)
        dumper.write("analysis.txt", ir.format(self.graph))
        dumper.write("blocks.txt", self.summary())


@contextmanager
def _step(dumper: Dumper, name: str, render: Callable[[], str], check: Callable[[], None] | None):
    """One named step: timed, dumped, then checked by ``hetcc.verify`` when ``config.check`` is on."""
    with dumper.step(name, f"{name}.txt" if name != "trace" else "traced.py", render):
        yield
    if config.check and check is not None:
        check()


def analyze(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    dump_dir: str | Path | None = None,
    *,
    training: bool = True,
    max_block_bytes: float | None = None,
    dumper: Dumper | None = None,
) -> Analysis:
    """Trace ``model`` and annotate every node with shape, FLOPs, bytes, parameters and activations.

    ``dumper`` continues a dump folder's numbering (``hetcc.compile`` passes its own).
    """
    dumper = dumper or Dumper(dump_dir)
    with _step(
        dumper, "trace", lambda: traced.gm.code, lambda: verify.check_graph(traced.gm, "trace", False)
    ):
        traced = trace(model, example_inputs, example_kwargs, dynamic_shapes)
    gm = traced.gm
    for name, run, render in (
        ("shapes", shapes, lambda: ir.format(gm)),
        ("flops", flops, lambda: format_flops(gm)),
        ("memory", lambda g: memory(g, training=training), lambda: ir.format(gm)),
    ):
        with _step(dumper, name, render, lambda name=name: verify.check_graph(gm, name)):
            run(gm)
    limit = config.max_block_bytes if max_block_bytes is None else max_block_bytes
    result = Analysis(gm, [], [], traced.frontend, traced.dim_symbols, dumper.timings_ms)
    with _step(dumper, "blocks", result.summary, lambda: verify.check_graph(gm, "blocks")):
        blocks(gm, max_block_bytes=limit)
        result.blocks, result.tied_params = collect_blocks(gm)
    if config.debug >= 1:
        print(result.summary(), file=sys.stderr)
    return result


def _substitute_block(block: Block, subs: dict) -> Block:
    changes = {}
    for f in fields(Block):
        value = getattr(block, f.name)
        if isinstance(value, sympy.Basic):
            changes[f.name] = _number(value.subs(subs))
    cut = tuple(replace(c, bytes=_number(sympy.sympify(c.bytes).subs(subs))) for c in block.cut_tensors)
    return replace(block, cut_tensors=cut, **changes)


def _number(expr):
    if isinstance(expr, sympy.Basic) and expr.is_number:
        value = float(expr)
        return int(value) if value.is_integer() else value
    return expr


# ------------------------------------------------------------------------------------ compile


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
        folder = self.save_plan(folder)
        save_stages(self.pipeline.stages, str(folder), self.pipeline.meta, inputs=inputs, targets=targets)
        return folder

    def to_torch_pipeline(self, rank: int, loss_fn=None):
        """This rank's ``torch.distributed.pipelining`` stage and schedule for the same split (for users
        already on it; chain-shaped splits only)."""
        return pipelining_schedule(
            self.pipeline.stages, rank, self.plan.microbatches, self.plan.schedule, loss_fn
        )


def compile(  # noqa: A001 - the public API name
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
    optimizer_entry(optimizer)  # reject an unknown optimizer before the slow steps
    args, kwargs = _first_microbatch(example_inputs, example_kwargs or {}, microbatches)
    dumper = Dumper(dump_dir)
    analysis = analyze(model, args, kwargs, dump_dir=dump_dir, training=training, dumper=dumper)
    gm = analysis.graph
    if config.fuse:
        with _step(dumper, "fuse", lambda: gm.code, lambda: verify.check_graph(gm, "fuse")):
            fuse(gm)
            analysis.blocks, analysis.tied_params = collect_blocks(gm)
        _dump_kernels(gm, dumper)
    with _step(dumper, "cost", lambda: ir.format(gm), lambda: verify.check_graph(gm, "cost")):
        cost(gm, device_types=cluster.types, dtype=dtype, training=training)
    settings = PlanSettings(microbatches, schedule, training, optimizer)
    with _step(dumper, "partition", lambda: plan.explain(), lambda: verify.check_stages(gm, plan)):
        plan, problem, solution = partition(gm, analysis.blocks, analysis.tied_params, cluster, settings)
    with _step(dumper, "comm", lambda: _format_stages(stages), lambda: verify.check_pipeline(stages)):
        stages = split_stages(gm, plan.stage_of, len(plan.stages))
    sources = functools.cache(lambda: [stage_source(s) for s in stages])  # only made when dumped
    with _step(dumper, "codegen", lambda: "\n".join(sources()), None):
        codegen(stages)
    if dumper.folder is not None:  # beside the numbered steps: the plan, its problem, each stage's program
        dumper.write("plan.json", plan.to_json(), numbered=False)
        dumper.write("problem.json", problem.to_json(), numbered=False)
        for stage, source in zip(stages, sources()):
            dumper.write(f"stage{stage.index}.py", source, numbered=False)
    if config.debug >= 1:
        print(plan.explain(), file=sys.stderr)
    vendors = [cluster.device(s.device).vendor for s in plan.stages]
    meta = {
        "schedule": plan.schedule, "microbatches": plan.microbatches, "optimizer": {"name": optimizer},
        "loss": "model", "vendors": vendors,
    }  # fmt: skip
    return Compiled(plan, problem, analysis, cluster, solution, Pipeline(stages, meta), optimizer)


def _format_stages(stages: list[StageGraph]) -> str:
    lines = []
    for stage in stages:
        recvs = ", ".join(f"tag {e.tag} {e.value} from {e.src}" for e in stage.recvs) or "none"
        sends = ", ".join(f"tag {e.tag} {e.value} to {e.dst}" for e in stage.sends) or "none"
        lines.append(f"stage {stage.index}: inputs {list(stage.inputs)}; recv {recvs}; send {sends}")
    return "\n".join(lines)


def run_local(
    compiled_or_dir: Compiled | str | Path,
    inputs: dict[str, Any] | tuple,
    targets: torch.Tensor | None = None,
    loss_fn=None,
    steps: int = 1,
    optimizer: dict[str, Any] | None = None,
):
    """Train ``steps`` steps with one local process per stage (gloo) and return ``RunResult``
    (``.losses`` per step, ``.outputs`` of the last step, ``.grads`` by the model's parameter names,
    ``.stats`` per rank: transfers through the send/recv ops and fused-kernel launches by backend).
    ``inputs`` is one step's batch; schedule and microbatches come from the plan."""
    if isinstance(compiled_or_dir, Compiled):
        pipeline = compiled_or_dir.pipeline
        meta = pipeline.meta
    else:  # the ranks load the folder themselves: only its run settings are read here
        pipeline = str(compiled_or_dir)
        meta = pipeline_meta(pipeline)
    return run_pipeline(
        pipeline, inputs, targets=targets, loss_fn=loss_fn, steps=steps, schedule=meta.get("schedule", "1f1b"),
        microbatches=meta.get("microbatches", 1), optimizer=optimizer or meta.get("optimizer"),
    )  # fmt: skip


def _first_microbatch(args: tuple, kwargs: dict[str, Any], microbatches: int) -> tuple[tuple, dict]:
    """The first of ``microbatches`` equal chunks of the example batch (what hetcc traces)."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    if not isinstance(kwargs, dict):
        raise HetccError(f"example_kwargs must be a dict of input name -> value, got {type(kwargs).__name__}")
    first = split_microbatches({**dict(enumerate(args)), **kwargs}, microbatches)[0]
    return tuple(first[i] for i in range(len(args))), {k: first[k] for k in kwargs}


def _dump_kernels(gm: torch.fx.GraphModule, dumper: Dumper) -> None:
    """Each fused group's generated Triton source as ``kernels/<name>.py`` in the dump folder."""
    if dumper.folder is None:
        return
    for node in gm.graph.nodes:
        group = node.meta.get(FUSION_META_KEY)
        if group is not None:
            write_kernel(group, dumper.folder)


__all__ = ["Analysis", "Compiled", "analyze", "compile", "run_local"]
