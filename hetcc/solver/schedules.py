"""Pipeline schedules: the order in which each stage runs its microbatches' forwards and backwards.

A schedule is policy only: per stage, a list of compute actions (``F3`` = forward of microbatch 3,
``B3`` = its backward; under a zero-bubble schedule ``B3`` is the gradient of the stage's inputs only
and ``W3`` the gradient of its weights, deferred). The runtime executes the list with send/recv around
each action; the simulator replays it with costs; ``grid.format_grid`` prints it as a rank x step grid.

- ``gpipe``: every forward, then every backward (in microbatch order 0..M-1). Each stage holds the
  activations of all M microbatches at once.
- ``1f1b``: stage ``s`` of ``K`` first runs ``min(M, K - s)`` forwards, then alternates one backward
  and one forward, then drains the remaining backwards. This is the order of
  ``torch.distributed.pipelining.Schedule1F1B``; stage ``s`` holds at most ``min(M, K - s)``
  microbatches' activations.
- ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", the H1 schedule; torch's
  ``ScheduleInterleavedZeroBubble`` with one stage per rank): 1F1B's order of forwards and input
  gradients, with each weight gradient ``W`` deferred: stage ``s`` runs ``W(m)`` once ``d_s`` further
  input gradients have run, and the last ones after its final ``B``. ZB-H1 defers ``d_s = s`` (the
  replicas before it, with replicas: ``zb_deferrals``); its bubble is a third of 1F1B's at equal F, B
  and W (3M + p - 1 unit steps against 3M + 3(p - 1)), and every stage holds min(M, p) microbatches'
  activations until their ``W`` (1F1B: p - s until ``B``). Each deferred ``W`` keeps its microbatch's
  activations, so a plan may defer fewer (``deferred``: the planner caps each stage's ``d_s`` to what
  its memory holds, as the paper's memory-limited schedules do; unequal devices have unequal room).
  With ``d_s = 0`` the stage is 1F1B's in order and memory, but still sends its input gradient back
  before computing its weight gradients. A stage whose backward cannot be split (``splits_backward``:
  the first stage, whose inputs take no gradient, and a recomputing one) runs its whole backward as
  ``B`` and no ``W``: 1F1B's order.
- ``zb-h2`` (the paper's H2 schedule): ZB-H1 with more forwards before the first backward, to fill the
  wait for the first input gradient: stage ``s`` of ``p`` warms up with ``2(p - s) - 1`` forwards (with
  replicas, twice the replicas of stages s..K-1, less one; at most M), so its first ``B`` finds the
  stage busy, not idle; the deferred ``W`` fill the drain as in ZB-H1. It holds up to twice ZB-H1's
  microbatches' activations, so a plan may warm up with fewer (``warmup``: the planner caps each stage's
  warm-up to what its memory holds once ZB-H1's deferred W's are held, at least 1F1B's; on the
  Llama-2-70B plan, warm-up first took 39% longer steps than ZB-H1). The paper closes the last of its bubble by
  letting each stage's optimizer step start without waiting for the others (post-validation); hetcc's
  step ends together, so the last stage still waits ``p - 1`` forwards for its first input at the start.

Every 1F1B-family schedule (all but ``gpipe``) takes a per-stage ``warmup``: the forwards a stage runs
before its first backward, from 1F1B's (``warmup_forwards("1f1b", ...)``) to M, none above the stage
before's (``stage_warmups`` says why: each such order is deadlock-free). The planner tunes it per stage
by simulation: on unequal devices the best warm-up differs per stage.

With ``training=False`` every schedule reduces to forwards only, in microbatch order.

``interleaved-1f1b`` (``INTERLEAVED``, ``interleaved_actions``): v stages per rank, 1F1B's bubble over v.
The simulator replays it (``simulate(..., chunks=v)``), ``solver.interleave`` prices it on a
pipeline's devices, and the runtime runs a pipeline saved with it (``PIPELINE_SCHEDULES``: each rank holds
its v stages, ``RankPlacement.chunks``); the planner plans it where the user pins it or under "auto"
(``solver.interleave.solve_interleaved``).

``zbv`` (``ZBV``, ``zbv_actions``): two stages per rank in a V, every backward split. The simulator
replays it (a problem of schedule ``ZBV``, ``simulate(..., chunks=2)``), ``solver.interleave.solve_zbv``
plans it (pinned, or under "auto") and the runtime runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from hetcc.errors import PlanFormatError

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
SPLIT_SCHEDULES = ("zb-h1", "zb-h2")  # the schedules that run input and weight gradients apart
INTERLEAVED = "interleaved-1f1b"  # several stages per rank (``interleaved_actions``)
# ZB-V: two stages per rank in a V, each backward split (``zbv_actions``). Its ranks do not post and take
# each rank pair's messages in one order, so the runtime keeps an order per stage pair for it
# (``runtime.groups.Links``).
ZBV = "zbv"
MULTI_STAGE = (INTERLEAVED, ZBV)  # the schedules whose ranks run several stages each
PIPELINE_SCHEDULES = (*SCHEDULES, *MULTI_STAGE)  # what a plan may use and a saved pipeline runs


@dataclass(frozen=True)
class Action:
    """One compute action of a stage: ``kind`` is ``"F"`` (forward), ``"B"`` (backward: under a split
    schedule the input gradient only) or ``"W"`` (the weight gradient of a split backward). ``chunk``:
    which of its rank's stages runs it, under an interleaved order (``interleaved_actions``: stage
    ``chunk * ranks + rank``); 0 where a rank holds one stage."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def check_schedule_args(schedule: str, num_stages: int, microbatches: int) -> None:
    """Raise PlanFormatError naming the bad argument; shared by every schedule consumer."""
    if schedule not in SCHEDULES:
        raise PlanFormatError(
            f"unknown pipeline schedule {schedule!r}", hint=f"use one of {', '.join(SCHEDULES)}"
        )
    for name, value in (("num_stages", num_stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanFormatError(
                f"schedule {schedule!r}: {name} must be a positive integer, got {value!r}",
                hint=f"pass {name} >= 1",
            )


def splits_backward(schedule: str, recompute: Sequence[bool]) -> list[bool]:
    """Per stage, whether its backward runs as ``B`` (input gradient) then ``W`` (weight gradient): under
    a split schedule (and ZB-V), every stage but the first (whose inputs take no gradient: its whole
    backward is weight gradient) and those that recompute (their backward runs the forward again, once)."""
    return [schedule in (*SPLIT_SCHEDULES, ZBV) and j > 0 and not r for j, r in enumerate(recompute)]


def stage_actions(
    schedule: str,
    num_stages: int,
    microbatches: int,
    *,
    training: bool = True,
    replicas: Sequence[int] | None = None,
    recompute: Sequence[bool] | None = None,
    deferred: Sequence[int] | None = None,
    warmup: Sequence[int] | None = None,
) -> list[list[Action]]:
    """Per stage (index = stage), its compute actions in execution order.

    With ``replicas`` (devices per stage), a 1F1B stage warms up with min(M, replicas of stages
    s..K-1) forwards, enough to keep every downstream replica busy; each replica then runs the
    subsequence of its stage's actions whose microbatches it owns (``replica_actions``). Dropping
    actions only removes waits, so the replicated schedule is as deadlock-free as this one. A zb-h1
    stage defers ``deferred[s]`` weight gradients (None: ZB-H1's, ``zb_deferrals``: as many as the
    replicas before it, so every stage holds min(M, all replicas) microbatches); ``recompute`` (per
    stage) says which cannot split. ``warmup`` (per stage): the forwards before its first backward, from
    1F1B's to M (None: the schedule's, ``warmup_forwards``).
    """
    check_schedule_args(schedule, num_stages, microbatches)
    if replicas is not None and (len(replicas) != num_stages or any(r < 1 for r in replicas)):
        raise PlanFormatError(
            f"replicas {list(replicas)} must give a positive count for each of {num_stages} stages",
            hint="one entry per stage",
        )
    if not training:
        return [[Action("F", m) for m in range(microbatches)] for _ in range(num_stages)]
    counts = [1] * num_stages if replicas is None else list(replicas)
    warmup = stage_warmups(schedule, counts, microbatches, warmup)
    orders = [one_f_one_b(microbatches, w) for w in warmup]
    if schedule not in SPLIT_SCHEDULES:
        return orders
    split = splits_backward(schedule, recompute or [False] * num_stages)
    if deferred is None:
        deferred = zb_deferrals(counts)
    elif len(deferred) != num_stages or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in deferred
    ):
        raise PlanFormatError(
            f"deferred {list(deferred)} must give a count >= 0 of weight gradients for each of {num_stages} stages",
            hint="one entry per stage (0: each W right after its B)",
        )
    return [defer_weights(order, deferred[s]) if split[s] else order for s, order in enumerate(orders)]


def stage_warmups(
    schedule: str, replicas: Sequence[int], microbatches: int, warmup: Sequence[int] | None = None
) -> list[int]:
    """``warmup`` (per stage: forwards before its first backward), checked to lie between 1F1B's and M
    for each stage (GPipe's: M) and not to grow from one stage to the next, or the schedule's own
    (``warmup_forwards``) where it is None.

    A stage that warmed up with more forwards than the one before it would wait for a forward that
    stage sends only after this stage's first backward: stage s's B(k) follows its F(k + w_s - 1), which
    follows stage s-1's B(k + w_s - 1 - w_(s-1)), which follows stage s's: a cycle unless w_s <= w_(s-1).
    With that, each B waits only on earlier B's: every such order runs."""
    if warmup is None:
        return warmup_forwards(schedule, replicas, microbatches)
    if len(warmup) != len(replicas) or warmup_fault(schedule, replicas, microbatches, warmup) is not None:
        raise PlanFormatError(
            f"schedule {schedule!r}: warm-up forwards {list(warmup)} must give, for each of {len(replicas)} "
            f"stages, a count from {least_warmups(schedule, replicas, microbatches)} (1F1B's) to "
            f"{microbatches} (M), none above the stage before's",
            hint="one entry per stage, or none for the schedule's own",
        )
    return list(warmup)


def warmup_fault(
    schedule: str, replicas: Sequence[int], microbatches: int, warmup: Sequence[int]
) -> tuple[int, str] | None:
    """The first stage whose warm-up ``stage_warmups`` refuses, and why; None where every stage's runs."""
    least = least_warmups(schedule, replicas, microbatches)
    for k, (w, low) in enumerate(zip(warmup, least)):
        if isinstance(w, bool) or not isinstance(w, int) or not low <= w <= microbatches:
            return (
                k,
                f"{w!r} forwards before the first backward; expected {low} (1F1B's) to {microbatches} (M)",
            )
        if k and w > warmup[k - 1]:
            return k, f"{w} forwards before the first backward, more than the stage before's {warmup[k - 1]}"
    return None


def least_warmups(schedule: str, replicas: Sequence[int], microbatches: int) -> list[int]:
    """Per stage, the fewest forwards it may run before its first backward: GPipe's M, else 1F1B's."""
    return warmup_forwards("gpipe" if schedule == "gpipe" else "1f1b", replicas, microbatches)


def recorded_warmup(stages: Sequence) -> list[int] | None:
    """Each stage's ``warmup`` as a plan's stages (``PlanStage``, ``StageCost``) record it; None where
    they do not (an inference plan, or a plan written before plans said it: the schedule's own then)."""
    return [s.warmup for s in stages] if stages and all(s.warmup for s in stages) else None


def warmup_forwards(schedule: str, replicas: Sequence[int], microbatches: int) -> list[int]:
    """Per stage, the forwards it runs before its first backward under ``schedule`` (training) with
    ``replicas`` per stage: M under GPipe; 1F1B's (and ZB-H1's) min(M, replicas of stages s..K-1), enough
    to keep every downstream replica busy; ZB-H2's min(M, twice that less one), which fills the round
    trip of the first microbatch."""
    depths = [downstream_replicas(s, len(replicas), replicas) for s in range(len(replicas))]
    if schedule == "gpipe":
        return [microbatches] * len(depths)
    if schedule == "zb-h2":
        return [min(microbatches, 2 * depth - 1) for depth in depths]
    return [min(microbatches, depth) for depth in depths]


def downstream_replicas(stage: int, num_stages: int, replicas: Sequence[int] | None = None) -> int:
    """The replicas of stages ``stage``..K-1 (K - stage without replicas): the forwards a 1F1B stage runs
    before its first backward where M allows, enough to keep every later replica busy."""
    return num_stages - stage if replicas is None else sum(replicas[stage:])


def zb_deferrals(replicas: Sequence[int]) -> list[int]:
    """ZB-H1's weight gradients deferred per stage: the replicas of the stages before it (s without
    replicas), so that every stage holds as many microbatches as the first."""
    return [sum(replicas[:s]) for s in range(len(replicas))]


def replica_actions(actions: Sequence[Action], route: Sequence[int], replica: int) -> list[Action]:
    """The actions of one replica: those of its stage whose microbatch ``route`` sends to it."""
    return [a for a in actions if route[a.microbatch] == replica]


def one_f_one_b(microbatches: int, warmup: int) -> list[Action]:
    """``warmup`` forwards, then B/F pairs while forwards remain, then the remaining backwards (with
    ``warmup`` = M: GPipe's order)."""
    order = [Action("F", m) for m in range(warmup)]
    for m in range(microbatches):
        order.append(Action("B", m))
        if warmup + m < microbatches:
            order.append(Action("F", warmup + m))
    return order


def defer_weights(order: Sequence[Action], lag: int) -> list[Action]:
    """``order`` (F and B) with a ``W`` for every ``B``: ``W(k)`` once ``lag`` more ``B`` have run after
    ``B(k)``, before the forward that follows; the rest after the last ``B`` (ZB-H1's rule)."""
    out: list[Action] = []
    pending: list[int] = []
    for action in order:
        out.append(action)
        if action.kind == "B":
            pending.append(action.microbatch)
            if len(pending) > lag:
                out.append(Action("W", pending.pop(0)))
    return out + [Action("W", m) for m in pending]


def interleaved_actions(
    ranks: int, chunks: int, microbatches: int, training: bool = True
) -> list[list[Action]]:
    """Per rank, its actions under interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language
    Model Training on GPU Clusters", Megatron-LM's order; torch's ``ScheduleInterleaved1F1B``): the model
    is cut into ``chunks * ranks`` stages and rank r holds stages r, r + p, ..., one per chunk, so a
    microbatch crosses every rank ``chunks`` times. The M microbatches run in rounds of n = M / (M // p)
    (p where M is a multiple of p, Megatron's rule; torch's rounds otherwise, which take any M >= p that
    the round count divides): each rank runs its forwards in groups of n microbatches per chunk (chunk 0
    for microbatches 0..n-1, chunk 1 for the same, ..., then the next n), its backwards likewise from
    the last chunk down; it warms up with 2(p - r - 1) + (v - 1)n forwards (all v*M where M = p), then
    alternates one forward and one backward, then drains. Its bubble is 1F1B's over v: 2(p - 1) chunk
    steps at equal F and B (``grid.unit_step_timeline``) where M is a multiple of p, against 2v(p - 1) for
    1F1B on the same chunks in v-times larger stages. One chunk per rank is 1F1B's order. Without
    ``training``, each rank's forwards alone, in the same order.

    The simulator replays it (``simulate(..., chunks=v)``) and the runtime runs it (``RankLayout.actions``);
    the planner plans it pinned or under "auto" (``solver.interleave.solve_interleaved``). ``grid.format_grid(INTERLEAVED,
    ...)`` prints it."""
    check_schedule_args("1f1b", ranks, microbatches)
    if (
        isinstance(chunks, bool)
        or not isinstance(chunks, int)
        or chunks < 1
        or not interleavable(ranks, microbatches)
    ):
        raise PlanFormatError(
            f"interleaved 1F1B: {chunks!r} chunks per rank and {microbatches} microbatches over {ranks} ranks",
            hint="give each rank 1 or more chunks, and at least as many microbatches as ranks, in rounds of "
            "equal size (M divisible by M // ranks, as every multiple of the ranks is)",
        )
    if chunks == 1:
        return stage_actions("1f1b", ranks, microbatches, training=training)
    size = microbatches // (microbatches // ranks)  # of a round
    total, group = chunks * microbatches, size * chunks

    def action(kind: str, k: int) -> Action:  # the k-th forward (backward) of a rank
        chunk = (k % group) // size
        microbatch = (k // group) * size + k % size
        return Action(kind, microbatch, chunk if kind == "F" else chunks - 1 - chunk)

    if not training:
        return [[action("F", k) for k in range(total)] for _ in range(ranks)]
    orders = []
    for rank in range(ranks):
        warmup = total if microbatches == ranks else min(total, 2 * (ranks - rank - 1) + (chunks - 1) * size)
        order = [action("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [action("F", warmup + k), action("B", k)]
        orders.append(order + [action("B", k) for k in range(total - warmup, total)])
    return orders


@functools.lru_cache(maxsize=256)
def replica_interleaved_actions(
    ranks: int, chunks: int, route: tuple[int, ...], replica: int, training: bool = True
) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the interleaved 1F1B order (``interleaved_actions``) that replica ``replica`` of a
    pipeline replicated whole runs: the microbatches ``route`` (microbatch -> replica, the same for every
    stage) sends it, in rounds of their own, numbered as in the step. Each replica is its own pipeline
    until the step ends (Megatron-LM's data x pipeline parallelism), so the order of messages between two
    of its ranks is the order ``interleaved_actions`` gives them. Cached: the planner replays many plans
    of the same shape."""
    mine = [m for m, r in enumerate(route) if r == replica]
    rows = interleaved_actions(ranks, chunks, len(mine), training)
    return tuple(tuple(Action(a.kind, mine[a.microbatch], a.chunk) for a in row) for row in rows)


def rank_order(
    schedule: str, ranks: int, chunks: int, route: tuple[int, ...], replica: int, training: bool = True
) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the order replica ``replica`` of a pipeline of ``chunks`` stages per rank runs: ``ZBV``'s
    V (one replica), else interleaved 1F1B's (``replica_interleaved_actions``; as ``chunk_stage``, every
    other schedule name lays stages out as interleaved 1F1B does)."""
    if schedule == ZBV:
        return _zbv_order(ranks, len(route), training)
    return replica_interleaved_actions(ranks, chunks, route, replica, training)


@functools.lru_cache(maxsize=256)
def _zbv_order(ranks: int, microbatches: int, training: bool) -> tuple[tuple[Action, ...], ...]:
    """``zbv_actions`` as tuples, cached: the planner replays many plans of the same shape."""
    return tuple(map(tuple, zbv_actions(ranks, microbatches, training)))


def zbv_actions(ranks: int, microbatches: int, training: bool = True) -> list[list[Action]]:
    """Per rank, its actions under ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6; torch's
    ``ScheduleZBVZeroBubble``): the model is cut into 2p stages laid out in a V, rank r holding stage r
    (chunk 0) and stage 2p - 1 - r (chunk 1), so a microbatch goes down the ranks and back up, and rank 0
    holds the first and the last stage. Every backward splits into B (input gradient) and W (weight
    gradient). Rank r warms up with 2(p - r) - 1 forwards of chunk 0, then r pairs of a chunk-1 and a
    chunk-0 forward, then p - r rounds of chunk 1's F, B and W; in the steady state it runs F, B, W of
    chunk 0 then of chunk 1; it drains with r pairs of B (chunk 0, then 1), p - r pairs of B and W of
    chunk 0, then the weight gradients left. The order is made for max(M, 2p - 1) microbatches and the
    actions of those beyond M dropped, which only removes waits. Without ``training``, each rank's chunk-0
    forwards, then its chunk-1 forwards."""
    check_schedule_args("1f1b", ranks, microbatches)
    if not training:
        return [[Action("F", m, c) for c in (0, 1) for m in range(microbatches)] for _ in range(ranks)]
    total = max(microbatches, 2 * ranks - 1)
    return [[a for a in _zbv_row(ranks, rank, total) if a.microbatch < microbatches] for rank in range(ranks)]


def _zbv_row(ranks: int, rank: int, total: int) -> list[Action]:
    """Rank ``rank``'s ZB-V order for ``total`` microbatches (``zbv_actions``)."""
    done = {(kind, chunk): 0 for kind in "FBW" for chunk in (0, 1)}
    order: list[Action] = []

    def run(*steps: tuple[str, int]) -> None:  # each (kind, chunk): its next microbatch
        for kind, chunk in steps:
            order.append(Action(kind, done[kind, chunk], chunk))
            done[kind, chunk] += 1

    run(*[("F", 0)] * (2 * (ranks - rank) - 1))
    for _ in range(rank):
        run(("F", 1), ("F", 0))
    for _ in range(ranks - rank):
        run(("F", 1), ("B", 1), ("W", 1))
    while done["F", 1] < done["F", 0] or done["F", 0] < total:
        run(*([("F", 0)] if done["F", 0] < total else []), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(rank):
        run(("B", 0), ("B", 1))
    for _ in range(ranks - rank):
        run(("B", 0), ("W", 0))
    run(*[("W", 1)] * (done["B", 1] - done["W", 1]), *[("W", 0)] * (done["B", 0] - done["W", 0]))
    return order


def chunk_stage(schedule: str, ranks: int, rank: int, chunk: int) -> int:
    """The stage rank ``rank`` of ``ranks`` runs as its chunk ``chunk``: under ZB-V's V stage r and
    2p - 1 - r; under interleaved 1F1B (and one stage per rank) stage chunk * p + rank."""
    if schedule == ZBV:
        return rank if chunk == 0 else 2 * ranks - 1 - rank
    return chunk * ranks + rank


def rank_stages(schedule: str, ranks: int, rank: int, chunks: int) -> tuple[int, ...]:
    """The stages rank ``rank`` of ``ranks`` runs, by chunk (``chunk_stage``): under ZB-V rank and
    2 * ranks - 1 - rank; under interleaved 1F1B (any other schedule name) rank, rank + ranks, ...."""
    return tuple(chunk_stage(schedule, ranks, rank, c) for c in range(chunks))


def interleavable(ranks: int, microbatches: int) -> bool:
    """Whether interleaved 1F1B takes ``microbatches`` over ``ranks``: at least one round of them, in
    rounds of equal size (``interleaved_actions``)."""
    return microbatches >= ranks >= 1 and microbatches % (microbatches // ranks) == 0


def max_inflight(actions: list[Action], release: str | None = None) -> int:
    """Most microbatches whose forward ran but whose backward has not yet (activations held): released by
    ``release``, else by ``W`` where the actions split their backwards, else by ``B``."""
    release = release or ("W" if any(a.kind == "W" for a in actions) else "B")
    held = peak = 0
    for action in actions:
        held += 1 if action.kind == "F" else -1 if action.kind == release else 0
        peak = max(peak, held)
    return peak
