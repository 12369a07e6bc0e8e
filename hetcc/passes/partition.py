"""partition: from the analysed, costed block chain and a cluster to a ``Plan``.

The pass is thin: it states the numbers-only ``PartitionProblem`` (``hetcc.solver``), solves it,
replays the solution in the event-driven simulator, prices the baselines, and writes each node's stage.

State bytes per block = parameters × (1 weight + 1 gradient + optimizer states) when training. A tied
parameter (GPT-2's wte/lm_head) is charged to every block that uses it, because every stage that runs
one of those blocks holds a copy (it over-counts only when the same stage holds both users).

With tensor parallelism on (``PlanSettings.tensor_parallel``), the problem carries the ``TensorSplit`` rows
``passes.tensor_cost`` priced, ``solver.tensor.solve_tensor`` plans it as a problem of composite devices (a
group of t like devices on one node is one device), and each stage is mapped back to its real devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx

from hetcc import ir
from hetcc.errors import HetccError
from hetcc.hardware.cluster import Cluster
from hetcc.passes.blocks import Block, CutTensor, TiedParam, crossing_once
from hetcc.passes.compress import PAYS_RTOL, codec_rows, compress_spec, keep_paying_codecs, stage_wire_bytes
from hetcc.passes.cost import block_times, op_name
from hetcc.passes.schedule_search import AUTO_SCHEDULES, RERANK, planned_schedule, solve_each_schedule
from hetcc.plan import MemoryBreakdown, Plan, PlanStage
from hetcc.solver.baselines import baselines
from hetcc.solver.problem import PartitionProblem, PartitionSolution, ProblemDevice, TensorSplit
from hetcc.solver.schedules import MULTI_STAGE
from hetcc.solver.simulate import simulate
from hetcc.solver.solve import solve
from hetcc.solver.tensor import megatron_baseline


@dataclass(frozen=True)
class Optimizer:
    """One optimizer as both the planner (memory) and the runtime (``torch.optim``) see it."""

    states: int  # state tensors per parameter, in units of the parameter's own bytes
    torch_class: str | None  # in torch.optim; None: no optimizer step
    defaults: dict[str, Any] = field(default_factory=dict)


OPTIMIZERS = {
    "adam": Optimizer(2, "Adam"),
    "adamw": Optimizer(2, "AdamW"),
    "sgd": Optimizer(0, "SGD"),
    "sgd_momentum": Optimizer(1, "SGD", {"momentum": 0.9}),
    "none": Optimizer(0, None),
}


def optimizer(name: object) -> Optimizer:
    """The table entry for ``name``; ``HetccError`` naming the known ones otherwise."""
    found = OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if found is None:
        raise HetccError(f"unknown optimizer {name!r}", hint=f"use one of {', '.join(OPTIMIZERS)}")
    return found


def state_multiplier(training: bool, name: str, precision: str = "fp32") -> float:
    """Bytes held per parameter byte: the weight, its gradient and the optimizer's states (and the
    half-precision weight copies autocast keeps under mixed precision)."""
    copy = MIXED_WEIGHT_COPY if precision != "fp32" else 0.0
    return (2 + optimizer(name).states if training else 1) + copy


# Mixed precision keeps fp32 master weights, gradients and optimizer state; autocast also caches a
# half-precision copy of every weight it casts during the forward.
MIXED_WEIGHT_COPY = 0.5


@dataclass(frozen=True)
class PlanSettings:
    """How the plan will run: what the user passed to ``hetcc.compile``."""

    microbatches: int
    schedule: str
    training: bool
    optimizer: str
    precision: str = "fp32"
    recompute: bool | str = "auto"  # "auto": where memory needs it; True: every stage; False: never
    replicate: bool = True
    batch_rows: int = 0
    compress: object = "off"  # ``passes.compress``: "off", "auto" or a dict of pins
    shard: int | str = "auto"  # ZeRO-1 of replicated stages: "auto" (where it pays), 1 (always), 0 (never)
    tensor_parallel: bool | int | str = False  # False (none), a pinned degree, or "auto" (``solve_tensor``)


def partition(
    gm: torch.fx.GraphModule, chain: Sequence[Block], tied: Sequence[TiedParam], cluster: Cluster,
    settings: PlanSettings, act_change: Sequence[float] | None = None,
    tensor_splits: Sequence[TensorSplit] | None = None,
) -> tuple[Plan, PartitionProblem, PartitionSolution]:  # fmt: skip
    """Plan ``chain`` over ``cluster`` and annotate every node of ``gm`` with its stage.
    ``act_change``: per block, what fusion changes in its saved activations (``FusionChoice``);
    ``tensor_splits``: the rows of ``passes.tensor_cost``, planned with where ``settings.tensor_parallel``
    is on; the problem returned then holds them, and the solution's device indices name the devices of its
    composite problem for the degrees chosen (``solver.tensor.composite_problem``; the plan's stages name
    the real devices)."""
    whole = build_problem(gm, chain, tied, cluster, settings, act_change=act_change)
    tensor = bool(settings.tensor_parallel and tensor_splits)
    if tensor:
        whole = replace(whole, tensor_splits=list(tensor_splits))
    problem, solution, note, device_map = solve_each_schedule(
        whole, settings.schedule, settings.tensor_parallel
    )
    bound = solution.lower_bound_s  # with tensor parallelism: valid for every degree (``tensor_bound``)
    solution, codec_notes = (  # several stages per device: codecs are not planned with them
        _codecs_that_pay(problem, solution, settings) if solution.chunks == 1 else (solution, [])
    )
    if tensor and solution.lower_bound_s != bound:  # a plan without codecs kept: still the tensor bound
        solution = replace(solution, lower_bound_s=bound, gap=solution.simulated_s / bound - 1)
    plan = _plan(problem, solution, chain, settings, whole, device_map)
    plan = replace(plan, notes=(*plan.notes, *([note] if note else []), *codec_notes))
    stage_of = plan.stage_of
    for node in gm.graph.nodes:
        if node.name in stage_of:
            ir.annotate(node, stage=stage_of[node.name])
    return plan, replace(whole, schedule=problem.schedule) if tensor else problem, solution


def _codecs_that_pay(
    problem: PartitionProblem, solution: PartitionSolution, settings: PlanSettings
) -> tuple[PartitionSolution, list[str]]:
    """The plan's codecs, each kept only where it shortens the simulated step (``keep_paying_codecs``);
    where nothing is pinned (no link kind, no cut), the best plan without codecs is solved too and kept
    unless the plan with codecs is faster by more than ``PAYS_RTOL``."""
    solution, notes = keep_paying_codecs(problem, solution)
    spec = compress_spec(settings.compress)
    if problem.codecs is None or spec.links or spec.cuts:
        return solution, notes
    plain = solve(replace(problem, codecs=None), rerank=RERANK)
    if plain.simulated_s <= solution.simulated_s * (1 + PAYS_RTOL):
        return plain, [
            f"compress: no codec pays (by more than {PAYS_RTOL:.1%} of the step): the best plan without codecs "
            f"simulates {plain.simulated_s * 1e3:.2f} ms, the best with them {solution.simulated_s * 1e3:.2f} ms"
        ]
    return solution, [
        *notes,
        f"compress: the best plan without codecs simulates {plain.simulated_s * 1e3:.2f} ms",
    ]


def build_problem(
    gm: torch.fx.GraphModule, chain: Sequence[Block], tied: Sequence[TiedParam], cluster: Cluster,
    settings: PlanSettings, times: tuple[dict, dict] | None = None,
    act_change: Sequence[float] | None = None, subs: dict | None = None,
) -> PartitionProblem:  # fmt: skip
    """The partition problem for the chain of ``gm`` (costed with ``passes.cost``, or ``times`` =
    per-type forward and backward seconds of each block) on ``cluster``; ``act_change``: per block,
    what fusion changes in its saved activations; ``subs``: the sizes of a symbolic ``gm``."""
    training = settings.training
    type_names = [t.name for t in cluster.types]
    fwd, bwd = times if times is not None else block_times(gm, [b.nodes for b in chain], type_names)
    shares = weight_grad_shares(gm, chain, subs) if training else [0.0] * len(chain)
    multiplier = state_multiplier(training, settings.optimizer, settings.precision)
    params = [float(b.param_bytes) for b in chain]
    index = {b.name: i for i, b in enumerate(chain)}
    for param in tied:
        for name in param.blocks[1:]:  # the first user's block already counts it
            params[index[name]] += param.bytes
    crossing = crossing_once(chain)
    devices = [
        ProblemDevice(d.name, d.type.name, float(cluster.usable_memory_bytes(d)), d.node)
        for d in cluster.devices
    ]
    return PartitionProblem(
        blocks=[b.name for b in chain],
        fwd_s=fwd,
        bwd_s=bwd,
        state_bytes=[p * multiplier for p in params],
        act_bytes=[
            float(b.act_bytes) + (act_change[i] if act_change else 0.0) if training else 0.0
            for i, b in enumerate(chain)
        ],
        cut_bytes=[float(b.cut_bytes) for b in chain[:-1]],
        cut_grad_bytes=[float(b.cut_grad_bytes) for b in chain[:-1]] if training else None,
        tied_blocks=[[index[name] for name in t.blocks] for t in tied],
        cut_tensors=_cut_tensors(crossing, index, training),
        tied_bytes=[float(t.bytes) for t in tied],
        tied_grad_bytes=tied_grad_bytes(gm, tied, subs) if training else None,
        devices=devices,
        bandwidth_bps=cluster.bandwidth_matrix_bps(),
        latency_s=cluster.latency_matrix_s(),
        microbatches=settings.microbatches,
        # interleaved 1F1B and ZB-V are planned on a 1F1B problem (``solver.interleave``)
        schedule=AUTO_SCHEDULES[0] if settings.schedule in ("auto", *MULTI_STAGE) else settings.schedule,
        training=training,
        replicate=bool(settings.replicate),
        recompute=settings.recompute is not False and training,
        recompute_all=settings.recompute is True and training,
        param_bytes=params,
        optimizer_bytes=[p * optimizer(settings.optimizer).states for p in params] if training else None,
        shard=settings.shard != 0 and bool(settings.replicate) and training,
        shard_all=settings.shard == 1 and training,
        wgrad_s={t: [b * share for b, share in zip(bwd[t], shares)] for t in bwd} if training else None,
        precision=settings.precision,
        optimizer=settings.optimizer,
        batch_size=settings.batch_rows,
        codecs=codec_rows(
            gm,
            chain,
            cluster,
            compress_spec(settings.compress, [b.name for b in chain]),
            training,
            crossing,
            subs,
        ),
    )


# Ops whose backward computes a parameter's gradient as one more GEMM of the forward's size (dW = dY^T X):
# what a zero-bubble schedule defers to its W pass. Others' parameter gradients (a bias, a norm's
# weight) are reductions riding on the input gradient's memory passes, left in B.
_WEIGHT_GEMMS = frozenset({"mm", "addmm", "linear", "matmul", "bmm", "baddbmm", "addbmm", "convolution"})


def weight_grad_shares(
    gm: torch.fx.GraphModule, chain: Sequence[Block], subs: dict | None = None
) -> list[float]:
    """Per block, the share of its backward FLOPs that compute weight gradients: each GEMM reading a
    parameter does its forward's FLOPs once more for them. A FLOP share, so the microbatch search
    (``subs``: sizes of a symbolic trace) and the compile agree; it prices W as that share of the
    block's backward seconds."""
    by_name = {n.name: n for n in gm.graph.nodes}
    value = (lambda v: float(ir.number_at(v, subs))) if subs else float
    shares = []
    for block in chain:
        weight = total = 0.0
        for name in block.nodes:
            node = by_name[name]
            record = ir.info(node)
            total += value(record.bwd_flops)
            if op_name(node) in _WEIGHT_GEMMS and any(map(_parameter, node.all_input_nodes)):
                weight += min(value(record.fwd_flops), value(record.bwd_flops))
        shares.append(weight / total if total > 0 else 0.0)
    return shares


