"""The contract between compiler and runtime: ``PipelineMeta``, how a saved pipeline runs.

One record says what each rank runs and where (``placement``: a ``RankPlacement`` per rank), which replica
of a stage runs each microbatch (``routing``), the schedule, recompute, precision and loss scaling, the
optimizer and loss, the model's input names and ``state_dict`` keys. ``hetcc.compile`` builds it once
(``pipeline_meta_for``, from the plan, the cluster and the solution); ``save_stages`` writes it as
``pipeline.json``'s ``meta`` (``to_json``); ``read_meta`` is its one reader, and every other part of hetcc
reads its attributes. A record agrees with itself however it was made: every per-stage list has one entry
per stage, ``routing`` one replica per microbatch, ranks are listed in rank order and each stage's replicas
are numbered 0..R-1; errors name the file and the field.

Versions (``pipeline.json``'s ``version``): 2 writes every field. 1 (hetcc before this record) is read with
the defaults it was written for: absent keys mean one rank per stage on the vendor ``vendors`` gives it
(else the CPU), every microbatch on replica 0, no recompute, fp32; its ``vendors`` must name one vendor per
stage, the vendor of that stage's first rank where there is a ``placement``. Other versions are refused
with the advice to compile again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, asdict, dataclass, field, replace
from typing import Any

from hetcc.errors import PlanFormatError
from hetcc.hardware.cluster import Cluster
from hetcc.hardware.schema import (
    Choice,
    Count,
    Flag,
    Fraction,
    ListOf,
    Nullable,
    Number,
    Record,
    Table,
    Text,
    Where,
    load_file,
    short_repr,
)
from hetcc.plan import PRECISIONS, RECOMPILE, Plan
from hetcc.runtime.chunk_checks import check_chunks
from hetcc.runtime.placement import RankPlacement, placement, ranks_for
from hetcc.solver.problem import PartitionSolution
from hetcc.solver.schedules import (
    MULTI_STAGE,
    PIPELINE_SCHEDULES,
    rank_stages,
    recorded_warmup,
    warmup_fault,
    warmup_forwards,
    zb_deferrals,
)

VERSION = 2  # of pipeline.json, whose ``meta`` this record is
READABLE_VERSIONS = (1, 2)
LOSS_SCALE_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")  # LossScaler's


@dataclass(frozen=True)
class PlanSpace:
    """The plan space ``hetcc.compile`` searched (``replan`` searches it again)."""

    replicate: bool = True
    recompute: bool | str = "auto"
    shard: int | str = "auto"  # ZeRO level of replicated stages: "auto", 0 or 1
    tensor_parallel: bool | int | str = False  # tensor degree: False, a degree >= 2 or "auto"


@dataclass(frozen=True)
class PipelineMeta:
    """How a pipeline of ``num_stages`` stages runs. Empty ``placement``, ``routing`` or ``recompute`` mean
    their defaults (one CPU rank per stage, every microbatch on replica 0, no recompute), filled in here:
    a record's lists are always complete."""

    num_stages: int
    schedule: str = "1f1b"
    microbatches: int = 1
    optimizer: Mapping[str, Any] | None = None  # {"name": ..., hyperparameters}; None: the run's default
    loss: str = "model"  # "model": the model returns its loss; else a torch.nn.functional name
    inputs: tuple[str, ...] = ()  # the model's input names in placeholder order (empty: not recorded)
    placement: tuple[RankPlacement, ...] = ()  # by rank
    routing: tuple[tuple[int, ...], ...] = ()  # [stage][microbatch] -> replica
    recompute: tuple[bool, ...] = ()  # per stage: its forward runs again in backward
    shard: tuple[bool, ...] = ()  # per stage: its replicas shard the optimizer state (ZeRO-1)
    # per stage: the weight gradients it defers under a split schedule (``schedules.stage_actions``);
    # empty: ZB-H1's (``schedules.zb_deferrals``)
    deferred: tuple[int, ...] = ()
    # per stage: the forwards it runs before its first backward (``schedules.stage_actions``); empty: the
    # schedule's (``schedules.warmup_forwards``)
    warmup: tuple[int, ...] = ()
    precision: str = "fp32"
    loss_scale: Mapping[str, float] = field(default_factory=dict)  # LossScaler options (fp16-mixed)
    plan_space: PlanSpace = PlanSpace()
    state_dict: Mapping[str, str] | None = None  # model.state_dict() key -> first key of its tensor
    training: bool = True  # False: compiled for inference (runs forward only)
    where: InitVar[Where | None] = None  # where errors point (the file it was read from)

    def __post_init__(self, where: Where | None) -> None:
        stages = range(self.num_stages if _count(self.num_stages) else 0)
        every = self.microbatches if _count(self.microbatches) else 0
        filled = {
            "placement": tuple(self.placement) or ranks_for([1] * len(stages)),
            "routing": tuple(tuple(row) for row in self.routing) or tuple((0,) * every for _ in stages),
            "recompute": tuple(self.recompute) or (False,) * len(stages),
            "shard": tuple(self.shard) or (False,) * len(stages),
            "inputs": tuple(self.inputs),
        }
        replicas = _replicas(filled["placement"], len(stages))
        if not self.deferred:
            filled["deferred"] = tuple(zb_deferrals(replicas))
        if not self.warmup:
            filled["warmup"] = tuple(warmup_forwards(self.schedule, replicas, every))
        for name, value in filled.items():
            object.__setattr__(self, name, value)
        _check(self, where or Where("PipelineMeta", error=PlanFormatError))

    @property
    def vendors(self) -> tuple[str, ...]:
        """Each rank's vendor."""
        return tuple(rank.vendor for rank in self.placement)

    def to_json(self) -> dict[str, Any]:
        """``pipeline.json``'s ``meta`` (version 2: every field; the stage count is the document's)."""
        return {key: value for key, value in asdict(self).items() if key != "num_stages"}


