"""Schedules replayed at one unit per compute: ``unit_step_timeline`` (what each rank runs at each step,
transfers taking none) and ``format_grid``, the rank x step grid ``hetcc simulate`` prints; the closed
forms of ``hetcc.solver.schedules`` are checked on it."""

from __future__ import annotations

from collections.abc import Sequence

from hetcc.errors import PlanFormatError
from hetcc.solver.schedules import (
    INTERLEAVED,
    ZBV,
    Action,
    chunk_stage,
    interleaved_actions,
    stage_actions,
    zbv_actions,
)


def unit_step_timeline(actions: list[list[Action]], schedule: str = INTERLEAVED) -> list[list[Action | None]]:
    """Replay ``actions`` (per rank) with every compute taking one step and transfers taking none.

    A rank runs its next action at the first step after its inputs exist: F(m) after F(m) on the
    stage before, B(m) after B(m) on the stage after (the last stage's B(m) after its own F(m), and
    W(m) after its own B(m), which its order already guarantees); rank r's chunk c is the stage
    ``chunk_stage(schedule, p, r, c)``: c * p + r (``interleaved_actions``; with one chunk per rank, stage
    r), or ZB-V's V. Returns, per rank, the action at each step or None.
    """
    num_ranks = len(actions)
    num_stages = num_ranks * (1 + max((a.chunk for row in actions for a in row), default=0))
    done_at: dict[tuple[int, str, int], int] = {}
    cursor = [0] * num_ranks
    timeline: list[list[Action | None]] = [[] for _ in range(num_ranks)]
    step = 0
    while any(cursor[r] < len(actions[r]) for r in range(num_ranks)):
        ready = [
            _ready(actions[r], r, num_ranks, num_stages, cursor[r], done_at, step, schedule)
            for r in range(num_ranks)
        ]
        if not any(ready):
            raise PlanFormatError("schedule deadlocks: no stage can run", hint="report this schedule")
        for r in range(num_ranks):
            action = actions[r][cursor[r]] if ready[r] else None
            timeline[r].append(action)
            if action is not None:
                done_at[
                    (chunk_stage(schedule, num_ranks, r, action.chunk), action.kind, action.microbatch)
                ] = step
                cursor[r] += 1
        step += 1
    return timeline


def _ready(
    actions, rank: int, num_ranks: int, num_stages: int, index: int, done_at: dict, step: int, schedule: str
) -> bool:
    if index >= len(actions):
        return False
    action = actions[index]
    stage = chunk_stage(schedule, num_ranks, rank, action.chunk)
    source = stage - 1 if action.kind == "F" else stage + 1
    if action.kind == "W" or source < 0 or source >= num_stages:
        return True  # a weight gradient waits only for its own stage's B, which comes before it
    finished = done_at.get((source, action.kind, action.microbatch))
    return finished is not None and finished < step


def format_grid(
    schedule: str,
    num_stages: int,
    microbatches: int,
    training: bool = True,
    *,
    comm: bool = True,
    recompute: Sequence[bool] | None = None,
    deferred: Sequence[int] | None = None,
    warmup: Sequence[int] | None = None,
    chunks: int = 1,
) -> str:
    """The schedule as a rank x step grid (one row per rank, one column per unit compute step).

    Every compute takes one step and transfers none, so the grid shows order and overlap, not time.
    With ``comm`` a cell also names the transfers around its compute: ``RECV_F3 F3 SEND_F3`` on a
    middle rank (activations arrive from the previous rank and leave for the next), ``RECV_B3 B3
    SEND_B3`` for gradients going the other way. Idle cells print ``.``. ``recompute`` (per stage):
    the stages whose backward a split schedule cannot split; ``deferred`` (per stage) the weight
    gradients each defers and ``warmup`` the forwards before its first backward (``stage_actions``).
    ``INTERLEAVED`` with ``chunks`` per rank: ``num_stages`` ranks, each holding that many stages
    (``interleaved_actions``; a cell's ``.c`` names its chunk c > 0); ``ZBV``: ``num_stages`` ranks of
    two stages in a V (``zbv_actions``).
    """
    if schedule == INTERLEAVED:
        actions = interleaved_actions(num_stages, chunks, microbatches)
    elif schedule == ZBV:
        actions, chunks = zbv_actions(num_stages, microbatches, training), 2
    else:
        actions = stage_actions(
            schedule, num_stages, microbatches, training=training, recompute=recompute, deferred=deferred,
            warmup=warmup,
        )  # fmt: skip
    timeline = unit_step_timeline(actions, schedule)
    last = num_stages * chunks - 1
    rows = [
        [_cell(action, r, num_stages, last, comm, schedule) for action in row]
        for r, row in enumerate(timeline)
    ]
    widths = [max(len(str(t)), *(len(row[t]) for row in rows)) for t in range(len(rows[0]))]
    labels = [f"rank {s}" for s in range(num_stages)]
    label_width = len(labels[-1])
    lines = [" " * label_width + " | " + "  ".join(f"{t:<{w}}" for t, w in enumerate(widths))]
    lines.append("-" * len(lines[0]))
    for label, row in zip(labels, rows):
        lines.append(f"{label:<{label_width}} | " + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths)))
    return "\n".join(line.rstrip() for line in lines)


def _cell(action: Action | None, rank: int, num_ranks: int, last: int, comm: bool, schedule: str) -> str:
    if action is None:
        return "."
    if not comm or action.kind == "W":  # a weight gradient moves nothing
        return str(action)
    # Forwards receive from the previous stage's rank and send to the next; backwards the other way.
    stage = chunk_stage(schedule, num_ranks, rank, action.chunk)
    has_prev, has_next = stage > 0, stage < last
    receives, sends = (has_prev, has_next) if action.kind == "F" else (has_next, has_prev)
    parts = [f"RECV_{action}"] if receives else []
    parts.append(str(action))
    if sends:
        parts.append(f"SEND_{action}")
    return " ".join(parts)
