"""The placement rules of the schedules whose ranks run several stages each (``PipelineMeta``'s check):
interleaved 1F1B (``schedules.interleaved_actions``, replicated whole or not) and ZB-V
(``schedules.zbv_actions``); under any other schedule a rank runs one stage."""

from __future__ import annotations

from collections.abc import Sequence

from hetcc.hardware.schema import Where, short_repr
from hetcc.runtime.placement import RankPlacement
from hetcc.solver.schedules import INTERLEAVED, ZBV, interleavable, rank_stages


def check_chunks(
    schedule: str,
    ranks: Sequence[RankPlacement],
    num_stages: int,
    routing: Sequence[Sequence[int]],
    where: Where,
) -> None:
    """A pipeline record's ``ranks`` (its placement) against its ``schedule``, ``num_stages`` and
    ``routing`` (per stage, microbatch -> replica). Interleaved 1F1B (``schedules.interleaved_actions``): p positions, position r running stages r,
    r + p, ..., the same count v at every position, whole (not tensor parallel), on the same R replicas
    (the pipeline replicated whole), with one routing for every stage and each replica's microbatches
    in rounds of p or more; under any other schedule a rank runs one stage."""
    if schedule == ZBV:
        _check_v(ranks, num_stages, where)
        return
    if schedule != INTERLEAVED:
        holder = next((rank for rank in ranks if rank.chunks and len(rank.chunks) > 1), None)
        if holder is not None:
            where.at("placement", holder.rank, "chunks").fail(
                f"rank {holder.rank} runs stages {list(holder.chunks)}, but a rank runs several stages only "
                f"under {INTERLEAVED!r} or {ZBV!r}; this pipeline's schedule is {schedule!r}"
            )
        return
    split = next((rank for rank in ranks if rank.tensor), None)
    if split is not None:
        where.at("placement", split.rank).fail(
            f"rank {split.rank} runs tensor part {split.tensor} of stage {split.stage}; {INTERLEAVED} runs "
            "its stages whole",
            "run tensor-parallel stages under another schedule",
        )
    p = len({rank.stage for rank in ranks})
    replicas, chunks = len(ranks) // max(p, 1), num_stages // max(p, 1)
    for rank in ranks:
        if (
            p < 2
            or chunks * p != num_stages
            or replicas * p != len(ranks)
            or rank.stages != rank_stages(INTERLEAVED, p, rank.stage, chunks)
        ):
            where.at("placement", rank.rank).fail(
                f"rank {rank.rank} runs stages {list(rank.stages)} as replica {rank.replica}; {INTERLEAVED} over "
                f"{p} positions runs position r's chunks as stages r, r + {p}, ... (the same number at every "
                "position, 2 positions or more, each on the same number of replicas)",
                "place it with hetcc.runtime.placement.interleaved_ranks(ranks, chunks, replicas=R), or run "
                "another schedule",
            )
    route = routing[0]
    other = next((k for k, row in enumerate(routing) if tuple(row) != tuple(route)), None)
    if other is not None:
        where.at("routing", other).fail(
            f"routes microbatches {short_repr(list(routing[other]))}, stage 0 {short_repr(list(route))}; "
            f"each replica of an {INTERLEAVED} pipeline runs the same microbatches at every stage",
            "give every stage the same routing",
        )
    shares = [list(route).count(r) for r in range(replicas)]
    if not all(interleavable(p, share) for share in shares):  # forwards alone run in the same rounds
        where.at("microbatches").fail(
            f"{len(route)} microbatches over {p} positions, {shares} per replica: {INTERLEAVED} runs "
            f"each replica's in rounds of equal size, at least {p} each",
            f"give each replica a multiple of {p}",
        )


def _check_v(ranks: Sequence[RankPlacement], num_stages: int, where: Where) -> None:
    """ZB-V (``schedules.zbv_actions``): p >= 2 ranks, rank r running stages r and 2p - 1 - r, one replica
    each, whole."""
    p = len(ranks)
    for rank in ranks:
        if (
            p < 2
            or num_stages != 2 * p
            or rank.replica
            or rank.tensor
            or rank.stages != rank_stages(ZBV, p, rank.rank, 2)
        ):
            where.at("placement", rank.rank).fail(
                f"rank {rank.rank} runs stages {list(rank.stages)} as replica {rank.replica}, part {rank.tensor}; "
                f"{ZBV} over {p} ranks runs 2p stages in a V, rank r stages r and 2p - 1 - r, one replica of each, "
                "whole, on 2 ranks or more",
                "place it with hetcc.runtime.placement.zbv_ranks(ranks), or run another schedule",
            )