def pipeline_meta_for(
    plan: Plan,
    cluster: Cluster,
    solution: PartitionSolution,
    *,
    optimizer: str,
    inputs: Sequence[str],
    state_dict: Mapping[str, str],
    plan_space: PlanSpace,
) -> PipelineMeta:
    """The record of a compiled plan: its ranks on the cluster's devices, the solution's routing, the
    plan's schedule, microbatches, recompute, sharding, deferred weight gradients and precision."""
    stage_devices = [[cluster.device(name) for name in stage.devices] for stage in plan.stages]
    ranks = placement(stage_devices[: plan.ranks], [s.tensor for s in plan.stages[: plan.ranks]])
    if plan.chunks > 1:  # interleaved 1F1B: rank r runs stages r, r + p, ...; ZB-V: r and 2p - 1 - r
        ranks = tuple(
            replace(r, chunks=rank_stages(plan.schedule, plan.ranks, r.stage, plan.chunks)) for r in ranks
        )
    return PipelineMeta(
        len(plan.stages), plan.schedule, plan.microbatches, {"name": optimizer}, "model", tuple(inputs),
        ranks, tuple(tuple(s.route) for s in solution.stages),
        tuple(s.recompute for s in plan.stages), tuple(s.shard for s in plan.stages),
        tuple(s.deferred for s in plan.stages), tuple(recorded_warmup(plan.stages) or ()), plan.precision, {}, plan_space, dict(state_dict), plan.training,
    )  # fmt: skip


# ---- reading ------------------------------------------------------------------------------------------
def _tuple(kind: Callable[[object, Where], Any]) -> Callable[[object, Where], tuple]:
    return lambda value, where: tuple(kind(value, where))


def _recompute_policy(value: object, where: Where) -> bool | str:
    if not (isinstance(value, bool) or value == "auto"):
        where.fail(f'expected true, false or "auto"; got {short_repr(value)}')
    return value


