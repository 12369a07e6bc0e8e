"""Interleaved 1F1B plans over a pipeline's devices: what the schedule's v chunks per device would give.

An interleaved plan (``schedules.interleaved_actions``) cuts the chain into v * p stages and runs stage
j on device j mod p, so each device holds v chunks and the pipeline's fill and drain shrink v times.
On unequal devices each device's chunks are sized to its speed: ``interleave`` cuts the chain so that
the longest chunk on its device is shortest, then moves single cuts while the simulator says the step
gets shorter and memory still fits. ``solve_interleaved`` plans it for ``hetcc.compile(...,
schedule="interleaved-1f1b")``: on the devices of the best 1F1B pure pipeline, each v from 2 to
``MAX_CHUNKS`` tried, the fastest simulated kept; the runtime runs it with rank r holding stages
r, r + p, ... (``runtime.placement.interleaved_ranks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from hetcc.errors import InfeasiblePlanError, PlanFormatError
from hetcc.solver.baselines import min_max_split, span_sums
from hetcc.solver.bound import lower_bound
from hetcc.solver.objective import stage_costs
from hetcc.solver.problem import PartitionProblem, PartitionSolution
from hetcc.solver.schedules import INTERLEAVED, interleavable
from hetcc.solver.simulate import simulate
from hetcc.solver.solve import solve

MOVES = 400  # simulations the cut refinement may spend
MAX_CHUNKS = 4  # stages per device ``solve_interleaved`` tries at most (Megatron-LM's runs use 2-4)


def solve_interleaved(
    problem: PartitionProblem,
    rerank: int = 0,
    pipeline: PartitionSolution | InfeasiblePlanError | None = None,
) -> tuple[PartitionProblem, PartitionSolution, str]:
    """(the problem it was planned on, the plan, a note) of interleaved 1F1B for ``problem``: the devices
    of its best 1F1B pure pipeline (``solve(..., rerank)`` without replicas, sharding or codecs: one stage
    per device, what an interleaved rank runs per chunk), cut into v chunks per device by ``interleave``
    (recomputing on a device whose chunks do not fit otherwise, where the problem allows it) for each v
    from 2 to ``MAX_CHUNKS`` the blocks allow, the fastest simulated kept.
    The solution's stage j runs on the device of rank j mod p; its bound leaves out the fill and the tied
    sums, which suppose one stage per device (``interleaved_bound``). ``pipeline``: that pipeline's
    answer, solved already (``pure_pipeline``'s problem, beside other solves), else solved here."""
    plain = pure_pipeline(problem)
    pipeline = solve(plain, rerank=rerank) if pipeline is None else pipeline
    if isinstance(pipeline, InfeasiblePlanError):
        raise pipeline
    devices, ranks = pipeline.devices, len(pipeline.stages)
    chunks = range(2, min(MAX_CHUNKS, len(problem.blocks) // max(ranks, 1)) + 1)
    if ranks < 2 or not chunks or not interleavable(ranks, problem.microbatches):
        raise InfeasiblePlanError(
            f"{INTERLEAVED}: the best 1F1B pipeline runs {ranks} stage(s) on {ranks} device(s) over "
            f"{len(problem.blocks)} blocks at M = {problem.microbatches}; interleaving needs 2 devices or more, "
            "2 blocks per device and at least one microbatch per device, in rounds of equal size",
            hint="use schedule='1f1b' (or 'auto'), more microbatches, or a cluster whose plan spans 2+ devices",
        )
    tried = {v: interleave(plain, devices, v) for v in chunks}
    v = min(tried, key=lambda c: (tried[c].step_s, c))
    cuts, step_s, recompute = tried[v]
    if math.isinf(step_s):
        raise InfeasiblePlanError(
            f"{INTERLEAVED}: no plan of {', '.join(map(str, chunks))} chunks per device on the {ranks} devices of "
            f"the best 1F1B pipeline fits in memory (each device holds every chunk's weights, and more "
            f"microbatches' activations than under 1F1B{'' if problem.recompute else '; recompute=False'})",
            hint="use schedule='1f1b' (or 'auto'), which may also replicate"
            + ("" if problem.recompute else ", or allow recomputation"),
        )
    stages = stage_costs(
        plain, cuts, [(devices[j % ranks],) for j in range(v * ranks)], list(recompute), chunks=v
    )
    bound = interleaved_bound(problem)
    per_device = [sum(s.compute_s for s in stages[r::ranks]) for r in range(ranks)]
    solution = PartitionSolution(stages, step_s, max(per_device), bound, step_s / bound - 1, exact=False,
                                 simulated_s=step_s, chunks=v)  # fmt: skip
    figures = ", ".join(f"v = {c}: {tried[c].step_s * 1e3:.2f} ms" for c in chunks)
    note = (
        f"schedule: {INTERLEAVED} with {v} chunks on each of the {ranks} devices of the best 1F1B pipeline "
        f"({pipeline.simulated_s * 1e3:.2f} ms under 1F1B; {figures})"
        + ("; no codecs: they are not planned with it" if problem.codecs is not None else "")
    )
    return plain, solution, note


def pure_pipeline(problem: PartitionProblem) -> PartitionProblem:
    """``problem`` under 1F1B without replicas, sharding, codecs or tensor parts: one stage per device,
    what an interleaved rank runs per chunk, and the problem interleaved plans are priced on."""
    return replace(problem, schedule="1f1b", replicate=False, shard=False, shard_all=False, codecs=None,
                   tensor_splits=None)  # fmt: skip


def interleaved_bound(problem: PartitionProblem) -> float:
    """A step no interleaved 1F1B plan of ``problem`` simulates below: its 1F1B bound without the fill and
    tied-sum terms, which suppose one contiguous stage per device (``lower_bound(..., contiguous=False)``)."""
    return lower_bound(replace(problem, schedule="1f1b"), contiguous=False)


class Interleaved(NamedTuple):
    """An interleaved 1F1B plan: the boundaries of its v * p stages, its simulated step (inf: no plan
    tried fits), and per stage whether it recomputes its forward in backward."""

    cuts: list[int]
    step_s: float
    recompute: tuple[bool, ...]


def interleave(problem: PartitionProblem, devices: Sequence[int], chunks: int) -> Interleaved:
    """The interleaved 1F1B plan over the p ``devices`` (in pipeline order) with ``chunks`` per device: the
    cuts that minimise the longest chunk's time on its device (``_balanced_cuts``), then single cuts moved
    by one or two blocks while the simulated step shortens and memory fits. Where the problem allows
    recomputation and a device's chunks do not fit, every chunk of that device recomputes
    (``_evaluated``; all of them under ``recompute_all``)."""
    ranks, n = len(devices), len(problem.blocks)
    if chunks < 1 or n < chunks * ranks or not interleavable(ranks, problem.microbatches):
        raise PlanFormatError(
            f"interleaving {chunks} chunks over {ranks} devices needs {chunks * ranks} of the {n} blocks and "
            f"at least {ranks} microbatches, in rounds of equal size (M = {problem.microbatches})",
            hint="fewer chunks or devices",
        )
    placed = [devices[j % ranks] for j in range(chunks * ranks)]
    cuts = _balanced_cuts(problem, placed)
    best_s, recompute = _evaluated(problem, cuts, placed, chunks)
    budget, improved = MOVES, True
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


def _balanced_cuts(problem: PartitionProblem, placed: Sequence[int]) -> list[int]:
    """Cuts of the chain into ``len(placed)`` stages, stage j on device ``placed[j]``, that minimise the
    longest stage's time on its device (``baselines.min_max_split``)."""
    costs = {d: span_sums(problem.block_cost_s(problem.devices[d].type)) for d in set(placed)}
    return min_max_split([costs[d] for d in placed])[1]


def _evaluated(
    problem: PartitionProblem, cuts: list[int], devices: list[int], chunks: int
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