def tied_grad_bytes(
    gm: torch.fx.GraphModule, tied: Sequence[TiedParam], subs: dict | None = None
) -> list[list[float]]:
    """Per tied weight, per block using it (``PartitionProblem.tied_grad_bytes``): the most bytes of its
    gradient one microbatch of that block makes nonzero, 8 bytes of row index per row: the rows its
    embedding lookups read (``aten.embedding`` of the weight itself), or the whole weight where the block
    uses it any other way."""
    value = (lambda v: float(ir.number_at(v, subs))) if subs else float
    attrs = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    out = []
    for param in tied:
        whole, node = float(param.bytes), attrs.get(param.name)
        shape = getattr(node.meta.get("val"), "shape", ()) if node is not None else ()
        by_block: dict[str, float] = {}
        for user in node.users if node is not None and len(shape) >= 1 and shape[0] > 0 else ():
            block = ir.info(user).block
            lookup = op_name(user) == "embedding" and user.args[0] is node
            rows = value(ir.to_number(user.args[1].meta["val"].numel())) if lookup else math.inf
            by_block[block] = by_block.get(block, 0.0) + rows * (whole / int(shape[0]) + 8)
        out.append([min(whole, by_block.get(name, whole)) for name in param.blocks])
    return out


def _parameter(node: torch.fx.Node, depth: int = 3) -> bool:
    """Whether ``node`` is a parameter, or a view of one (``t``, ``permute``, ``alias``, ...)."""
    if node.op == "get_attr":
        return ir.info(node).param_bytes > 0
    view = node.op == "call_function" and getattr(node.target, "is_view", False)
    return depth > 0 and view and any(_parameter(a, depth - 1) for a in node.all_input_nodes)


