"""Pipeline schedules: completeness, order, memory bound, cross-stage feasibility, golden grids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetcc.errors import PlanFormatError
from hetcc.solver.grid import format_grid, unit_step_timeline
from hetcc.solver.schedules import (
    INTERLEAVED,
    ZBV,
    Action,
    chunk_stage,
    interleavable,
    interleaved_actions,
    max_inflight,
    stage_actions,
    zbv_actions,
)

shapes = st.tuples(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 9))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_every_microbatch_runs_forward_then_backward_once(shape):
    schedule, stages, microbatches = shape
    for actions in stage_actions(schedule, stages, microbatches):
        assert sorted(map(str, actions)) == sorted(f"{k}{m}" for k in "FB" for m in range(microbatches))
        position = {str(a): i for i, a in enumerate(actions)}
        assert all(position[f"F{m}"] < position[f"B{m}"] for m in range(microbatches))
        # Microbatches enter and leave each stage in order.
        assert [a.microbatch for a in actions if a.kind == "F"] == list(range(microbatches))
        assert [a.microbatch for a in actions if a.kind == "B"] == list(range(microbatches))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_inflight_bound_matches_the_memory_model(shape):
    schedule, stages, microbatches = shape
    for s, actions in enumerate(stage_actions(schedule, stages, microbatches)):
        bound = microbatches if schedule == "gpipe" else min(microbatches, stages - s)
        assert max_inflight(actions) == bound


@settings(max_examples=60, deadline=None)
@given(shapes, st.booleans())
def test_schedules_are_dependency_feasible_across_stages(shape, training):
    schedule, stages, microbatches = shape
    actions = stage_actions(schedule, stages, microbatches, training=training)
    timeline = unit_step_timeline(actions)  # raises on deadlock
    step_of = {(s, str(a)): t for s, row in enumerate(timeline) for t, a in enumerate(row) if a}
    for s in range(stages):
        for m in range(microbatches):
            if s > 0:
                assert step_of[(s, f"F{m}")] > step_of[(s - 1, f"F{m}")]
            if training and s < stages - 1:
                assert step_of[(s, f"B{m}")] > step_of[(s + 1, f"B{m}")]
    # Each stage keeps its own order.
    for s, row in enumerate(timeline):
        assert [a for a in row if a is not None] == actions[s]


def test_inference_runs_forwards_only():
    assert stage_actions("1f1b", 3, 2, training=False) == [[Action("F", 0), Action("F", 1)]] * 3


def test_1f1b_matches_torch_pipelining_order():
    # Schedule1F1B: min(M, K - s) warm-up forwards, then B/F pairs, then the remaining backwards.
    orders = [" ".join(map(str, a)) for a in stage_actions("1f1b", 3, 5)]
    assert orders == [
        "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4",
    ]


def test_homogeneous_unit_grid_has_the_textbook_length():
    for schedule in ("gpipe", "1f1b"):
        timeline = unit_step_timeline(stage_actions(schedule, 4, 6))
        assert len(timeline[0]) == 2 * (6 + 4 - 1)


GOLDEN_1F1B = """\
       | 0   1   2   3   4   5   6   7
---------------------------------------
rank 0 | F0  F1  .   B0  F2  B1  .   B2
rank 1 | .   F0  B0  F1  B1  F2  B2  ."""

GOLDEN_GPIPE_COMM = """\
       | 0           1           2           3           4           5