def _shard_policy(value: object, where: Where) -> int | str:
    if value not in ("auto", 0, 1) or isinstance(value, bool):
        where.fail(f'expected "auto", 0 or 1; got {short_repr(value)}')
    return value


_RANK = Record(
    {"rank": Count(minimum=0), "stage": Count(minimum=0), "replica": Count(minimum=0), "vendor": Text(),
     "device": Nullable(Text()), "node": Nullable(Text()), "local_index": Nullable(Count(minimum=0)),
     "type": Nullable(Text()), "memory_bytes": Count(minimum=0), "node_rank": Nullable(Count(minimum=0)),
     "local_rank": Nullable(Count(minimum=0)), "tensor": Count(minimum=0),
     "chunks": _tuple(ListOf(Count(minimum=0)))},
    required=("stage",), missing_hint=RECOMPILE,
)  # fmt: skip


def _fields(nonempty: bool) -> dict[str, Callable[[object, Where], Any]]:
    """The kinds of the record's fields; ``nonempty``: its lists are written out (version 2), so an empty
    one is an error, not the default it meant in version 1."""
    return {
        "schedule": Choice(PIPELINE_SCHEDULES, "schedule"),
        "microbatches": Count(),
        "optimizer": Nullable(Record({"name": Text()}, required=("name",), open=True)),
        "loss": Text(),
        "inputs": _tuple(ListOf(Text())),
        "placement": ListOf(_RANK, nonempty),
        "routing": _tuple(ListOf(_tuple(ListOf(Count(minimum=0))), nonempty)),
        "recompute": _tuple(ListOf(Flag(), nonempty)),
        "shard": _tuple(ListOf(Flag(), nonempty)),
        "deferred": _tuple(ListOf(Count(minimum=0), nonempty)),
        "warmup": _tuple(ListOf(Count(), nonempty)),
        "precision": Choice(tuple(PRECISIONS), "precision"),
        "loss_scale": Record(
            {
                "init_scale": Number(positive=True),
                "growth_factor": Number(positive=True),
                "backoff_factor": Fraction(),
                "growth_interval": Count(),
            }
        ),  # fmt: skip
        "plan_space": lambda value, where: PlanSpace(**_PLAN_SPACE(value, where)),
        "state_dict": Nullable(Table(None, Text(), "state_dict key to the first key of its tensor")),
        "training": Flag(),
    }


def _tensor_policy(value: object, where: Where) -> bool | int | str:
    if not (value is False or value == "auto" or (_count(value, 2) and value is not True)):
        where.fail(f'expected false, "auto" or a degree >= 2; got {short_repr(value)}')
    return value


_PLAN_SPACE = Record(
    {"replicate": Flag(), "recompute": _recompute_policy, "shard": Choice(("auto", 0, 1), "shard level"),
     "tensor_parallel": _tensor_policy}
)  # fmt: skip
_OPTIONAL = ("shard", "deferred", "warmup")  # written since version 2 was: absent means its default
_META = {
    2: Record(
        _fields(nonempty=True),
        required=tuple(k for k in _fields(True) if k not in _OPTIONAL),
        missing_hint=RECOMPILE,
    ),
    1: Record({**_fields(nonempty=False), "vendors": ListOf(Text())}),  # every key optional: the defaults
}


def read_meta(data: object, num_stages: int, where: Where, version: int = VERSION) -> PipelineMeta:
    """``pipeline.json``'s ``meta`` (at ``where``) of a ``num_stages``-stage pipeline, checked field by field
    with the schema layer, then as a whole (``PipelineMeta``)."""
    if version not in READABLE_VERSIONS:
        where.fail(f"version {short_repr(version)}; this hetcc reads versions {READABLE_VERSIONS}", RECOMPILE)
    record = _META[version](data, where)
    ranks = _ranks(record.pop("placement", []))
    if "vendors" in record:
        vendors = record.pop("vendors")
        _check_vendors(vendors, ranks, num_stages, where.at("vendors"))
        ranks = ranks or tuple(RankPlacement(k, k, 0, vendor) for k, vendor in enumerate(vendors))
    return PipelineMeta(num_stages, **record, placement=ranks, where=where)