def _plan(problem, solution, chain: Sequence[Block], settings: PlanSettings, whole, device_map) -> Plan:
    """The plan of ``solution`` on ``problem`` (the composite problem under tensor parallelism), its stages
    on the real devices of ``whole`` (``device_map``), the baselines priced on ``whole``; ``solution.chunks``
    > 1: several stages per device (interleaved 1F1B, or ZB-V's V)."""
    simulation = simulate(
        problem,
        solution.boundaries,
        solution.groups,
        solution.recompute,
        events=False,
        stages=solution.stages,
        chunks=solution.chunks,
    )
    stages = tuple(
        _stage(k, stage_plan, whole, device_map, chain, settings, simulation.bubble_fraction[k], wire)
        for k, (stage_plan, wire) in enumerate(zip(solution.stages, stage_wire_bytes(problem, solution)))
    )
    base = {}
    for name, plan in baselines(whole).items():
        fits = all(s.fits for s in plan.stages)
        base[name] = (
            simulate(whole, plan.boundaries, plan.devices, events=False).step_time_s if fits else math.inf
        )
    megatron = megatron_baseline(whole) if settings.tensor_parallel and whole.tensor_splits else None
    if megatron is not None:
        base["megatron"] = megatron[0].simulated_s
    rows = settings.batch_rows // problem.microbatches if settings.batch_rows else 0
    return Plan(
        stages=stages,
        step_time_s=simulation.step_time_s,
        lower_bound_s=solution.lower_bound_s,
        gap=solution.gap,  # simulated step / bound, as solve replayed this same plan
        baselines=base,
        microbatches=problem.microbatches,
        schedule=planned_schedule(problem, solution),
        training=problem.training,
        simulated_step_s=simulation.step_time_s,
        exact=solution.exact,
        objective_s=solution.step_time_s,
        precision=settings.precision,
        microbatch_rows=rows,
    )


