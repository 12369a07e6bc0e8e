"""The checks a plan of a ``PartitionProblem`` passes before it is costed (``objective.stage_costs``):
its cuts, replica groups, flags and codecs against the problem's blocks and devices."""

from __future__ import annotations

from hetcc.errors import PlanFormatError
from hetcc.solver.schedules import ZBV, interleavable


def check_plan(problem, boundaries, groups, recompute, codecs, shard, chunks: int = 1) -> None:
    """Raise PlanFormatError naming what is wrong with a plan of ``problem`` (``objective.stage_costs``'s
    arguments): its boundaries, replica groups (each device in one, or with ``chunks`` > 1 the first
    K / chunks stages' single devices again for each further chunk: an interleaved plan), flags, codecs."""
    n = len(problem.blocks)
    if len(boundaries) != len(groups) + 1 or not groups:
        raise PlanFormatError(
            f"a plan with {len(groups)} stage(s) needs {len(groups) + 1} boundaries, got {len(boundaries)}",
            hint="pass boundaries [0, ..., num_blocks] with one more entry than stages",
        )
    if boundaries[0] != 0 or boundaries[-1] != n or any(a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise PlanFormatError(
            f"boundaries {list(boundaries)} must rise strictly from 0 to {n} (every stage non-empty)",
            hint="give each stage at least one block",
        )
    ranks = len(groups) // chunks if chunks >= 1 and len(groups) % chunks == 0 else 0
    if problem.schedule == ZBV and (
        chunks != 2
        or any(groups[j] != groups[len(groups) - 1 - j] or len(groups[j]) != 1 for j in range(ranks))
    ):
        raise PlanFormatError(
            f"a ZB-V plan runs two stages per device in a V (chunks=2, stage j and K - 1 - j on one device, one "
            f"device each), got chunks={chunks!r} and {[list(g) for g in groups]}",
            hint="give the first K / 2 stages' devices again, in reverse order, for the last K / 2",
        )
    if chunks != 1 and problem.schedule != ZBV:
        _check_interleaved(problem, groups, chunks, ranks)
    flat = [d for g in groups[: ranks or len(groups)] for d in g]
    if not all(groups) or len(set(flat)) != len(flat) or not all(0 <= d < len(problem.devices) for d in flat):
        raise PlanFormatError(
            f"devices {[list(g) for g in groups]} must be non-empty groups of distinct indices below "
            f"{len(problem.devices)}",
            hint="use each device at most once",
        )
    if mixed := mixed_tensor_group(problem, groups):
        names = [problem.devices[d].name for d in mixed]
        raise PlanFormatError(f"devices {names} run one stage as tensor groups of different degrees",
                              hint="a stage's replicas are tensor groups of one degree (it is split one way)")  # fmt: skip
    if len(recompute) != len(groups):
        raise PlanFormatError(
            f"recompute has {len(recompute)} entries for {len(groups)} stages", hint="one flag per stage"
        )
    if len(shard) != len(groups) or any(f and len(g) < 2 for f, g in zip(shard, groups)):
        raise PlanFormatError(
            f"shard {shard!r} must give one flag per stage ({len(groups)}), True only for a replicated stage",
            hint="one flag per stage; ZeRO-1 splits optimizer state across a stage's replicas",
        )
    pinned_ok = (c is None or isinstance(c, (tuple, list)) and len(c) == 2 and all(isinstance(x, str) for x in c)
                 for c in codecs)  # fmt: skip
    if len(codecs) != len(groups) or not all(pinned_ok):
        raise PlanFormatError(
            f"codecs {codecs!r} must give {len(groups)} entries, each None or (activation, gradient) names",
            hint="one entry per stage; None lets the planner choose",
        )


def _check_interleaved(problem, groups, chunks, ranks: int) -> None:
    """An interleaved 1F1B plan: stage j on the group of stage j mod ``ranks``, every group as many
    devices of one type (the pipeline replicated whole), each replica's share of the microbatches (in
    turn, as equal replicas take them) in rounds ``interleaved_actions`` takes."""
    if (
        problem.schedule != "1f1b"
        or not ranks
        or any(groups[j] != groups[j % ranks] or len(groups[j]) != len(groups[0]) for j in range(len(groups)))
        or any(
            len({problem.devices[d].type for d in group}) > 1 for group in groups if _known(group, problem)
        )
    ):
        raise PlanFormatError(
            f"an interleaved plan of {chunks!r} chunks needs the 1f1b schedule (got {problem.schedule!r}) and a "
            f"multiple of {chunks!r} stages, stage j on the group of stage j mod K / chunks, every group as many "
            f"devices of one type (the pipeline replicated whole), got {[list(g) for g in groups]}",
            hint="repeat the first K / chunks stages' groups for every further chunk",
        )
    replicas = len(groups[0])
    shares = [len(range(r, problem.microbatches, replicas)) for r in range(replicas)]
    if not all(interleavable(ranks, share) for share in shares):
        raise PlanFormatError(
            f"an interleaved plan over {ranks} devices with {replicas} replica(s) each runs {shares} of the "
            f"{problem.microbatches} microbatches per replica: each share must be at least {ranks}, in rounds of "
            "equal size",
            hint=f"use a multiple of {ranks * replicas} microbatches",
        )


def _known(group, problem) -> bool:
    """Whether every index of ``group`` names a device of ``problem`` (the check after says which not)."""
    return all(isinstance(d, int) and 0 <= d < len(problem.devices) for d in group)


def mixed_tensor_group(problem, groups) -> tuple[int, ...] | None:
    """The first of ``groups`` whose devices are tensor groups of different degrees
    (``ProblemDevice.tensor_degree``), None if none: the runtime splits a stage one way."""
    return next((tuple(g) for g in groups if len({problem.devices[d].tensor_degree for d in g}) > 1), None)
