"""The planner's step-time model: what one plan costs.

    T = sum_j (T_j + C_j) + A_0 + (M - 1) * P,
    P = max(max_j max(B_j, L_j), max_{j throttled} R_j / W_j)

Stage j runs on a replica group (one device, or several holding the same blocks). T_j is the
forward+backward seconds (plus one more forward when the stage recomputes its activations) of its
blocks per microbatch on one replica, the slowest where replicas differ. Microbatches are routed to
replicas by speed (``problem.route_microbatches``); B_j = max_d (shares_d - 1) * T_j(d) / (M - 1) is
the stage's part of the steady state (a replica's first microbatch is in the fill already, so r
replicas of a stage add (ceil(M / r) - 1) * T_j, not (M - 1) * T_j / r). C_j moves the cut
activations to the next stage and, when training, their gradients back: ``2 * (latency + x /
bandwidth)`` per microbatch (one way for inference; 0 for the last stage), with the codecs
``solver.codecs`` chooses for the cut (their encode and decode are on the link's path, not the
stage's); L_j = the busiest replica-to-replica link's part of it, in the same way. A_j is the ring
all-reduce of a replicated stage's gradients at step end, plus the all-gather of its parameters when
it shards its optimizer state (ZeRO-1, ``solver.sharding``): stage 0 finishes last, so only A_0 is
counted; a later stage's all-reduce overlaps the backwards still running before it (the simulator
times every one).
R_j = sum_{i >= j} (T_i + C_i) (+ A_0 for j = 0) is the round trip a
1F1B stage holding W_j < M microbatches must wait for (W_j = min(M, replicas of stages j..K-1)).

Memory of one replica: ``sum w + held * sum a`` (``held`` = the microbatches its share of the
schedule holds at once), or with recomputation ``sum w + held * x_in + sum a``: the stage keeps only
its inputs per microbatch and rebuilds one microbatch's activations at a time. A sharding replica
holds ``sum o * (1 - 1/r)`` less of ``sum w`` (its share of the optimizer state ``o``). ``w``, ``a``
and ``o`` are those of the replica's device type (``problem.state_for`` and the like).

``evaluate`` scores any plan (the search's winner, the baselines); ``step_time`` is its T. The
simulator (``solver.simulate``) replays the same plan event by event and is the judge of a plan's step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from hetcc.solver.bound import lower_bound
from hetcc.solver.codecs import cut_rows, names, pair_s
from hetcc.solver.links import device_ring_s, end_tied_s
from hetcc.solver.memory import Memory, group_footprint, group_memory, held_counts, most_fitting
from hetcc.solver.plan_checks import check_plan
from hetcc.solver.problem import (
    PartitionProblem,
    PartitionSolution,
    StageCost,
    round_trip_slots,
    route_microbatches,
    steady_share,
    within_memory,
)
from hetcc.solver.schedules import (
    least_warmups,
    max_inflight,
    rank_order,
    rank_stages,
    splits_backward,
    stage_warmups,
    zb_deferrals,
)
from hetcc.solver.sharding import allgather_s, group_param_bytes

Device = int | Sequence[int]  # a device index, or a replica group of them
Codecs = Sequence[tuple[str, str] | None] | None  # per stage: pinned (activation, gradient) codec names


def evaluate(
    problem: PartitionProblem,
    boundaries: Sequence[int],
    devices: Sequence[Device],
    recompute: Sequence[bool] | None = None,
    bound_s: float | None = None,
    codecs: Codecs = None,
    shard: Sequence[bool] | None = None,
    warmup: Sequence[int] | None = None,
) -> PartitionSolution:
    """Score one plan: stage k runs blocks ``[boundaries[k], boundaries[k+1])`` on ``devices[k]`` (one
    device index, or a tuple of them: a replica group), recomputing its activations if ``recompute[k]``
    and sharding its replicas' optimizer state if ``shard[k]`` (``shard`` None: chosen,
    ``sharding.chosen_shard``). Its outgoing cut uses the codecs ``solver.codecs`` chooses, or the names
    ``codecs[k]`` pins (``("none", "none")``: uncoded; a None entry or ``codecs`` None: chosen).
    ``warmup[k]`` pins the forwards stage k runs before its first backward (None: the schedule's, fewer
    where memory is short; ``stage_costs``).

    Memory that does not fit makes ``step_time_s`` infinite rather than raising, so baselines that
    overflow a device can still be reported. ``period_s`` is the plan's P (see ``step_time``).
    ``lower_bound_s`` bounds the simulated step of every plan (``solver.bound.lower_bound``; pass
    ``bound_s`` when it is already known: it depends on the problem alone).
    """
    stages = stage_costs(problem, boundaries, devices, recompute, codecs, shard, warmup)
    step, period = _objective_s(problem, stages)
    bound = lower_bound(problem) if bound_s is None else bound_s
    return PartitionSolution(stages, step, period, bound, _gap(step, bound))


def stage_costs(
    problem,
    boundaries,
    devices,
    recompute=None,
    codecs: Codecs = None,
    shard: Sequence[bool] | None = None,
    warmup: Sequence[int] | None = None,
    chunks: int = 1,
    memo: dict | None = None,
) -> tuple[StageCost, ...]:
    """Every stage's costs, memory, replica shares and outgoing codecs (validates the plan; ``codecs``
    and ``shard`` as in ``evaluate``). ``warmup`` pins each stage's forwards before its first backward
    (``schedules.stage_actions``); None: the schedule's, less where memory is short (``most_fitting``).
    ``chunks`` > 1: an interleaved 1F1B plan, or under ``ZBV`` a V of two stages per device
    (``_interleaved``). ``memo``: a dict kept across calls on the same problem (the refinement's, whose
    moves change one or two stages of a plan): a stage's footprint, memory and costs are worked out
    once per distinct set of what they depend on."""
    groups = [tuple(d) if isinstance(d, (tuple, list)) else (d,) for d in devices]
    recompute = [False] * len(groups) if recompute is None else [bool(r) for r in recompute]
    codecs = [None] * len(groups) if codecs is None else list(codecs)
    shard = [None] * len(groups) if shard is None else [bool(f) for f in shard]
    check_plan(problem, boundaries, groups, recompute, codecs, shard, chunks)
    replicas = [len(g) for g in groups]
    k = len(groups)
    seconds = [
        [sum(replica_seconds(problem, boundaries[j], boundaries[j + 1], d, recompute[j])) for d in g]
        for j, g in enumerate(groups)
    ]
    routes = [route_microbatches(problem.microbatches, tuple(s)) for s in seconds]
    split = splits_backward(problem.schedule, recompute) if problem.training else [False] * k
    spans = [(boundaries[j], boundaries[j + 1], g) for j, g in enumerate(groups)]  # what a footprint keys on
    footprints = [_memoized(memo, span, group_footprint, problem, *span) for span in spans]
    if chunks > 1:
        return _interleaved(
            problem, boundaries, groups, routes, seconds, footprints, recompute, codecs, chunks, split
        )
    # A split schedule defers weight gradients: each stage as many as ZB-H1 does where its memory holds
    # them, fewer where it does not; ZB-H2 then warms up with more forwards, as many as memory still holds.
    least = least_warmups(problem.schedule, replicas, problem.microbatches)
    wanted = stage_warmups(problem.schedule, replicas, problem.microbatches, warmup)

    def held(j: int, deferred: int, forwards: int) -> tuple[int, ...]:
        if not problem.training:
            return (1,) * len(groups[j])
        return held_counts(problem.microbatches, forwards, deferred if split[j] else None, tuple(routes[j]),
                     len(groups[j]))  # fmt: skip

    def memory(j: int, deferred: int, forwards: int) -> Memory:
        held_j = held(j, deferred, forwards)
        key = ("memory", spans[j], held_j, recompute[j], shard[j])
        return _memoized(memo, key, group_memory, problem, footprints[j], held_j, recompute[j], shard[j])

    def fits(j: int, deferred: int, forwards: int) -> bool:
        return memory(j, deferred, forwards).fits

    most = zb_deferrals(replicas)
    deferrals = [0] * k
    warmups = list(wanted)
    for j in range(k):
        # the schedule's warm-up (capped by the stage before's) gets the memory ZB-H1's W's leave; a
        # pinned one defers what fits beside it
        forwards = least[j] if warmup is None else warmups[j]
        deferrals[j] = most_fitting(lambda d, j=j, w=forwards: fits(j, d, w), 0, most[j] if split[j] else 0)
        if warmup is None:
            cap = min(wanted[j], warmups[j - 1]) if j else wanted[j]
            warmups[j] = most_fitting(lambda w, j=j: fits(j, deferrals[j], w), least[j], cap)

    def stage(j: int) -> StageCost:
        after = (groups[j + 1], routes[j + 1]) if j + 1 < k else None  # the outgoing cut's receivers
        used = memory(j, deferrals[j], warmups[j])
        key = ("stage", spans[j], routes[j], after, used.held, recompute[j], shard[j], codecs[j], deferrals[j],
               warmups[j])  # fmt: skip
        return _memoized(memo, key, _stage_plan, problem, boundaries, groups, routes, seconds[j], used,
                         recompute[j], j, codecs[j], deferrals[j], warmups[j])  # fmt: skip

    return tuple(stage(j) for j in range(k))


def _memoized(memo: dict | None, key, compute, *args):
    """``compute(*args)``, worked out once per ``key`` in ``memo`` (None: every time)."""
    if memo is None:
        return compute(*args)
    if key not in memo:
        memo[key] = compute(*args)
    return memo[key]


def _interleaved(
    problem, boundaries, groups, routes, seconds, footprints, recompute, codecs, chunks: int, split
):  # fmt: skip
    """The stages of a plan of several stages per device, each costed as its own, with its devices'
    memory: the state of every chunk a device holds and the most activation bytes its order holds at once
    (a recomputing chunk holds its input per microbatch, and rebuilds one microbatch's activations at a
    time; a split stage's until its W). Interleaved 1F1B (``schedules.interleaved_actions``): K / chunks
    ranks, stage j on the group of rank j mod K / chunks, each replica of that pipeline running the order
    over its own microbatches (``replica_interleaved_actions``); ZB-V (``problem.schedule``,
    ``zbv_actions``): rank r holds stages r and K - 1 - r, one device each."""
    ranks, schedule = len(groups) // chunks, problem.schedule  # ZB-V's V, else interleaved 1F1B's layout
    memories = [None] * len(groups)
    for rank in range(ranks):
        mine = rank_stages(schedule, ranks, rank, chunks)
        orders = [
            rank_order(schedule, ranks, chunks, tuple(routes[rank]), replica, problem.training)[rank]
            for replica in range(len(groups[rank]))
        ]
        release = ["W" if split[j] else "B" for j in mine]  # when a microbatch's activations go
        held = [
            tuple(max_inflight([a for a in order if a.chunk == c], release[c]) if problem.training else 1
                  for order in orders)
            for c in range(chunks)
        ]  # fmt: skip
        parts = [
            group_memory(problem, footprints[j], held[c], recompute[j], False) for c, j in enumerate(mine)
        ]
        used = [
            _interleaved_peak(problem, footprints, mine, recompute, order, r, release)
            for r, order in enumerate(orders)
        ]
        caps = footprints[rank].caps
        worst = max(range(len(caps)), key=lambda r: used[r] - caps[r])
        for c, j in enumerate(mine):
            memories[j] = parts[c]._replace(
                used=used, fits=within_memory(used[worst], caps[worst]), worst=worst
            )
    return tuple(
        _stage_plan(
            problem, boundaries, groups, routes, seconds[j], memories[j], recompute[j], j, codecs[j], 0, 0
        )
        for j in range(len(groups))
    )


def _interleaved_peak(problem, footprints, mine, recompute, order, replica: int, release) -> float:
    """The most bytes replica ``replica`` of a rank holds running ``order`` over its stages ``mine`` (by
    chunk): their state, the activations each forward holds until its chunk's ``release`` action, and one
    microbatch's rebuilt by a recomputing chunk."""
    per_microbatch = [footprints[j].kept if recompute[j] else footprints[j].act[replica] for j in mine]
    live, peak = 0.0, 0.0 if problem.training else max(per_microbatch)  # inference: one at a time
    for action in order if problem.training else ():
        if action.kind == "F":
            live += per_microbatch[action.chunk]
        elif action.kind == release[action.chunk]:
            live -= per_microbatch[action.chunk]
        peak = max(peak, live)
    rebuilt = max((footprints[j].act[replica] for j in mine if recompute[j]), default=0.0)
    return sum(footprints[j].state[replica] for j in mine) + peak + rebuilt


def replica_seconds(problem: PartitionProblem, start: int, stop: int, device: int, recompute: bool):
    """(forward, backward) seconds of one microbatch of blocks ``[start, stop)`` on ``device``; a
    recomputing stage's backward includes the forward it recomputes (no backward for inference)."""
    kind = problem.devices[device].type
    fwd = math.fsum(problem.fwd_s[kind][start:stop])
    if not problem.training:
        return fwd, 0.0
    return fwd, math.fsum(problem.bwd_s[kind][start:stop]) + (fwd if recompute else 0.0)


def weight_grad_s(problem: PartitionProblem, start: int, stop: int, device: int) -> float:
    """Seconds of one microbatch's backward of blocks ``[start, stop)`` on ``device`` that compute
    weight gradients (``problem.wgrad_s``; 0 where the problem does not say)."""
    if problem.wgrad_s is None or not problem.training:
        return 0.0
    return math.fsum(problem.wgrad_s[problem.devices[device].type][start:stop])


def _objective_s(problem: PartitionProblem, stages: tuple[StageCost, ...]) -> tuple[float, float]:
    """(T, P) of a plan; T is infinite when a stage does not fit."""
    k = len(stages)
    tied_s = end_tied_s(problem, stages[0].group, stages[-1].group) if k > 1 else 0.0
    replicas = [len(s.group) for s in stages]
    slots = [round_trip_slots(problem, j, k, replicas) or math.inf for j in range(k)]
    fill_drain, period = step_terms(
        [s.compute_s for s in stages], [s.comm_s for s in stages], slots,
        busy_s=[s.busy_s for s in stages], link_busy_s=[s.link_busy_s for s in stages],
        extra_s=[stages[0].allreduce_s + stages[0].allgather_s + tied_s] + [0.0] * (k - 1),
    )  # fmt: skip
    if not all(s.fits for s in stages):
        return math.inf, period
    return fill_drain + (problem.microbatches - 1) * period, period


def step_terms(
    compute_s: Sequence[float],
    comm_s: Sequence[float],
    slots: Sequence[float],
    *,
    busy_s: Sequence[float] | None = None,
    link_busy_s: Sequence[float] | None = None,
    extra_s: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(S, P) of stages with latency T_j = ``compute_s[j]``, transfer C_j = ``comm_s[j]`` (0 for the
    last), step-end all-reduce A_j = ``extra_s[j]`` and round-trip slots W_j = ``slots[j]`` (inf where
    no round trip limits the stage): S = sum_j (T_j + C_j + A_j) and
    P = max_j max(busy_j, link_busy_j, R_j / W_j), R_j accumulated from the last stage backwards.
    ``busy_s`` / ``link_busy_s`` default to T_j and C_j (single-device stages). The one place the
    formula lives: the DP scores its plans with it too."""
    busy = compute_s if busy_s is None else busy_s
    link = comm_s if link_busy_s is None else link_busy_s
    period, round_trip = 0.0, 0.0
    for j in range(len(compute_s) - 1, -1, -1):
        round_trip += compute_s[j] + comm_s[j] + (extra_s[j] if extra_s is not None else 0.0)
        period = max(period, busy[j], link[j], round_trip / slots[j])
    return round_trip, period


def _gap(step_s: float, bound_s: float) -> float:
    return step_s / bound_s - 1 if bound_s > 0 else (0.0 if step_s == 0 else math.inf)


def _stage_plan(
    problem,
    boundaries,
    groups,
    routes,
    seconds,
    memory: Memory,
    recompute: bool,
    j: int,
    pinned,
    deferred: int,
    warmup: int,
) -> StageCost:
    start, stop = boundaries[j], boundaries[j + 1]
    group, route, m = groups[j], routes[j], problem.microbatches
    shares = tuple(route.count(r) for r in range(len(group)))
    slowest = max((r for r in range(len(group)) if shares[r]), key=lambda r: seconds[r])
    kind = problem.devices[group[slowest]].type
    fwd = math.fsum(problem.fwd_s[kind][start:stop])
    bwd = math.fsum(problem.bwd_s[kind][start:stop]) if problem.training else 0.0
    comm, link_busy, codecs = 0.0, 0.0, ("none", "none")
    if j + 1 < len(groups):
        after = groups[j + 1]
        if len(group) == 1 and len(after) == 1:  # every microbatch over one pair (most stages)
            pairs = Counter({(group[0], after[0]): m})
        else:
            pairs = Counter((group[a], after[b]) for a, b in zip(route, routes[j + 1]))
        rows = cut_rows(problem, stop - 1, list(pairs), pinned)
        times = {pair: pair_s(problem, stop - 1, pair, rows) for pair in pairs}
        comm, codecs = max(times.values()), names(rows)
        link_busy = max(steady_share(count, m) * times[pair] for pair, count in pairs.items())
    worst = memory.worst
    return StageCost(
        blocks=(start, stop),
        device=group[0],
        device_name=problem.devices[group[0]].name,
        fwd_s=fwd,
        bwd_s=bwd,
        compute_s=seconds[slowest],
        comm_s=comm,
        state_bytes=memory.state[worst],
        act_bytes=memory.act[worst],
        inflight=memory.held[worst],
        memory_bytes=memory.used[worst],
        memory_capacity_bytes=problem.devices[group[worst]].memory_bytes,
        devices=group,
        device_names=tuple(problem.devices[d].name for d in group),
        shares=shares,
        route=tuple(route),
        recompute=recompute,
        busy_s=max(steady_share(c, m) * t for c, t in zip(shares, seconds) if c),
        link_busy_s=link_busy,
        allreduce_s=_allreduce_s(problem, group, start, stop),
        codecs=codecs,
        shard=memory.shard,
        allgather_s=allgather_s(problem, group, start, stop) if memory.shard else 0.0,
        sharded_bytes=memory.saved[worst] if memory.shard else 0.0,
        deferred=deferred,
        warmup=warmup if problem.training else 0,
    )


def _allreduce_s(problem: PartitionProblem, group: tuple[int, ...], start: int, stop: int) -> float:
    """The replicas' gradient sum at step end (0 for one device or inference)."""
    if not problem.training:
        return 0.0
    return device_ring_s(problem, group, group_param_bytes(problem, group, start, stop))


def step_time(
    problem: PartitionProblem,
    boundaries: Sequence[int],
    devices: Sequence[Device],
    recompute: Sequence[bool] | None = None,
    shard: Sequence[bool] | None = None,
) -> float:
    """The objective T = S + (M - 1) * P of one plan; ``inf`` when a stage does not fit its memory.

    S = sum_j (T_j + C_j) is the time one microbatch needs to cross the pipeline forward and back
    (the fill and drain); every further microbatch adds one steady-state period P. P is the largest
    of three rates, each a lower bound on the spacing of consecutive microbatches:

    - a stage computes one microbatch at a time: P >= T_j;
    - a link carries one transfer at a time in either direction: P >= C_j;
    - round trips (1F1B, training, where q_j = min(M, K - j) < M): stage j starts the forward of
      microbatch m + q_j only after the backward of m, so at most q_j microbatches are between their
      forward's start and their backward's end at stage j. Each spends at least
      R_j = sum_{i >= j} T_i + sum_{j <= i < K-1} C_i there (its forward and backward through every
      later stage and over every later link, one after the other), so by Little's law stage j
      completes at most q_j microbatches per R_j: P >= R_j / q_j.

    GPipe gets no round-trip term: it starts all M forwards without waiting for a backward. Neither
    does a 1F1B stage whose warm-up covers all M microbatches (K - j >= M); S already contains R_j.
    The term matters over slow links, where R_0 / K exceeds every T_j and C_j: four 5.75 ms stages
    over 25 Gb/s Ethernet (C = 1.75, 0.19, 1.75 ms), M = 8, simulate to 75.7 ms; the first two
    terms alone predict 66.9 ms, all three 73.4 ms.
    """
    return _objective_s(problem, stage_costs(problem, boundaries, devices, recompute, shard=shard))[0]
