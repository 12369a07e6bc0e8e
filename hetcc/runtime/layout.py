"""Which rank runs what: a pipeline's ranks and the routing of microbatches to stage replicas, as the
executor and the transport use them (``RankLayout``, a view of ``hetcc.runtime.contract.PipelineMeta``).

A stage runs on one or more ranks (its replicas; every replica holds the same stage module and the
same initial weights); microbatch m of stage k runs on replica ``routing[k][m]``. A tensor-parallel
stage's replica is t ranks (its parts 0..t-1), which run every microbatch of the replica together. A replica runs the
subsequence of its stage's schedule whose microbatches it owns: that only removes waits, so the pipeline
stays deadlock-free. Under interleaved 1F1B a rank runs several stages, one per chunk
(``RankPlacement.chunks``), in the order ``schedules.interleaved_actions`` gives its rank; replicated,
each replica of the pipeline runs that order over the microbatches routed to it
(``schedules.replica_interleaved_actions``); under ZB-V rank r runs stages r and 2p - 1 - r
(``schedules.zbv_actions``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.placement import RankPlacement
from hetcc.solver.schedules import MULTI_STAGE, ZBV, Action, rank_order, stage_actions


@dataclass(frozen=True)
class RankLayout:
    """Every rank's placement, the replica that runs each (stage, microbatch), recompute, precision."""

    ranks: tuple[RankPlacement, ...]
    routing: tuple[tuple[int, ...], ...]  # [stage][microbatch] -> replica
    recompute: tuple[bool, ...]  # per stage
    precision: str = "fp32"
    loss_scale: dict[str, float] = field(default_factory=dict)  # LossScaler options (fp16-mixed)
    deferred: tuple[int, ...] | None = None  # per stage: W deferred under a split schedule (None: ZB-H1's)
    # per stage: the forwards it runs before its first backward (None: the schedule's)
    warmup: tuple[int, ...] | None = None

    @classmethod
    def from_meta(cls, meta: PipelineMeta) -> RankLayout:
        """The layout a pipeline's record describes (checked when the record was made)."""
        return cls(
            meta.placement, meta.routing, meta.recompute, meta.precision, dict(meta.loss_scale), meta.deferred,
            meta.warmup,
        )  # fmt: skip

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stage_ranks(self, stage: int, tensor: int = 0) -> list[int]:
        """The ranks of ``stage``'s replicas (their part ``tensor``), by replica index."""
        return [
            rank
            for _, rank in sorted(
                (p.replica, i) for i, p in enumerate(self.ranks) if stage in p.stages and p.tensor == tensor
            )
        ]

    def rank_running(self, stage: int, microbatch: int, tensor: int = 0) -> int:
        """The rank that runs part ``tensor`` of microbatch ``microbatch`` of ``stage``."""
        return self.stage_ranks(stage, tensor)[self.routing[stage][microbatch]]

    def tensor_degree(self, stage: int) -> int:
        """How many ranks each replica of ``stage`` is (1 unless it is tensor parallel)."""
        return 1 + max(p.tensor for p in self.ranks if stage in p.stages)

    def actions(self, schedule: str, rank: int, training: bool = True) -> list[Action]:
        """``rank``'s part of its stage's schedule (forwards only unless ``training``): the actions of
        the microbatches routed to it; under interleaved 1F1B and ZB-V its row of its replica's order
        (``schedules.rank_order``), each action's ``chunk`` naming which of its stages runs it."""
        placement = self.ranks[rank]
        if schedule in MULTI_STAGE:  # one routing for every stage (``contract``); position r runs row r
            chunks = len(placement.stages)
            route, position = self.routing[placement.stage], placement.stage
            rows = rank_order(
                schedule, len(self.routing) // chunks, chunks, route, placement.replica, training
            )
            return list(rows[position])
        replicas = [len(self.stage_ranks(k)) for k in range(len(self.routing))]
        every = stage_actions(
            schedule, len(self.routing), len(self.routing[0]), training=training, replicas=replicas,
            recompute=self.recompute, deferred=self.deferred,
            warmup=None if schedule == "gpipe" else self.warmup,  # GPipe runs every forward first
        )[placement.stage]  # fmt: skip
        return [a for a in every if self.routing[placement.stage][a.microbatch] == placement.replica]

    def channels(
        self, schedule: str, peers: Sequence[Collection[int]] | None = None
    ) -> list[tuple[int, int, int, int]]:
        """(rank a, rank b, stage s, stage t) per pair of stages on two ranks whose messages keep an order of
        their own (``groups.Links``): under ZB-V, whose ranks post and take a rank pair's messages in
        different orders, every such pair that talks (``peers[s]``: the stages stage s receives from or
        sends to; None: every pair); none under the other schedules, whose rank pairs keep one order."""
        if schedule != ZBV:
            return []
        stages = len(self.routing)
        ranks = [self.stage_ranks(k)[0] for k in range(stages)]
        return [
            (ranks[s], ranks[t], s, t)
            for s in range(stages)
            for t in range(s + 1, stages)
            if ranks[s] != ranks[t] and (peers is None or t in peers[s] or s in peers[t])
        ]

    def replica_groups(self) -> list[list[int]]:
        """Per stage with more than one replica (in stage order) and per part, the ranks whose gradients
        are summed; each set of ranks once (an interleaved rank's stages share their replicas' ranks)."""
        groups = [
            self.stage_ranks(k, part)
            for k in range(len(self.routing))
            for part in range(self.tensor_degree(k))
        ]
        return [group for i, group in enumerate(groups) if len(group) > 1 and group not in groups[:i]]

    def tensor_groups(self) -> list[list[int]]:
        """Per tensor-parallel replica (in stage and replica order), its ranks by part."""
        groups = []
        for k in range(len(self.routing)):
            degree = self.tensor_degree(k)
            parts = [self.stage_ranks(k, part) for part in range(degree)]
            groups += [list(ranks) for ranks in zip(*parts)] if degree > 1 else []
        return groups

    def holders(self, stages: Sequence[int]) -> list[int]:
        """Every rank running one of ``stages`` (e.g. all replicas of the stages of a tied group)."""
        return sorted(rank for rank, p in enumerate(self.ranks) if set(p.stages) & set(stages))

    def vendors(self) -> list[str]:
        return [p.vendor for p in self.ranks]
