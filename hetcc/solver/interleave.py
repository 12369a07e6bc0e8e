"""Interleaved 1F1B plans over a pipeline's devices: what the schedule's v chunks per device would give.

An interleaved plan (``schedules.interleaved_actions``) cuts the chain into v * p stages and runs stage
j on device j mod p, so each device holds v chunks and the pipeline's fill and drain shrink v times.
On unequal devices each device's chunks are sized to its speed: ``interleave`` cuts the chain so that
the longest chunk on its device is shortest, then moves single cuts while the simulator says the step
gets shorter and memory still fits. ``solve_interleaved`` plans it for ``hetcc.compile(...,
schedule="interleaved-1f1b")``: on the devices of the best 1F1B pure pipeline of at most N / 2 stages
(two blocks per device at least), and where the problem replicates, on the positions of the best such
pure pipeline of groups of R identical devices (the pipeline replicated whole, each replica running
M / R microbatches: Megatron-LM's data x pipeline parallelism), each v from 2 to ``MAX_CHUNKS`` tried,
the fastest simulated kept; the runtime runs it with position r holding stages r, r + p, ... on each
of its replicas (``runtime.placement.interleaved_ranks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from hetcc.errors import InfeasiblePlanError, PlanFormatError
from hetcc.solver.baselines import min_max_split, span_sums
from hetcc.solver.bound import lower_bound
from hetcc.solver.objective import Device, stage_costs
from hetcc.solver.problem import PartitionProblem, PartitionSolution
from hetcc.solver.schedules import INTERLEAVED, ZBV, interleavable, rank_stages
from hetcc.solver.simulate import simulate
from hetcc.solver.solve import solve

MOVES = 400  # simulations the cut refinement may spend
# A plan whose starting cuts simulate this much above the fastest plan found already is not refined:
# moving cuts gained at most 1.7% over the start on the saved GPT-2 and OPT problems.
REFINE_MARGIN = 0.1
MAX_CHUNKS = 4  # stages per device ``solve_interleaved`` tries at most (Megatron-LM's runs use 2-4)


def solve_interleaved(
    problem: PartitionProblem,
    rerank: int = 0,
    pipelines: Sequence[PartitionSolution | InfeasiblePlanError] | None = None,
    beat_s: float = math.inf,
) -> tuple[PartitionProblem, PartitionSolution, str]:
    """(the problem it was planned on, the plan, a note) of interleaved 1F1B for ``problem``: for each
    pipeline of ``interleaving_pipelines`` (every device alone, and where the problem replicates, groups of
    n identical devices, the pipeline replicated whole), the positions of its best 1F1B pure pipeline of
    at most N / 2 stages (``solve(..., rerank)``), cut into v chunks per position by ``interleave``
    (recomputing on a position whose chunks do not fit otherwise, where the problem allows it) for each
    v from 2 to ``MAX_CHUNKS`` the blocks allow, the fastest simulated kept. The solution's stage j runs
    on the group of position j mod p; its bound leaves out the fill and the tied sums, which suppose one
    stage per device (``interleaved_bound``). ``pipelines``: those pipelines' answers, solved already (beside other
    solves), else solved here. A plan is refined only where its start simulates within ``REFINE_MARGIN``
    of the fastest found so far, or of ``beat_s`` (a plan of another schedule)."""
    candidates = interleaving_pipelines(problem)
    if pipelines is None:
        pipelines = [_solved(pure, rerank) for pure, _ in candidates]
    plain = pure_pipeline(problem)
    tried: dict[tuple[int, int], tuple[Interleaved, list[tuple[int, ...]], float]] = {}  # (R, v) -> ...
    for (_, groups), pipeline in zip(candidates, pipelines):
        if isinstance(pipeline, InfeasiblePlanError):
            continue
        positions = [groups[d] for d in pipeline.devices]
        ranks, replicas = len(positions), len(positions[0])
        if ranks < 2 or not interleavable(ranks, problem.microbatches // replicas):
            continue
        for v in range(2, min(MAX_CHUNKS, len(problem.blocks) // ranks) + 1):
            fastest_s = min([beat_s, *(found.step_s for found, _, _ in tried.values())])
            found = interleave(plain, positions, v, fastest_s)
            tried[(replicas, v)] = (found, positions, pipeline.simulated_s)
    if not tried:
        raise InfeasiblePlanError(
            f"{INTERLEAVED}: no 1F1B pipeline of {problem.microbatches} microbatches over {len(problem.blocks)} "
            "blocks on this cluster interleaves: it needs 2 devices (or replica groups) or more, 2 blocks per "
            "device and at least one microbatch per device and replica, in rounds of equal size",
            hint="use schedule='1f1b' (or 'auto'), more microbatches, or a cluster whose plan spans 2+ devices",
        )
    key = min(tried, key=lambda k: (tried[k][0].step_s, k))
    found, positions, pipeline_s = tried[key]
    replicas, v = key
    if math.isinf(found.step_s):
        raise InfeasiblePlanError(
            f"{INTERLEAVED}: no plan of {', '.join(map(str, sorted({c for _, c in tried})))} chunks per device "
            "on the devices of the best 1F1B pipelines fits in memory (each device holds every chunk's weights, "
            f"and more microbatches' activations than under 1F1B{'' if problem.recompute else '; recompute=False'})",
            hint="use schedule='1f1b' (or 'auto'), which may also replicate"
            + ("" if problem.recompute else ", or allow recomputation"),
        )
    ranks = len(positions)
    solved = replace(plain, replicate=replicas > 1)
    solution = _solution(solved, positions, v, found, interleaved_bound(problem))
    figures = ", ".join(
        f"{f'R = {r}, ' if len({k[0] for k in tried}) > 1 else ''}v = {c}: {tried[r, c][0].step_s * 1e3:.2f} ms"
        for r, c in sorted(tried)
    )
    on = f"{ranks} devices" if replicas == 1 else f"{ranks} groups of {replicas} replicas"
    # a replicated pipeline's 1F1B figure is one replica's M / R microbatches, without the all-reduce
    whose = (
        ""
        if replicas == 1
        else f"one replica's {problem.microbatches // replicas} microbatches, no all-reduce: "
    )
    note = (
        f"schedule: {INTERLEAVED} with {v} chunks on each of the {on} of the best 1F1B pipeline "
        f"({whose}{pipeline_s * 1e3:.2f} ms under 1F1B; {figures})"
        + ("; no codecs: they are not planned with it" if problem.codecs is not None else "")
    )
    return solved, solution, note


REPLICA_COUNTS = (2, 4, 8)  # replicas of a pipeline replicated whole ``interleaving_pipelines`` tries


def interleaving_pipelines(problem: PartitionProblem) -> list[tuple[PartitionProblem, list[tuple[int, ...]]]]:
    """The pipelines ``solve_interleaved`` interleaves, each as (the pure 1F1B problem whose best pipeline
    gives its positions; per device of that problem, the replica group it stands for): every device alone
    (``pure_pipeline``), and where the problem replicates, for each count n of ``REPLICA_COUNTS`` that
    divides M, groups of n devices of one type and memory (``_replica_groups``), each group one position
    that its n replicas run over M / n microbatches each (its first device standing for it). Each is
    solved for at most N / 2 stages: a position runs two chunks at least."""
    plain = _laid(problem)
    found = [(plain, [(i,) for i in range(len(problem.devices))])]
    for replicas in REPLICA_COUNTS if problem.replicate else ():
        groups = _replica_groups(problem, replicas)
        if problem.microbatches % replicas or len(groups) < 2:
            continue
        heads = [group[0] for group in groups]
        found.append((
            replace(
                plain, devices=[problem.devices[h] for h in heads], microbatches=problem.microbatches // replicas,
                bandwidth_bps=[[problem.bandwidth_bps[a][b] for b in heads] for a in heads],
                latency_s=[[problem.latency_s[a][b] for b in heads] for a in heads],
            ),
            groups,
        ))  # fmt: skip
    return found


def _replica_groups(problem: PartitionProblem, replicas: int) -> list[tuple[int, ...]]:
    """Groups of ``replicas`` devices of one type and memory, a node's own first, then across nodes from
    what each node leaves; devices left over go unused."""
    classes: dict[tuple[str, float], list[int]] = {}
    for i, device in enumerate(problem.devices):  # in index order: a node's devices together
        classes.setdefault((device.type, device.memory_bytes), []).append(i)
    groups = []
    for members in classes.values():
        left = []
        for node in dict.fromkeys(problem.devices[i].node for i in members):
            on_node = [i for i in members if problem.devices[i].node == node]
            whole = len(on_node) - len(on_node) % replicas
            groups += [tuple(on_node[k : k + replicas]) for k in range(0, whole, replicas)]
            left += on_node[whole:]
        groups += [
            tuple(left[k : k + replicas]) for k in range(0, len(left) - len(left) % replicas, replicas)
        ]
    return sorted(groups)


def _laid(problem: PartitionProblem) -> PartitionProblem:
    """The pure pipeline of single devices interleaving and ZB-V are laid on: at most N / 2 stages."""
    return replace(pure_pipeline(problem), max_stages=len(problem.blocks) // 2)


def _solved(problem: PartitionProblem, rerank: int) -> PartitionSolution | InfeasiblePlanError:
    try:
        return solve(problem, rerank=rerank)
    except InfeasiblePlanError as error:
        return error


def pure_pipeline(problem: PartitionProblem) -> PartitionProblem:
    """``problem`` under 1F1B without replicas, sharding, codecs or tensor parts: one stage per device,
    what an interleaved rank runs per chunk, and the problem interleaved plans are priced on."""
    return replace(problem, schedule="1f1b", replicate=False, shard=False, shard_all=False, codecs=None,
                   tensor_splits=None)  # fmt: skip


def interleaved_bound(problem: PartitionProblem) -> float:
    """A step no interleaved 1F1B plan of ``problem`` simulates below: its 1F1B bound without the fill and
    tied-sum terms, which suppose one contiguous stage per device (``lower_bound(..., contiguous=False)``)."""
    return lower_bound(replace(problem, schedule="1f1b"), contiguous=False)


def zbv_bound(problem: PartitionProblem) -> float:
    """A step no ZB-V plan of ``problem`` simulates below: ZB-H1's bound (only input gradients on the
    chain), without the fill and tied-sum terms, as ``interleaved_bound``."""
    return lower_bound(replace(problem, schedule="zb-h1"), contiguous=False)


def solve_zbv(
    problem: PartitionProblem,
    rerank: int = 0,
    pipeline: PartitionSolution | InfeasiblePlanError | None = None,
    beat_s: float = math.inf,
) -> tuple[PartitionProblem, PartitionSolution, str]:
    """(the problem it was planned on, the plan, a note) of ZB-V for ``problem``: the devices of its best
    1F1B pure pipeline of at most N / 2 stages (``pipeline``: that answer, solved already; else solved
    here), stage j and 2p - 1 - j on device j, cut to each device's speed and refined by simulation
    (``interleave``; not refined where its start simulates above ``beat_s`` by more than
    ``REFINE_MARGIN``); one replica per stage, every backward but the first stage's and recomputing
    ones' split."""
    pure = pure_pipeline(problem)
    pipeline = _solved(_laid(problem), rerank) if pipeline is None else pipeline
    if isinstance(pipeline, InfeasiblePlanError):
        raise InfeasiblePlanError(
            f"{ZBV}: a V is laid on a 1F1B pipeline of at most {len(problem.blocks) // 2} stages (two stages of "
            f"a block or more on each device), and {pipeline.message}",
            hint="use schedule='zb-h1', 'zb-h2' or 'auto' (any number of stages)"
            + (f", or {pipeline.hint.removeprefix('try ')}" if pipeline.hint else ""),
        ) from None
    devices, ranks = pipeline.devices, len(pipeline.stages)
    if ranks < 2 or len(problem.blocks) < 2 * ranks:
        raise InfeasiblePlanError(
            f"{ZBV}: the best 1F1B pipeline runs {ranks} stage(s) over {len(problem.blocks)} blocks; a V needs 2 "
            "devices or more and 2 blocks per device",
            hint="use schedule='zb-h1', 'zb-h2' or 'auto', or a cluster whose plan spans 2+ devices",
        )
    plain = replace(pure, schedule=ZBV)
    found = interleave(plain, devices, 2, beat_s)
    if math.isinf(found.step_s):
        raise InfeasiblePlanError(
            f"{ZBV}: no V over the {ranks} devices of the best 1F1B pipeline fits in memory (each device holds two "
            f"stages' weights, and their activations until each W){'' if problem.recompute else '; recompute=False'}",
            hint="use schedule='zb-h1' or 'auto'" + ("" if problem.recompute else ", or allow recomputation"),
        )
    solution = _solution(plain, devices, 2, found, zbv_bound(problem))
    note = (
        f"schedule: {ZBV} on the {ranks} devices of the best 1F1B pipeline ({pipeline.simulated_s * 1e3:.2f} ms "
        "under 1F1B)" + ("; no codecs: they are not planned with it" if problem.codecs is not None else "")
    )
    return plain, solution, note


