"""How interleaved 1F1B and ZB-V plans are searched (``solver.interleave``): on pipelines of at most N / 2
stages (``PartitionProblem.max_stages``, kept by the search and its refinement), from cuts that fit where
the time-balanced ones do not, and refined only where they start near the fastest plan found."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
from test_simulate import _on_devices, homogeneous

from hetcc.errors import PlanFormatError
from hetcc.solver import interleave as interleave_module
from hetcc.solver.interleave import interleave, interleaving_pipelines, solve_interleaved, solve_zbv
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.solve import solve


def _equal(blocks: int, devices: int, microbatches: int) -> PartitionProblem:
    """``blocks`` equal blocks over ``devices`` equal devices, links free: the more stages the faster."""
    return _on_devices(homogeneous(blocks, microbatches, "1f1b"), devices)


def test_a_capped_problem_plans_no_more_stages_than_its_cap():
    problem = dataclasses.replace(_equal(8, 8, 8), recompute=True)
    assert len(solve(problem, rerank=2).stages) == 8  # uncapped, a block per device
    capped = solve(dataclasses.replace(problem, max_stages=2), rerank=2)  # refined too: no stage added
    assert len(capped.stages) <= 2
    for bad in (-1, True, 1.5):
        with pytest.raises(PlanFormatError, match="max_stages"):
            dataclasses.replace(problem, max_stages=bad).validate()


def test_interleaving_is_laid_on_a_pipeline_shallow_enough_to_interleave():
    """Four one-block stages on four devices are the best pure pipeline, and no device of it could hold
    two chunks; the pipelines interleaving is laid on are capped at N / 2 = 2 stages, so it plans two
    chunks on each of two devices, and ZB-V its V."""
    problem = _equal(4, 4, 4)
    assert all(pure.max_stages == 2 for pure, _ in interleaving_pipelines(problem))
    solved, plan, _ = solve_interleaved(problem, rerank=1)
    assert plan.chunks == 2 and len(plan.stages) == 4 and len({s.device for s in plan.stages}) == 2
    assert solved.max_stages == 0  # the plan itself is priced uncapped: it runs 4 stages
    devices = [s.device for s in solve_zbv(problem, rerank=1)[1].stages]
    assert devices == [devices[0], devices[1], devices[1], devices[0]] and devices[0] != devices[1]


def _evaluations(problem: PartitionProblem, **kwargs):
    """(``interleave(problem, [0, 1], 2, **kwargs)``, how many plans it costed)."""
    with mock.patch.object(interleave_module, "_evaluated", wraps=interleave_module._evaluated) as costed:
        found = interleave(problem, [0, 1], 2, **kwargs)
    return found, costed.call_count


def test_interleave_starts_from_cuts_that_fit_and_gives_up_where_none_do():
    """Device 1 is twice as fast but holds 5 of the 12 one-byte blocks: the cuts that balance time give it
    8, so the search starts from the cuts that balance bytes; where the two hold 11 bytes in all, no cuts
    fit and it stops after those two."""
    twelve = _equal(12, 2, 4)
    fast = dataclasses.replace(
        twelve,
        devices=[
            dataclasses.replace(twelve.devices[0], memory_bytes=100.0),
            dataclasses.replace(twelve.devices[1], type="fast", memory_bytes=5.0),
        ],
        fwd_s={**twelve.fwd_s, "fast": [0.5] * 12},
        bwd_s={**twelve.bwd_s, "fast": [1.0] * 12},
        state_bytes=[1.0] * 12,
    )
    found, _ = _evaluations(fast)
    held = sum(b - a for a, b in zip(found.cuts[1::2], found.cuts[2::2]))  # device 1's chunks
    assert math.isfinite(found.step_s) and held <= 5
    short = dataclasses.replace(fast, devices=[dataclasses.replace(fast.devices[0], memory_bytes=6.0),
                                               fast.devices[1]])  # fmt: skip
    found, costed = _evaluations(short)
    assert found.step_s == math.inf and costed == 2


def test_a_start_far_above_the_fastest_plan_is_not_refined():
    """Unequal blocks: moving cuts shortens the step from 144 to 135 units; with a faster plan in hand
    (``fastest_s``, more than ``REFINE_MARGIN`` under the start) the start is returned as it is, after
    one costing."""
    costs = [1.0, 3.0, 2.0, 3.0, 3.0, 3.0, 1.0, 2.0]
    problem = dataclasses.replace(_equal(8, 2, 4), fwd_s={"t": costs}, bwd_s={"t": [2 * c for c in costs]})
    refined, _ = _evaluations(problem)
    start, costed = _evaluations(problem, fastest_s=130.0)  # 10% above it: 143 units, below the start
    assert (refined.cuts, refined.step_s) == ([0, 3, 4, 5, 8], 135.0)
    assert (start.cuts, start.step_s, costed) == ([0, 2, 4, 5, 8], 144.0, 1)
    with mock.patch.object(interleave_module, "MAX_CHUNKS", 2):
        assert solve_interleaved(problem, beat_s=100.0)[1].simulated_s == 144.0  # far above: the start
        assert solve_interleaved(problem, beat_s=140.0)[1].simulated_s == 135.0  # within 10%: refined