-------------------------------------------------------------------------------
rank 0 | F0 SEND_F0  F1 SEND_F1  .           .           RECV_B0 B0  RECV_B1 B1
rank 1 | .           RECV_F0 F0  RECV_F1 F1  B0 SEND_B0  B1 SEND_B1  ."""


def test_golden_grids():
    assert format_grid("1f1b", 2, 3, comm=False) == GOLDEN_1F1B
    assert format_grid("gpipe", 2, 2) == GOLDEN_GPIPE_COMM


def test_bad_arguments_name_the_culprit():
    with pytest.raises(PlanFormatError, match="(?s)unknown pipeline schedule 'zb'.*gpipe, 1f1b"):
        stage_actions("zb", 2, 2)
    with pytest.raises(PlanFormatError, match="microbatches must be a positive integer"):
        stage_actions("1f1b", 2, 0)
    with pytest.raises(PlanFormatError, match="num_stages"):
        format_grid("gpipe", 1.5, 2)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 3), (2, 5), (4, 8), (5, 3), (6, 16)])
def test_zb_h1_defers_each_stages_weight_gradients_and_holds_min_m_p(stages, microbatches):
    orders = stage_actions("zb-h1", stages, microbatches)
    one_f_one_b = stage_actions("1f1b", stages, microbatches)
    for s, actions in enumerate(orders):
        # 1F1B's forwards and input gradients, in 1F1B's order
        assert [a for a in actions if a.kind != "W"] == one_f_one_b[s]
        weights = [a.microbatch for a in actions if a.kind == "W"]
        if s == 0:  # the first stage's inputs take no gradient: its backward stays whole
            assert weights == [] and max_inflight(actions) == min(microbatches, stages)
            continue
        assert weights == list(range(microbatches))
        position = {str(a): i for i, a in enumerate(actions)}
        for m in range(microbatches):  # W(m) after B(m + s) (or the last B): s weight gradients deferred
            after = min(m + s, microbatches - 1)
            assert position[f"B{after}"] < position[f"W{m}"]
        assert max_inflight(actions) == min(microbatches, stages)  # held until W, on every stage
    if microbatches >= stages > 1:  # the closed form, in unit steps (B and W one step each)
        assert len(unit_step_timeline(orders)[0]) == 3 * microbatches + stages - 1


def test_zb_h1_grid_golden():
    # 3M + p - 1 = 14 unit steps; the last rank defers two weight gradients, the middle one one
    assert format_grid("zb-h1", 3, 4, comm=False) == "\n".join([
        "       | 0   1   2   3   4   5   6   7   8   9   10  11  12  13",
        "---------------------------------------------------------------",
        "rank 0 | F0  F1  F2  .   .   B0  F3  B1  .   .   B2  .   B3  .",
        "rank 1 | .   F0  F1  .   B0  F2  B1  W0  F3  B2  W1  B3  W2  W3",
        "rank 2 | .   .   F0  B0  F1  B1  F2  B2  W0  F3  B3  W1  W2  W3",
    ])  # fmt: skip


@pytest.mark.parametrize(("stages", "microbatches"), [(3, 4), (4, 8), (5, 3), (4, 2)])
def test_a_stage_deferring_fewer_weight_gradients_holds_fewer_microbatches(stages, microbatches):
    """zb-h1 with each stage's deferral d_s given: W(m) after B(m + d_s), so the stage holds 1F1B's
    min(M, p - s) microbatches plus d_s; d_s = 0 is 1F1B's order with each W right after its B. Every
    mix stays deadlock-free."""
    for cap in (0, 1, stages):
        deferred = [min(s, cap) for s in range(stages)]
        orders = stage_actions("zb-h1", stages, microbatches, deferred=deferred)
        assert len(unit_step_timeline(orders)[0]) >= 3 * microbatches  # completes: no deadlock
        for s, actions in enumerate(orders[1:], start=1):
            position = {str(a): i for i, a in enumerate(actions)}
            for m in range(microbatches):
                after = min(m + deferred[s], microbatches - 1)
                assert position[f"B{after}"] < position[f"W{m}"]
                if m + deferred[s] + 1 < microbatches:  # and before the next B
                    assert position[f"W{m}"] < position[f"B{m + deferred[s] + 1}"]
            assert max_inflight(actions) == min(microbatches, stages - s + deferred[s])
    assert stage_actions("zb-h1", stages, microbatches, deferred=list(range(stages))) == stage_actions(
        "zb-h1", stages, microbatches
    )  # ZB-H1's own deferral


def test_bad_deferrals_name_the_culprit():
    with pytest.raises(PlanFormatError, match=r"deferred \[0, -1\] must give a count >= 0"):
        stage_actions("zb-h1", 2, 4, deferred=[0, -1])
    with pytest.raises(PlanFormatError, match="for each of 3 stages"):
        stage_actions("zb-h1", 3, 4, deferred=[0, 1])


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["1f1b", "zb-h1", "zb-h2"]), st.integers(1, 6), st.integers(1, 12), st.data())
def test_every_non_increasing_warm_up_runs_and_holds_its_forwards(schedule, stages, microbatches, data):
    """Any warm-up from 1F1B's to M, none above the stage before's, is deadlock-free (the unit replay
    raises on a deadlock), keeps each stage's order, and holds at least that many microbatches."""
    least = [min(microbatches, stages - s) for s in range(stages)]
    warmup: list[int] = []
    for s in range(stages):
        warmup.append(data.draw(st.integers(least[s], warmup[-1] if warmup else microbatches)))
    actions = stage_actions(schedule, stages, microbatches, warmup=warmup)
    timeline = unit_step_timeline(actions)
    for s, row in enumerate(timeline):
        assert [a for a in row if a is not None] == actions[s]
        first_backward = next(i for i, a in enumerate(actions[s]) if a.kind == "B")
        assert [a.kind for a in actions[s][:first_backward]] == ["F"] * warmup[s]
        assert max_inflight(actions[s]) >= warmup[s]


