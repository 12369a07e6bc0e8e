"""Which rank runs what: the one list of ranks of a saved pipeline, and the routing of microbatches.

A stage runs on one or more ranks (its replicas; every replica holds the same stage module and the
same initial weights). ``Pipeline.meta`` describes it with optional keys; when they are absent the
pipeline runs as one rank per stage (rank = stage, vendor from ``meta["vendors"]``):

- ``placement``: by rank, ``{"stage": k, "replica": r, "vendor": "nvidia" | "amd" | "cpu", ...}``, the
  one list of ranks that ``hetcc.runtime.placement`` also writes (device, node, local_index and the
  torchrun ranks for ``hetcc.launch``). Replicas of a stage are numbered 0..R-1.
- ``routing``: per stage, M replica indices: microbatch m of stage k runs on replica ``routing[k][m]``.
- ``recompute``: per stage, whether its forward runs under activation checkpointing.
- ``precision``: ``"fp32"`` | ``"bf16-mixed"`` | ``"fp16-mixed"``.
- ``loss_scale``: fp16 only, options of ``hetcc.runtime.precision.LossScaler`` (``init_scale``,
  ``growth_factor``, ``backoff_factor``, ``growth_interval``; torch.amp.GradScaler's defaults).

A replica runs the subsequence of its stage's schedule whose microbatches it owns: that only removes
waits, so the pipeline stays deadlock-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetcc.errors import PlanFormatError
from hetcc.solver.schedules import Action, stage_actions

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
LOSS_SCALE_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass(frozen=True)
class RankPlacement:
    """One rank: the stage and replica it runs, its device's vendor and (optionally) where it is."""

    stage: int
    replica: int
    vendor: str = "cpu"
    device: str | None = None  # the cluster's device name
    node: str | None = None  # the host
    local_index: int | None = None  # device ordinal on that host


@dataclass(frozen=True)
class RankLayout:
    """Every rank's placement, the replica that runs each (stage, microbatch), recompute, precision."""

    ranks: tuple[RankPlacement, ...]
    routing: tuple[tuple[int, ...], ...]  # [stage][microbatch] -> replica
    recompute: tuple[bool, ...]  # per stage
    precision: str = "fp32"
    loss_scale: dict[str, float] = field(default_factory=dict)  # LossScaler options (fp16-mixed)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], num_stages: int, microbatches: int) -> RankLayout:
        """Read (and check) the layout keys of ``Pipeline.meta``; absent keys mean one rank per stage,
        every microbatch on replica 0, no recompute, fp32."""
        ranks = placements(meta, num_stages)
        routing = meta.get("routing") or [[0] * microbatches for _ in range(num_stages)]
        layout = cls(
            ranks,
            tuple(tuple(int(r) for r in row) for row in routing),
            tuple(bool(flag) for flag in (meta.get("recompute") or [False] * num_stages)),
            meta.get("precision") or "fp32",
            dict(meta.get("loss_scale") or {}),
        )
        layout._check(num_stages, microbatches)
        return layout

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks of ``stage``'s replicas, by replica index."""
        return [
            rank for _, rank in sorted((p.replica, i) for i, p in enumerate(self.ranks) if p.stage == stage)
        ]

    def rank_running(self, stage: int, microbatch: int) -> int:
        """The rank that runs microbatch ``microbatch`` of ``stage``."""
        return self.stage_ranks(stage)[self.routing[stage][microbatch]]

    def actions(self, schedule: str, rank: int, training: bool = True) -> list[Action]:
        """``rank``'s part of its stage's schedule (forwards only unless ``training``): the actions of
        the microbatches routed to it."""
        placement = self.ranks[rank]
        replicas = [sum(1 for r in self.ranks if r.stage == k) for k in range(len(self.routing))]
        every = stage_actions(
            schedule, len(self.routing), len(self.routing[0]), training=training, replicas=replicas
        )[placement.stage]
        return [a for a in every if self.routing[placement.stage][a.microbatch] == placement.replica]

    def replica_groups(self) -> list[list[int]]:
        """Per stage with more than one replica (in stage order), the ranks whose gradients are summed."""
        groups = [self.stage_ranks(k) for k in range(len(self.routing))]
        return [group for group in groups if len(group) > 1]

    def holders(self, stages: Sequence[int]) -> list[int]:
        """Every rank running one of ``stages`` (e.g. all replicas of the stages of a tied group)."""
        return sorted(rank for rank, p in enumerate(self.ranks) if p.stage in stages)

    def vendors(self) -> list[str]:
        return [p.vendor for p in self.ranks]

    def _check(self, num_stages: int, microbatches: int) -> None:
        for k in range(num_stages):
            replicas = sorted(p.replica for p in self.ranks if p.stage == k)
            if replicas != list(range(len(replicas))) or not replicas:
                _fail(f"stage {k} has replicas {replicas}; expected 0..R-1 with R >= 1", "placement")
        if any(p.stage not in range(num_stages) for p in self.ranks):
            _fail(f"a rank names a stage outside 0..{num_stages - 1}", "placement")
        if len(self.routing) != num_stages or any(len(row) != microbatches for row in self.routing):
            _fail(f"routing must list {num_stages} stages x {microbatches} microbatches", "routing")
        for k, row in enumerate(self.routing):
            count = len(self.stage_ranks(k))
            if any(r not in range(count) for r in row):
                _fail(f"routing of stage {k} names a replica outside 0..{count - 1}: {list(row)}", "routing")
        if len(self.recompute) != num_stages:
            _fail(f"recompute must have one flag per stage ({num_stages})", "recompute")
        if self.precision not in PRECISIONS:
            _fail(f"unknown precision {self.precision!r}", "precision", f"use one of {', '.join(PRECISIONS)}")
        unknown = sorted(set(self.loss_scale) - set(LOSS_SCALE_OPTIONS))
        if unknown:
            _fail(f"unknown options {unknown}", "loss_scale", f"use {', '.join(LOSS_SCALE_OPTIONS)}")


def placements(meta: Mapping[str, Any], num_stages: int) -> tuple[RankPlacement, ...]:
    """Every rank's placement from ``meta["placement"]``, else one rank per stage."""
    if meta.get("placement"):
        return tuple(_placement(entry, rank) for rank, entry in enumerate(meta["placement"]))
    vendors = meta.get("vendors") or ["cpu"] * num_stages
    return tuple(RankPlacement(k, 0, str(vendors[k])) for k in range(num_stages))


def _placement(entry: Mapping[str, Any], rank: int) -> RankPlacement:
    try:
        return RankPlacement(
            int(entry["stage"]), int(entry.get("replica", 0)), str(entry.get("vendor", "cpu")),
            entry.get("device"), entry.get("node"), entry.get("local_index"),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as error:
        _fail(f"rank {rank}: {entry!r} is not a placement ({error})", "placement")


def _fail(message: str, key: str, hint: str | None = None) -> None:
    raise PlanFormatError(
        f"pipeline meta {key!r}: {message}",
        hint=hint or "fix the plan's meta (see hetcc.runtime.layout), or save the pipeline again",
    )