def _stage(k, stage_plan, whole, device_map, chain, settings: PlanSettings, bubble: float, wire) -> PlanStage:
    """Stage ``k`` on its real devices: each replica's group of ``tensor`` devices of ``whole`` in turn
    (``device_map``: per device of the solved problem, the devices of ``whole`` it stands for); memory
    figures per device."""
    start, stop = stage_plan.blocks
    blocks = chain[start:stop]
    training = settings.training
    multiplier = state_multiplier(training, settings.optimizer, settings.precision)
    params = stage_plan.state_bytes / multiplier
    groups = [device_map[i] for i in stage_plan.group]
    devices = tuple(whole.devices[i].name for group in groups for i in group)
    device = whole.devices[groups[0][0]]
    states = params * optimizer(settings.optimizer).states if training else 0.0
    held = states - stage_plan.sharded_bytes  # ZeRO-1: one replica's share
    activations = stage_plan.memory_bytes - stage_plan.state_bytes + stage_plan.sharded_bytes
    memory = MemoryBreakdown(
        params_bytes=params * (1 + (MIXED_WEIGHT_COPY if settings.precision != "fp32" else 0.0)),
        grads_bytes=params if training else 0.0,
        optimizer_bytes=held,
        activations_bytes=activations,
    )
    return PlanStage(
        index=k,
        device=device.name,
        device_type=device.type,
        blocks=tuple(b.name for b in blocks),
        nodes=tuple(n for b in blocks for n in b.nodes),
        fwd_flops=float(sum(b.fwd_flops for b in blocks)),
        bwd_flops=float(sum(b.bwd_flops for b in blocks)) if training else 0.0,
        fwd_s=stage_plan.fwd_s,
        bwd_s=stage_plan.bwd_s,
        compute_s=stage_plan.compute_s,
        comm_s=stage_plan.comm_s,
        inflight=stage_plan.inflight,
        memory=memory,
        device_memory_bytes=stage_plan.memory_capacity_bytes,
        bubble=bubble,
        devices=devices,
        shares=stage_plan.shares,
        recompute=stage_plan.recompute,
        precision=settings.precision,
        allreduce_s=stage_plan.allreduce_s,
        allgather_s=stage_plan.allgather_s,
        codecs=stage_plan.codecs,
        shard=stage_plan.shard,
        deferred=stage_plan.deferred,
        warmup=stage_plan.warmup,
        wire_bytes=wire,
        tensor=len(groups[0]),
    )


def _cut_tensors(crossing: Sequence[CutTensor], index: dict[str, int], training: bool) -> list[list]:
    """The problem's ``cut_tensors``: [producer block, consumer blocks, bytes, gradient bytes] each."""
    return [
        [
            index[c.producer],
            [index[b] for b in c.consumers],
            float(c.bytes),
            float(c.bytes) if training and c.grad else 0.0,
        ]
        for c in crossing
    ]