def test_zb_h2_warms_up_with_twice_the_forwards_less_one():
    """Stage s of p warms up with 2(p - s) - 1 forwards (at most M): the first B reaches stage s after
    p - s forwards and p - s - 1 input gradients, a wait that ZB-H1 leaves idle; its W's as ZB-H1's."""
    actions = stage_actions("zb-h2", 4, 8)
    assert [next(i for i, a in enumerate(row) if a.kind == "B") for row in actions] == [7, 5, 3, 1]
    assert [max_inflight(row) for row in actions] == [7, 6, 5, 4]  # ZB-H1: 4 each
    assert [max_inflight(row) for row in stage_actions("zb-h2", 4, 3)] == [3, 3, 3, 3]  # capped at M
    same = stage_actions("zb-h1", 4, 8, warmup=[7, 5, 3, 1])
    assert same == actions  # zb-h2 is zb-h1's order with more warm-up


def test_a_bad_warm_up_names_the_rule():
    with pytest.raises(
        PlanFormatError, match=r"warm-up forwards \[4, 2, 3\] .* none above the stage before's"
    ):
        stage_actions("1f1b", 3, 6, warmup=[4, 2, 3])  # stage 2 would wait on a forward stage 1 holds back
    with pytest.raises(PlanFormatError, match=r"a count from \[3, 2, 1\] \(1F1B's\) to 6"):
        stage_actions("zb-h1", 3, 6, warmup=[3, 1, 1])
    with pytest.raises(PlanFormatError, match=r"to 6 \(M\)"):
        stage_actions("zb-h2", 3, 6, warmup=[7, 2, 1])
    with pytest.raises(PlanFormatError, match="for each of 3 stages"):
        stage_actions("1f1b", 3, 6, warmup=[3, 2])
    with pytest.raises(PlanFormatError, match=r"from \[4, 4\] \(1F1B's\)"):
        stage_actions("gpipe", 2, 4, warmup=[3, 3])  # GPipe runs every forward first
    assert stage_actions("gpipe", 2, 4, warmup=[4, 4]) == stage_actions("gpipe", 2, 4)


interleavings = st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(interleavings)
def test_interleaved_1f1b_runs_each_stage_in_order_and_hides_the_bubble_v_times(shape):
    """Interleaved 1F1B (p ranks of v chunks, M = k * p): every stage (rank r, chunk c: stage c * p + r)
    runs each microbatch's forward then backward once, in microbatch order, the order is deadlock-free,
    and at one unit step per chunk action it takes 2vM + 2(p - 1) steps (Narayanan et al.: the bubble is
    1F1B's 2(p - 1) stage steps over v), where 1F1B on the same chunks in v-times larger stages takes
    v(2M + 2(p - 1))."""
    ranks, chunks, rounds = shape
    microbatches = rounds * ranks
    orders = interleaved_actions(ranks, chunks, microbatches)
    for rank, order in enumerate(orders):
        for chunk in range(chunks):
            mine = [a for a in order if a.chunk == chunk]
            assert [a.microbatch for a in mine if a.kind == "F"] == list(range(microbatches)), (rank, chunk)
            assert [a.microbatch for a in mine if a.kind == "B"] == list(range(microbatches)), (rank, chunk)
            position = {(a.kind, a.microbatch): i for i, a in enumerate(mine)}
            assert all(position["F", m] < position["B", m] for m in range(microbatches))
    assert len(unit_step_timeline(orders)[0]) == 2 * chunks * microbatches + 2 * (ranks - 1)
    one_f_one_b = unit_step_timeline(stage_actions("1f1b", ranks, microbatches))  # a step: v chunk steps
    assert chunks * len(one_f_one_b[0]) == chunks * 2 * microbatches + chunks * 2 * (ranks - 1)


def test_interleaved_1f1b_matches_megatrons_order():
    # rank 0 of 2, 2 chunks: 2(p - 1) + (v - 1)p = 4 warm-up forwards, chunk 0 for microbatches 0-1 then
    # chunk 1 for the same; its backwards run the last chunk first; the last stage (rank 1, chunk 1) turns
    # each forward round into a backward at once
    orders = interleaved_actions(2, 2, 4)
    assert " ".join(map(str, orders[0])) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    )
    assert " ".join(map(str, orders[1][:6])) == "F0 F1 F0.1 B0.1 F1.1 B1.1"
    assert interleaved_actions(3, 1, 6) == stage_actions("1f1b", 3, 6)  # one chunk: 1F1B
    assert format_grid(INTERLEAVED, 2, 2, chunks=2, comm=False) == "\n".join([
        "       | 0   1   2     3     4     5     6     7     8   9",
        "-----------------------------------------------------------",
        "rank 0 | F0  F1  F0.1  F1.1  .     .     B0.1  B1.1  B0  B1",
        "rank 1 | .   F0  F1    F0.1  F1.1  B0.1  B1.1  B0    B1  .",
    ])  # fmt: skip
    for bad in ((2, 2, 1), (4, 2, 9), (2, 0, 4), (0, 2, 4)):  # M < p; 9 in 2 rounds; no chunks; no ranks
        with pytest.raises(PlanFormatError):
            interleaved_actions(*bad)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 4), st.integers(0, 12))
