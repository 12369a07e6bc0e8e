"""``hetcc.analyze``, ``hetcc.compile`` and ``hetcc.replan``: the whole compiler, one named step after
another.

    analyze:  trace -> shapes -> flops -> memory -> blocks
    compile:  analyze -> cost -> (tensor_cost) -> partition -> fuse -> comm -> (shard) -> codegen
    replan:   newest checkpoint -> compile (the old run's options) -> checkpoint moved into the new stages

Each step is a function in ``hetcc/passes/<step>.py``. With ``dump_dir=`` (or ``HETCC_DUMP_DIR``) the IR
after each step is written as numbered files; with ``HETCC_CHECK=1`` ``hetcc.verify`` checks it. What they
return, ``Analysis`` and ``Compiled``, is in ``analysis.py`` and ``compiled.py``; what ``replan`` does
around its ``compile``, in ``replanning.py``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hetcc import config, ir, verify
from hetcc.api.analysis import Analysis
from hetcc.api.checks import check_analyze_args, check_compile_args, check_plan_space, check_run_args
from hetcc.api.compiled import Compiled
from hetcc.api.microbatches import batch_rows, first_microbatch, search_microbatches
from hetcc.api.replanning import newest_checkpoint, plan_space_options, run_options, save_replanned
from hetcc.dump import Dumper
from hetcc.errors import HetccError
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.schema import short_repr
from hetcc.kernels import FUSION_META_KEY, write_kernel
from hetcc.passes.blocks import blocks, collect_blocks
from hetcc.passes.codegen import codegen, stage_source
from hetcc.passes.comm import StageGraph, format_stages, split_stages
from hetcc.passes.compress import compress_spec
from hetcc.passes.cost import cost, cost_notes
from hetcc.passes.flops import flops, format_flops
from hetcc.passes.fuse import FusionChoice, fuse, fusion_candidates
from hetcc.passes.memory import memory
from hetcc.passes.partition import PlanSettings, partition
from hetcc.passes.partition import optimizer as optimizer_entry
from hetcc.passes.shapes import shapes
from hetcc.passes.tensor_cost import fuse_split, tensor_cost, tried_degrees
from hetcc.passes.tensor_parallel import tensor_parallel
from hetcc.passes.trace import drop_dtype_asserts, trace
from hetcc.plan import PRECISIONS, Plan
from hetcc.report import write_report
from hetcc.runtime.contract import PlanSpace, pipeline_meta_for
from hetcc.runtime.cudagraphs import graphs_note
from hetcc.runtime.store import Pipeline, pipeline_meta
from hetcc.sendrecv import ANCHOR_NAME, attach_anchor
from hetcc.solver.schedules import MULTI_STAGE, splits_backward
from hetcc.train import checkpoint as ckpt
from hetcc.train.export import export
from hetcc.train.local import run_local as run_pipeline

# ------------------------------------------------------------------------------------ analyze


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
    check_analyze_args(model, example_inputs, example_kwargs, training, dump_dir, max_block_bytes)
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


# ------------------------------------------------------------------------------------ compile


def compile(  # noqa: A001 - the public API name
    model: torch.nn.Module,
    cluster: Cluster | str | Path,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    training: bool = True,
    optimizer: str = "adam",
    dtype: object | None = None,
    dump_dir: str | Path | None = None,
    *,
    precision: str = "fp32",
    recompute: bool | str = "auto",
    replicate: bool = True,
    compress: str | dict = "off",
    shard: int | str = "auto",
    tensor_parallel: bool | int | str = False,
) -> Compiled:
    """Plan ``model`` over ``cluster``. ``example_inputs`` are one step's batch; dim 0 is split into
    ``microbatches`` equal microbatches, and every cost is per microbatch. ``microbatches="auto"``
    tries every divisor of the batch, pricing each from one trace with a symbolic batch dimension
    (``hetcc.api.microbatches.search_microbatches``; a count whose lower bound is above a plan already
    found is not planned), and keeps the count whose plan simulates fastest.
    ``schedule``: "1f1b", "gpipe", "zb-h1" (zero-bubble H1: weight gradients deferred into the
    bubbles; ``hetcc.solver.schedules``), "zb-h2" (ZB-H1 with up to twice the forwards before the first
    backward, where memory holds them), "interleaved-1f1b" (2-4 stages on each device of the best 1F1B
    pipeline; ``solver.interleave``), "zbv" (two stages per device of the best 1F1B pipeline in a V,
    every backward split) or "auto" (plans 1f1b, zb-h1, zb-h2, interleaved-1f1b and zbv at every count
    tried and keeps the fastest simulated; the plan's notes give each figure; the default). Every plan but a GPipe one also
    tunes, by simulation, the forwards each stage runs before its first backward.

    ``precision``: "fp32", "bf16-mixed" or "fp16-mixed" (autocast, fp32 master weights and optimizer
    state; fp16 with loss scaling), priced at each device's peak for that format. ``recompute``:
    "auto" recomputes a stage's activations where memory needs it, True everywhere, False never.
    ``replicate``: stages may run on groups of identical devices (False: one device per stage).
    ``compress``: codecs for the tensors crossing cuts (``hetcc.passes.compress``): "off", "auto" (per cut
    the fastest codec no lossier than int8 for activations and bf16 for gradients, kept only where it
    shortens the simulated step) or a dict of pins per link kind or cut and an auto "budget".
    ``shard``: a replicated stage's optimizer state split over its replicas (ZeRO-1, torch's
    ``ZeroRedundancyOptimizer``): "auto" where the simulated plan gains (memory for longer stages or no
    recompute, against one more all-gather of the weights), 1 on every replicated stage, 0 never.
    ``tensor_parallel``: stages on groups of t like devices of one node, each holding 1/t of the weights
    (Megatron-style, ``passes.tensor_parallel``): False never, a degree t (every device class with t on a
    node runs at t), or "auto" (2, 4, 8 priced, each class at the degree whose plan simulates fastest,
    degree 1 included, where a device may also run several stages: interleaved 1F1B, ZB-V). The
    microbatch search prices plans without it (with a degree pinned, under the schedules that run one
    stage per device)."""
    check_compile_args(model, cluster, example_inputs, example_kwargs, schedule, training, dump_dir)
    cluster = cluster if isinstance(cluster, Cluster) else Cluster.from_file(cluster)
    optimizer_entry(optimizer)  # reject an unknown optimizer before the slow steps
    check_plan_space(precision, recompute, replicate, shard, tensor_parallel)
    compress_spec(compress)  # reject a bad codec name before the slow steps
    if dtype is None:
        dtype = PRECISIONS[precision]
    rows = batch_rows(example_inputs, example_kwargs or {})
    tensor = False if tensor_parallel == 1 else tensor_parallel  # degree 1: no split
    if tensor:
        tried_degrees(cluster, tensor)  # a degree no node has room for fails before tracing
    if tensor and schedule in MULTI_STAGE:
        raise HetccError(
            f"schedule={schedule!r} runs each stage whole on each of its devices (a device runs several "
            f"stages), so it takes no tensor_parallel={short_repr(tensor_parallel)}",
            hint="use tensor_parallel=False with it, or another schedule",
        )
    settings = PlanSettings(
        1, schedule, training, optimizer, precision, recompute, replicate, rows, compress, shard, tensor
    )
    inputs = (example_inputs, example_kwargs or {})
    if microbatches != "auto":
        return _compile_at(
            model, cluster, inputs, replace(settings, microbatches=microbatches), dtype, dump_dir
        )
    chosen, search, notes = search_microbatches(model, cluster, *inputs, settings, dtype, analyze)
    figures = dict(search)
    while True:
        compiled = _compile_at(
            model, cluster, inputs, replace(settings, microbatches=chosen), dtype, dump_dir,
            sorted(figures.items()), notes,
        )  # fmt: skip
        step_s = compiled.plan.step_time_s
        if chosen not in figures or math.isclose(figures[chosen], step_s, rel_tol=1e-9):
            return compiled
        # The trace at this count is not the symbolic one evaluated there (export specialises a 1-row
        # batch, a model may branch on its size), and the search plans without tensor parallelism: its
        # own plan is the figure; keep the fastest again.
        tensor_note = (" and planned with tensor parallelism", ", without it,") if tensor else ("", "")
        notes = [*notes, f"microbatches: M={chosen} priced again from its own trace{tensor_note[0]}: "
                         f"{step_s * 1e3:.2f} ms (the symbolic trace{tensor_note[1]} gave "
                         f"{figures[chosen] * 1e3:.2f} ms)"]  # fmt: skip
        figures[chosen] = step_s
        best = min(figures, key=lambda m: (figures[m], m))
        if best == chosen:
            compiled.plan = replace(
                compiled.plan,
                microbatch_search=tuple(sorted(figures.items())),
                notes=(*compiled.plan.notes, notes[-1]),
            )
            Dumper(dump_dir).write("plan.json", compiled.plan.to_json(), numbered=False)
            return compiled
        chosen = best


def _compile_at(
    model: torch.nn.Module, cluster: Cluster, inputs: tuple, settings: PlanSettings, dtype: object | None,
    dump_dir: str | Path | None, search: Sequence[tuple[int, float]] = (), notes: Sequence[str] = (),
) -> Compiled:  # fmt: skip
    """``compile`` at a pinned microbatch count; ``search`` and ``notes`` (the microbatch search's)
    go into the plan."""
    training, precision, microbatches = settings.training, settings.precision, settings.microbatches
    optimizer, replicate, recompute = settings.optimizer, settings.replicate, settings.recompute
    notes = list(notes)
    args, kwargs = first_microbatch(*inputs, microbatches)
    dumper = Dumper(dump_dir)
    analysis = analyze(model, args, kwargs, dump_dir=dump_dir, training=training, dumper=dumper)
    gm = analysis.graph
    candidates = fusion_candidates(gm) if config.fuse != "off" else []
    pricing = {"dtype": dtype, "training": training, "autocast": precision != "fp32"}
    with _step(dumper, "cost", lambda: _cost_dump(gm, choice), lambda: verify.check_graph(gm, "cost")):
        choice = cost(gm, device_types=cluster.types, candidates=candidates, fuse=config.fuse, **pricing)
    notes.extend(cost_notes(gm))
    split = None
    if settings.tensor_parallel:
        with _step(dumper, "tensor_cost", lambda: split.summary([b.name for b in analysis.blocks]), None):
            split = tensor_cost(gm, analysis.blocks, analysis.tied_params, cluster, settings, dtype)
    with _step(dumper, "partition", lambda: plan.explain(), lambda: verify.check_stages(gm, plan)):
        change = choice.act_bytes_change([b.name for b in analysis.blocks]) if training else None
        plan, problem, solution = partition(
            gm, analysis.blocks, analysis.tied_params, cluster, settings, change, split and split.rows
        )
        fusion = choice.note([s.device_type for s in plan.stages])
        split_note = [split.note([s.tensor for s in plan.stages])] if split else []
        plan = replace(
            plan, microbatch_search=tuple(search),
            notes=(*plan.notes, *notes, *([fusion] if fusion else []), *split_note),
        )  # fmt: skip
    with _step(dumper, "fuse", lambda: gm.code, lambda: verify.check_graph(gm, "fuse")):
        plan = _fuse_for_stages(gm, plan, choice, analysis)
    _dump_kernels(gm, dumper)
    if precision != "fp32":  # autocast changes dtypes that export's metadata asserts pinned to fp32
        drop_dtype_asserts(gm)
    with _step(dumper, "comm", lambda: format_stages(stages), lambda: verify.check_pipeline(stages)):
        present = {node.name for node in gm.graph.nodes}
        stage_of = {n: k for n, k in plan.stage_of.items() if n in present}
        stages = split_stages(gm, stage_of, len(plan.stages), [s.codecs for s in plan.stages])
    if any(s.tensor > 1 for s in plan.stages):
        with _step(dumper, "shard", lambda: format_stages(stages), lambda: verify.check_pipeline(stages)):
            _shard_stages(stages, plan, cluster, settings, dtype)
        for stage in stages:
            if stage.tensor and stage.tensor.degree > 1:
                _dump_kernels(stage.module, dumper)
    sources = functools.cache(lambda: [stage_source(s) for s in stages])  # only made when dumped
    with _step(dumper, "codegen", lambda: "\n".join(sources()), None):
        codegen(stages)
    plan = _with_graphs_note(plan, stages, cluster)
    if dumper.folder is not None:  # beside the numbered steps: the plan, its problem, each stage's program
        dumper.write("plan.json", plan.to_json(), numbered=False)
        dumper.write("problem.json", problem.to_json(), numbered=False)
        for stage, source in zip(stages, sources()):
            dumper.write(f"stage{stage.index}.py", source, numbered=False)
        write_report(dumper.folder, cluster)  # report.html and cluster.json beside plan.json
    if config.debug >= 1:
        print(plan.explain(), file=sys.stderr)
    meta = pipeline_meta_for(
        plan, cluster, solution, optimizer=optimizer, inputs=[n.target for n in gm.graph.find_nodes(op="placeholder")],
        state_dict=_state_dict_keys(model), plan_space=PlanSpace(replicate, recompute, settings.shard, settings.tensor_parallel),
    )  # fmt: skip
    return Compiled(plan, problem, analysis, cluster, solution, Pipeline(stages, meta), optimizer)


def _with_graphs_note(plan: Plan, stages: Sequence, cluster: Cluster) -> Plan:
    """The plan with a note on which stages the runtime will capture as CUDA graphs, and why not others."""
    vendor = {t.name: t.vendor for t in cluster.types}
    on_gpu = [vendor[s.device_type] != "cpu" for s in plan.stages]
    recompute = [s.recompute for s in plan.stages]
    split = splits_backward(plan.schedule, recompute) if plan.training else [False] * len(recompute)
    note = graphs_note(stages, on_gpu, recompute, config.cuda_graphs_mode(config.cuda_graphs), split)
    return replace(plan, notes=(*plan.notes, note)) if note else plan


def _fuse_for_stages(gm: torch.fx.GraphModule, plan: Plan, choice: FusionChoice, analysis: Analysis) -> Plan:
    """Fuse each group chosen for the device type of the stage that runs it, except on tensor-parallel
    stages (their groups are found and fused in the graph each device runs, after the shard step); the
    blocks and the plan's node lists then name the graph that runs."""
    stage_of = [ir.info(c.members[-1]).stage for c in choice.candidates]
    type_of = {s.index: s.device_type for s in plan.stages}
    split = {s.index for s in plan.stages if s.tensor > 1}
    fused = [k for k, stage in enumerate(stage_of) if k in choice.fused[type_of[stage]]]
    fuse(gm, [choice.candidates[k] for k in fused if stage_of[k] not in split])
    analysis.blocks, analysis.tied_params = collect_blocks(gm)
    nodes = {b.name: b.nodes for b in analysis.blocks}
    stages = tuple(replace(s, nodes=tuple(n for b in s.blocks for n in nodes[b])) for s in plan.stages)
    return replace(plan, stages=stages)


def _shard_stages(
    stages: Sequence[StageGraph], plan: Plan, cluster: Cluster, settings: PlanSettings, dtype: object | None
) -> None:
    """Each stage of tensor degree t > 1 becomes the graph each of its t devices runs, with explicit
    collectives (``passes.tensor_parallel``), and the fusion groups that pay on its device type fused
    there (``passes.tensor_cost.fuse_split``, as its row was priced); weights it shares with other
    stages stay whole."""
    types = {t.name: t for t in cluster.types}
    for stage, planned in zip(stages, plan.stages):
        if planned.tensor > 1:
            weights = next(stage.module.parameters(), None)
            if weights is not None and weights.is_meta and hasattr(stage.module, ANCHOR_NAME):
                attach_anchor(stage.module, "meta")  # a recv's value is on its anchor's device: the weights'
            tied = frozenset(name for g in stage.tied for k, name in g.members if k == stage.index)
            stage.module, stage.tensor = tensor_parallel(stage.module, planned.tensor, keep_whole=tied)
            if config.fuse != "off":
                fuse_split(
                    stage.module, stage.index, planned.blocks, types[planned.device_type], settings, dtype
                )


def _cost_dump(gm: torch.fx.GraphModule, choice: FusionChoice) -> str:
    """The costed graph, then each fusion candidate priced fused and as ops on every device type."""
    lines = choice.lines()
    head = ["", "# fusion candidates: their block's forward + backward as one kernel call vs as ops"]
    return ir.format(gm) + ("\n".join(head + lines) if lines else "")


def _state_dict_keys(model: torch.nn.Module) -> dict[str, str]:
    """Each key of ``model.state_dict()`` -> the first key of the same tensor: what ``hetcc.export``
    returns. The stages hold a tied weight under one of its names and non-persistent buffers too, and
    the traced graph drops the other names, so they cannot be told from the stages alone."""
    first: dict[int, str] = {}
    return {key: first.setdefault(id(t), key) for key, t in model.state_dict(keep_vars=True).items()}


def run_local(
    compiled_or_dir: Compiled | str | Path,
    inputs: dict[str, Any] | tuple | None = None,
    targets: torch.Tensor | None = None,
    loss_fn=None,
    steps: int = 1,
    optimizer: dict[str, Any] | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    *,
    data: Any = None,
    eval_data: Any = None,
    eval_every: int = 0,
    eval_batches: int = 1,
    lr_schedule: dict[str, Any] | None = None,
    clip_grad_norm: float | None = None,
    seed: int = 0,
    log_dir: str | Path | None = None,
    progress: bool = False,
):
    """Train ``steps`` steps with one local process per rank (gloo); returns ``RunResult`` (losses,
    per-step records, the last step's outputs, gradients by parameter name, counters, measured against
    simulated). ``data`` (Dataset, DataLoader, iterable of global batches, or a factory) gives step k its
    batch k; ``inputs`` instead is one batch trained at every step. The options are
    ``hetcc.train.local.run_local``'s; schedule and microbatches are the plan's."""
    check_run_args(compiled_or_dir, inputs, targets, loss_fn, steps, optimizer, data)
    pipeline = compiled_or_dir.pipeline if isinstance(compiled_or_dir, Compiled) else str(compiled_or_dir)
    return run_pipeline(
        pipeline, inputs, targets=targets, loss_fn=loss_fn, steps=steps, optimizer=optimizer,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume, data=data,
        eval_data=eval_data, eval_every=eval_every, eval_batches=eval_batches, lr_schedule=lr_schedule,
        clip_grad_norm=clip_grad_norm, seed=seed, log_dir=log_dir, progress=progress,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ replan


def replan(
    source: str | Path,
    cluster: Cluster | str | Path,
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    out: str | Path | None = None,
    **compile_options: Any,
) -> Compiled:
    """Plan the same model again for ``cluster`` (say, the devices left after one was lost) and carry on
    training where a checkpoint left off.

    ``source``: a build folder with ``checkpoints/``, a checkpoint folder, or one ``step-<n>`` folder.
    ``model`` and the example inputs are those compiled before (a folder holds the stage graphs, not the
    model); its weights are replaced by the checkpoint's. Writes the new build to ``out`` (default
    ``<source>-replanned``) with the checkpoint moved into its stages at the same step in
    ``out/checkpoints``: ``run_local(out, ..., checkpoint_dir=out / "checkpoints", resume=True)`` goes on.
    ``compile_options`` go to ``compile``; microbatches, schedule and optimizer are the old run's, and so
    are precision, replicate and recompute unless ``compile_options`` set them.
    """
    build, root, step = newest_checkpoint(source)
    meta = pipeline_meta(str(build))
    model.load_state_dict(export(ckpt.step_dir(root, step)))
    compiled = compile(
        model, cluster, example_inputs, example_kwargs, **run_options(meta),
        **{**plan_space_options(meta), **compile_options},
    )  # fmt: skip
    out = Path(out) if out is not None else Path(f"{Path(source).resolve()}-replanned")
    save_replanned(compiled, build, root, step, out)
    return compiled


def _dump_kernels(gm: torch.fx.GraphModule, dumper: Dumper) -> None:
    """Each fused group's generated Triton source as ``kernels/<name>.py`` in the dump folder."""
    if dumper.folder is None:
        return
    for node in gm.graph.nodes:
        group = node.meta.get(FUSION_META_KEY)
        if group is not None:
            write_kernel(group, dumper.folder)


__all__ = ["Analysis", "Compiled", "analyze", "compile", "replan", "run_local"]