def read_placement_file(path: str) -> tuple[RankPlacement, ...]:
    """``placement.json`` (``Compiled.save_plan``): the placement alone, for a folder with only a plan."""
    where = Where(path, error=PlanFormatError, hint=RECOMPILE)
    ranks = _ranks(ListOf(_RANK, nonempty=True)(load_file(path, "placement file", error=PlanFormatError,
                                                           suffixes=(".json",)), where))  # fmt: skip
    _check_placement(ranks, max(max(rank.stages) for rank in ranks) + 1, where)
    return ranks


def placement_json(ranks: Sequence[RankPlacement]) -> list[dict[str, Any]]:
    """``placement.json``'s list: each rank as ``pipeline.json``'s ``meta.placement`` holds it."""
    return [asdict(rank) for rank in ranks]


def _ranks(entries: list[dict[str, Any]]) -> tuple[RankPlacement, ...]:
    """Placements read by ``_RANK``; a rank number left out is the entry's position (version 1)."""
    return tuple(RankPlacement(**{"rank": i, **entry}) for i, entry in enumerate(entries))


def _check_vendors(
    vendors: list[str], ranks: tuple[RankPlacement, ...], num_stages: int, where: Where
) -> None:
    """Version 1 wrote the vendor of each stage beside the placement: both must say the same."""
    if len(vendors) != num_stages:
        where.fail(f"{len(vendors)} vendors for {num_stages} stages; expected one per stage")
    for rank in ranks:
        if rank.replica == 0 and rank.stage < num_stages and rank.vendor != vendors[rank.stage]:
            where.at(rank.stage).fail(f"stage {rank.stage} on {vendors[rank.stage]!r}, but placement[{rank.rank}] "
                                      f"(its first rank) says {rank.vendor!r}")  # fmt: skip