def test_interleaved_1f1b_takes_microbatches_in_rounds_as_torch_does(ranks, chunks, extra):
    """M not a multiple of p (torch's ``ScheduleInterleaved1F1B`` rounds: M // p rounds of M / (M // p)
    microbatches, where they divide M): every stage still runs each microbatch's forward then backward
    once, in order, without deadlock, and the step is never longer than 1F1B's on the same chunks in
    v-times larger stages, v(2M + 2(p - 1)) unit steps."""
    microbatches = ranks + extra
    if not interleavable(ranks, microbatches):
        with pytest.raises(PlanFormatError, match="rounds of equal size"):
            interleaved_actions(ranks, chunks, microbatches)
        return
    orders = interleaved_actions(ranks, chunks, microbatches)
    for order in orders:
        for chunk in range(chunks):
            mine = [a for a in order if a.chunk == chunk]
            for kind in "FB":
                assert [a.microbatch for a in mine if a.kind == kind] == list(range(microbatches))
    steps = len(unit_step_timeline(orders)[0])
    assert steps <= chunks * (2 * microbatches + 2 * (ranks - 1))
    if microbatches % ranks == 0:
        assert steps == 2 * chunks * microbatches + 2 * (ranks - 1)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_zbv_runs_each_stage_of_its_v_in_order_and_leaves_p_minus_1_idle_steps(ranks):
    """ZB-V (torch's ``ScheduleZBVZeroBubble``'s order): rank r holds stages r and 2p - 1 - r; every stage
    runs each microbatch's F, B and W once, in microbatch order; at F = B = W = 1 the step is the 6M of
    each rank's work and p - 1 more once M >= 2p - 1 (1F1B on the same two-chunk stages idles 6(p - 1)),
    4(p - 1) - 2(M - 1) more below that. Its ranks do not post and take each rank pair's messages in one
    order, which is why the runtime does not run it (messages pair up by their order there)."""
    for microbatches in range(1, 4 * ranks):
        orders = zbv_actions(ranks, microbatches)
        for rank, order in enumerate(orders):
            for chunk in (0, 1):
                for kind in "FBW":
                    done = [a.microbatch for a in order if a.chunk == chunk and a.kind == kind]
                    assert done == list(range(microbatches)), (rank, chunk, kind)
                seen = [a.kind for a in order if a.chunk == chunk and a.microbatch == microbatches - 1]
                assert seen == ["F", "B", "W"]
        assert [chunk_stage(ZBV, ranks, r, c) for r in range(ranks) for c in (0, 1)] == [
            s for r in range(ranks) for s in (r, 2 * ranks - 1 - r)
        ]
        steps = len(unit_step_timeline(orders, ZBV)[0])  # raises on deadlock
        assert steps == 6 * microbatches + max(ranks - 1, 4 * (ranks - 1) - 2 * (microbatches - 1))
    assert zbv_actions(ranks, 3, training=False)[0] == [Action("F", m, c) for c in (0, 1) for m in range(3)]
    grid = format_grid(ZBV, ranks, 2 * ranks, comm=False).splitlines()
    assert len(grid) == 2 + ranks and "F0.1" in grid[2]
    posted, taken = {}, {}  # per directed rank pair: (kind, microbatch, sending stage) in order
    place = lambda stage: min(stage, 2 * ranks - 1 - stage)  # noqa: E731 - the rank of a stage of the V
    for rank, order in enumerate(zbv_actions(ranks, 2 * ranks)):
        for action in (a for a in order if a.kind != "W"):
            stage = chunk_stage(ZBV, ranks, rank, action.chunk)
            ahead = stage + 1 if action.kind == "F" else stage - 1  # where it sends; it takes from behind
            behind = 2 * stage - ahead
            if 0 <= behind < 2 * ranks:
                taken.setdefault((place(behind), rank), []).append((action.kind, action.microbatch, behind))
            if 0 <= ahead < 2 * ranks:
                posted.setdefault((rank, place(ahead)), []).append((action.kind, action.microbatch, stage))
    assert posted.keys() == taken.keys() and all(sorted(posted[k]) == sorted(taken[k]) for k in posted)
    assert posted != taken  # the same messages, but some rank pair takes them in another order