def _solution(
    problem: PartitionProblem, devices: Sequence[Device], chunks: int, found: Interleaved, bound: float
) -> PartitionSolution:
    """The solution of ``found`` (``interleave``'s plan over ``devices`` with ``chunks`` each): its stages
    costed, its period the busiest device's compute, its gap to ``bound``."""
    placed = placed_stages(problem.schedule, devices, chunks)
    stages = stage_costs(problem, found.cuts, placed, list(found.recompute), chunks=chunks)
    per_device = [sum(s.compute_s for s, d in zip(stages, placed) if d == device) for device in devices]
    return PartitionSolution(stages, found.step_s, max(per_device), bound, found.step_s / bound - 1,
                             exact=False, simulated_s=found.step_s, chunks=chunks)  # fmt: skip


def placed_stages(schedule: str, devices: Sequence[Device], chunks: int) -> list[Device]:
    """Per stage of a plan of ``chunks`` stages on each of ``devices`` (in pipeline order), its device:
    under ZB-V the V, else interleaved 1F1B's stage j on device j mod p (``schedules.rank_stages``)."""
    placed: list[Device] = [devices[0]] * (chunks * len(devices))
    for rank, device in enumerate(devices):
        for stage in rank_stages(schedule, len(devices), rank, chunks):
            placed[stage] = device
    return placed