# ---- checks -------------------------------------------------------------------------------------------
def _count(value: object, minimum: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check(meta: PipelineMeta, where: Where) -> None:
    """The record agrees with itself (the schema layer has checked each field's type when read)."""
    if not _count(meta.num_stages):
        where.fail(f"num_stages: expected a positive integer; got {short_repr(meta.num_stages)}")
    if meta.schedule not in PIPELINE_SCHEDULES:
        where.at("schedule").fail(
            f"unknown schedule {short_repr(meta.schedule)}", f"use {', '.join(PIPELINE_SCHEDULES)}"
        )
    if not _count(meta.microbatches):
        where.at("microbatches").fail(f"expected a positive integer; got {short_repr(meta.microbatches)}")
    if meta.precision not in PRECISIONS:
        where.at("precision").fail(f"unknown precision {short_repr(meta.precision)}",
                                   f"use one of {', '.join(PRECISIONS)}")  # fmt: skip
    _check_placement(meta.placement, meta.num_stages, where.at("placement"))
    check_chunks(meta.schedule, meta.placement, meta.num_stages, meta.routing, where)
    replicas = _replicas(meta.placement, meta.num_stages)
    _check_per_stage(meta.routing, meta.num_stages, where.at("routing"))
    for k, row in enumerate(meta.routing):
        if len(row) != meta.microbatches:
            where.at("routing", k).fail(
                f"{len(row)} entries; expected one per microbatch ({meta.microbatches})"
            )
        if any(not _count(r, 0) or r >= replicas[k] for r in row):
            where.at("routing", k).fail(
                f"names a replica outside 0..{replicas[k] - 1}: {short_repr(list(row))}"
            )
    _check_per_stage(meta.recompute, meta.num_stages, where.at("recompute"))
    _check_per_stage(meta.shard, meta.num_stages, where.at("shard"))
    _check_per_stage(meta.deferred, meta.num_stages, where.at("deferred"))
    _check_per_stage(meta.warmup, meta.num_stages, where.at("warmup"))
    own_order = meta.schedule in MULTI_STAGE  # its order fixes each stage's warm-up and deferral
    fault = (
        warmup_fault(meta.schedule, replicas, meta.microbatches, meta.warmup)
        if meta.training and not own_order
        else None
    )
    if fault is not None:
        where.at("warmup", fault[0]).fail(fault[1])
    unknown = sorted(set(meta.loss_scale) - set(LOSS_SCALE_OPTIONS))
    if unknown:
        where.at("loss_scale").fail(f"unknown options {unknown}", f"use {', '.join(LOSS_SCALE_OPTIONS)}")


def _replicas(ranks: Sequence[RankPlacement], num_stages: int) -> list[int]:
    """Per stage, how many replicas run it."""
    return [len({rank.replica for rank in ranks if k in rank.stages}) for k in range(num_stages)]


def _check_per_stage(values: Sequence[object], num_stages: int, where: Where) -> None:
    if len(values) != num_stages:
        where.fail(f"{len(values)} entries for {num_stages} stages; expected one per stage")


def _check_placement(ranks: Sequence[RankPlacement], num_stages: int, where: Where) -> None:
    """Ranks in rank order, each on a stage of the pipeline, each stage's replicas numbered 0..R-1 and each
    replica's parts 0..t-1 (one t per stage), and torchrun positions (node rank, local rank) on every rank
    or none, each taken once, each node rank one named node."""
    for i, rank in enumerate(ranks):
        if rank.rank != i:
            where.at(i, "rank").fail(f"rank {short_repr(rank.rank)} at position {i}, but ranks are in order")
        if not _count(rank.stage, 0) or rank.stage >= num_stages:
            where.at(i, "stage").fail(f"stage {short_repr(rank.stage)} of a {num_stages}-stage pipeline")
        if rank.chunks and (rank.chunks[0] != rank.stage or len(set(rank.chunks)) < len(rank.chunks)
                            or not all(_count(k, 0) and k < num_stages for k in rank.chunks)):  # fmt: skip
            where.at(i, "chunks").fail(
                f"stages {short_repr(list(rank.chunks))}; expected distinct stages of the {num_stages}-stage "
                f"pipeline, its stage ({rank.stage}) first"
            )
    for k in range(num_stages):
        cells = sorted((rank.replica, rank.tensor) for rank in ranks if k in rank.stages)
        replicas, parts = len({r for r, _ in cells}), len({t for _, t in cells})
        if cells != [(r, t) for r in range(replicas) for t in range(parts)] or not cells:
            if parts <= 1:
                where.fail(f"stage {k} has replicas {[r for r, _ in cells]}; expected 0..R-1 with R >= 1")
            where.fail(
                f"stage {k} has (replica, tensor part) ranks {cells}; expected every replica 0..R-1 with "
                "every part 0..t-1"
            )
    positions = [(rank.node_rank, rank.local_rank) for rank in ranks]
    given = [None not in position for position in positions]
    if any(position != (None, None) for position in positions) and not all(given):
        where.at(given.index(False)).fail("no node_rank or local_rank, which other ranks have")
    if not all(given):
        return
    if len(set(positions)) != len(positions):
        where.fail("two ranks share one node rank and local rank")
    unnamed = [i for i, rank in enumerate(ranks) if rank.node is None]
    if unnamed:
        where.at(unnamed[0]).fail("a node_rank, but no node")
    pairs = {(rank.node_rank, rank.node) for rank in ranks}
    nodes, node_ranks = {rank.node for rank in ranks}, {rank.node_rank for rank in ranks}
    if not len(pairs) == len(nodes) == len(node_ranks):
        where.fail(f"node ranks and node names do not pair one to one: {short_repr(sorted(pairs))}")
