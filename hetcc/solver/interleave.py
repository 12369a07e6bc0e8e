"""Interleaved 1F1B plans over a pipeline's devices: what the schedule's v chunks per device would give.

An interleaved plan (``schedules.interleaved_actions``) cuts the chain into v * p stages and runs stage
j on device j mod p, so each device holds v chunks and the pipeline's fill and drain shrink v times.
On unequal devices each device's chunks are sized to its speed: ``interleave`` cuts the chain so that
the longest chunk on its device is shortest, then moves single cuts while the simulator says the step
gets shorter and memory still fits. The planner does not choose it yet and the runtime does
not run it (a rank runs one stage there): this prices the option (``benchmarks/plan_space.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetcc.errors import PlanFormatError
from hetcc.solver.baselines import min_max_split, span_sums
from hetcc.solver.objective import stage_costs
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.schedules import interleavable
from hetcc.solver.simulate import simulate

MOVES = 400  # simulations the cut refinement may spend


def interleave(problem: PartitionProblem, devices: Sequence[int], chunks: int) -> tuple[list[int], float]:
    """(the boundaries of the v * p stages, the simulated step) of an interleaved 1F1B plan over the p
    ``devices`` (in pipeline order) with ``chunks`` per device: the cuts that minimise the longest chunk's
    time on its device (``_balanced_cuts``), then single cuts moved by one or two blocks while the
    simulated step shortens and memory fits; the step is inf where no plan tried fits."""
    ranks, n = len(devices), len(problem.blocks)
    if chunks < 1 or n < chunks * ranks or not interleavable(ranks, problem.microbatches):
        raise PlanFormatError(
            f"interleaving {chunks} chunks over {ranks} devices needs {chunks * ranks} of the {n} blocks and "
            f"at least {ranks} microbatches, in rounds of equal size (M = {problem.microbatches})",
            hint="fewer chunks or devices",
        )
    placed = [devices[j % ranks] for j in range(chunks * ranks)]
    cuts = _balanced_cuts(problem, placed)
    best_s = _step_s(problem, cuts, placed, chunks)
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
                step_s = _step_s(problem, trial, placed, chunks)
                if step_s < best_s * (1 - 1e-12):
                    cuts, best_s, improved = trial, step_s, True
    return cuts, best_s


def _balanced_cuts(problem: PartitionProblem, placed: Sequence[int]) -> list[int]:
    """Cuts of the chain into ``len(placed)`` stages, stage j on device ``placed[j]``, that minimise the
    longest stage's time on its device (``baselines.min_max_split``)."""
    costs = {d: span_sums(problem.block_cost_s(problem.devices[d].type)) for d in set(placed)}
    return min_max_split([costs[d] for d in placed])[1]


def _step_s(problem: PartitionProblem, cuts: list[int], devices: list[int], chunks: int) -> float:
    stages = stage_costs(problem, cuts, devices, chunks=chunks)
    if not all(stage.fits for stage in stages):
        return math.inf
    return simulate(problem, cuts, devices, stages=stages, events=False, chunks=chunks).step_time_s