class Interleaved(NamedTuple):
    """An interleaved 1F1B plan: the boundaries of its v * p stages, its simulated step (inf: no plan
    tried fits), and per stage whether it recomputes its forward in backward."""

    cuts: list[int]
    step_s: float
    recompute: tuple[bool, ...]


def interleave(
    problem: PartitionProblem, devices: Sequence[Device], chunks: int, fastest_s: float = math.inf
) -> Interleaved:
    """The interleaved 1F1B plan over the p ``devices`` (in pipeline order; each a device, or a group of R
    identical ones: the pipeline replicated whole), or under ``problem.schedule`` ``ZBV`` the V of two
    stages per device, with ``chunks`` per device: the cuts that minimise the
    longest chunk's time on its device (``_balanced_cuts``; where they do not fit, those that balance
    each device's bytes against its memory, and where these do not fit either, none is looked for: the
    step is inf), then, where that start simulates within ``REFINE_MARGIN`` of ``fastest_s`` (the fastest
    plan found already), single cuts moved by one or two blocks while the simulated step shortens and memory fits. Where the problem allows recomputation
    and a device's chunks do not fit, every chunk of that device recomputes (``_evaluated``; all of them
    under ``recompute_all``)."""
    ranks, n = len(devices), len(problem.blocks)
    replicas = len(devices[0]) if isinstance(devices[0], (tuple, list)) else 1
    layout = ZBV if problem.schedule == ZBV else INTERLEAVED
    if (
        chunks < 1
        or n < chunks * ranks
        or not (
            chunks == 2 and replicas == 1
            if layout == ZBV
            else interleavable(ranks, problem.microbatches // replicas)
        )
    ):
        raise PlanFormatError(
            f"interleaving {chunks} chunks over {ranks} devices ({layout}) needs {chunks * ranks} of the {n} "
            f"blocks, and at least {ranks} microbatches per replica, in rounds of equal size (M = "
            f"{problem.microbatches}, {replicas} replica(s)); a ZB-V 2 chunks, one replica",
            hint="fewer chunks or devices",
        )
    placed = placed_stages(problem.schedule, devices, chunks)
    cuts = _balanced_cuts(problem, placed)
    best_s, recompute = _evaluated(problem, cuts, placed, chunks)
    if math.isinf(best_s):  # the cuts that balance time do not fit: start from those that balance bytes
        cuts = _balanced_cuts(problem, placed, chunks)
        best_s, recompute = _evaluated(problem, cuts, placed, chunks)
        if math.isinf(best_s):
            return Interleaved(cuts, best_s, recompute)
    budget, improved = MOVES, best_s < fastest_s * (1 + REFINE_MARGIN)
    while improved and budget > 0:
        improved = False
        for index in range(1, len(cuts) - 1):
            for delta in (-2, -1, 1, 2):
                moved = cuts[index] + delta
                if not cuts[index - 1] < moved < cuts[index + 1] or budget <= 0:
                    continue
                budget -= 1
                trial = [*cuts[:index], moved, *cuts[index + 1 :]]
                step_s, flags = _evaluated(problem, trial, placed, chunks)
                if step_s < best_s * (1 - 1e-12):
                    cuts, best_s, recompute, improved = trial, step_s, flags, True
    return Interleaved(cuts, best_s, recompute)


def _balanced_cuts(problem: PartitionProblem, placed: Sequence[Device], chunks: int = 0) -> list[int]:
    """Cuts of the chain into ``len(placed)`` stages, stage j on device (or group of identical devices)
    ``placed[j]``, that minimise the longest stage's time there (``baselines.min_max_split``), or with
    ``chunks``, the largest share of its device's memory a stage's weights and one microbatch's
    activations take, each of a device's ``chunks`` stages given an equal share."""
    first = {d: d[0] if isinstance(d, (tuple, list)) else d for d in placed}
    costs = {}
    for d in set(placed):
        device = problem.devices[first[d]]
        if chunks:
            held = np.add(problem.state_for(device.type), problem.act_for(device.type))
            memory = max(device.memory_bytes, 1.0)  # a device of no memory: as if of one byte
            costs[d] = span_sums(held * chunks / memory)
        else:
            costs[d] = span_sums(problem.block_cost_s(device.type))
    return min_max_split([costs[d] for d in placed])[1]


def _evaluated(
    problem: PartitionProblem, cuts: list[int], devices: list[Device], chunks: int
) -> tuple[float, tuple[bool, ...]]:
    """(the simulated step, per stage whether it recomputes) of the plan: no stage recomputes, or where
    the problem allows it and a device's chunks do not fit, each of its chunks (every stage under
    ``recompute_all``); the step is inf where memory still does not hold it."""
    recompute = (problem.training and problem.recompute_all,) * len(devices)
    stages = stage_costs(problem, cuts, devices, list(recompute), chunks=chunks)
    if not all(stage.fits for stage in stages) and problem.training and problem.recompute:
        short = {devices[j] for j, stage in enumerate(stages) if not stage.fits}
        recompute = tuple(r or d in short for r, d in zip(recompute, devices))
        stages = stage_costs(problem, cuts, devices, list(recompute), chunks=chunks)
    if not all(stage.fits for stage in stages):
        return math.inf, recompute
    simulated = simulate(problem, cuts, devices, list(recompute), stages=stages, events=False, chunks=chunks)
    return simulated.step_time_s, recompute
