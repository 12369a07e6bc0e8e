"""A codec per cut in the plan space: data and checks, the choice, the DP against brute force, the
simulator by hand, the bound, and the bytes a plan puts on the wire (numbers only, no torch)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan_space import solves_like_brute_force

from hetcc.errors import PlanFormatError
from hetcc.solver.bound import lower_bound
from hetcc.solver.codecs import wire_bytes_per_step
from hetcc.solver.dp import Chain, solve_sequence
from hetcc.solver.objective import evaluate, stage_costs, step_time
from hetcc.solver.problem import PartitionProblem, PartitionSolution, ProblemDevice, WireCodec
from hetcc.solver.simulate import simulate
from hetcc.solver.solve import solve


def row(name, cut_bytes, coded_bytes, *, gradient=False, calls=None, encode=0.0, decode=0.0, call=0.0,
        types=("t0", "t1"), **extra) -> WireCodec:  # fmt: skip
    """A codec row with per-type costs given as one number or a dict."""
    per_type = lambda v: dict(v) if isinstance(v, dict) else dict.fromkeys(types, v)  # noqa: E731
    return WireCodec(
        name, gradient, list(cut_bytes), list(coded_bytes),
        [1 if c else 0 for c in coded_bytes] if calls is None else list(calls),
        per_type(encode), per_type(decode), per_type(call), **extra,
    )  # fmt: skip


def chain_problem(n, devices, bandwidth, *, fwd=1.0, cut=1e8, microbatches=4, **extra) -> PartitionProblem:
    """``n`` equal blocks on ``devices`` (name, type, node), one bandwidth on every link."""
    types = sorted({t for _, t, _ in devices})
    return PartitionProblem(
        blocks=[f"b{i}" for i in range(n)],
        fwd_s={t: [fwd] * n for t in types},
        bwd_s={t: [2 * fwd] * n for t in types},
        state_bytes=[0.0] * n,
        act_bytes=[0.0] * n,
        cut_bytes=[cut] * (n - 1),
        devices=[ProblemDevice(name, t, 1e12, node) for name, t, node in devices],
        bandwidth_bps=[[math.inf if a == b else bandwidth for b in devices] for a in devices],
        latency_s=[[0.0 if a == b else 1e-3 for b in devices] for a in devices],
        microbatches=microbatches,
        **extra,
    )


def int8_rows(n, cut=1e8, *, encode=1e-10, **extra) -> list[WireCodec]:
    """A 4x codec and the uncoded wire, both directions."""
    return [
        row(name, [cut / ratio] * (n - 1), [cut if ratio > 1 else 0.0] * (n - 1), gradient=gradient,
            encode=encode, decode=encode, call=1e-4, **extra)
        for name, ratio in (("none", 1), ("int8", 4)) for gradient in (False, True)
    ]  # fmt: skip


TWO = [("a", "t0", "n0"), ("b", "t1", "n1")]


def test_json_round_trip_keeps_the_codec_rows():
    problem = chain_problem(
        3, TWO, 1e8, cut_tensors=[[0, [1], 10.0, 10.0], [0, [2], 4.0, 0.0], [1, [2], 20.0, 0.0]]
    )
    problem.codecs = [
        row("int8", [3.0, 5.0], [14.0, 24.0], tensor_bytes=[2.5, 1.0, 5.0], tensor_coded=[True, True, True],
            links="inter-node", cuts=[True, False], encode={"t0": 1e-9, "t1": 2e-9}),
        row("bf16", [7.0, 12.0], [10.0, 0.0], gradient=True, tensor_bytes=[5.0, 0.0, 0.0],
            tensor_coded=[True, False, False]),
    ]  # fmt: skip
    problem.validate()
    back = PartitionProblem.from_json(problem.to_json())
    assert back == problem
    assert all(isinstance(c, WireCodec) for c in back.codecs)


def _bad(**change):
    problem = chain_problem(3, TWO, 1e8)
    problem.codecs = [dataclasses.replace(int8_rows(3)[2], **change)]
    return problem


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        (_bad(cut_bytes=[1.0, 2.0, 3.0]), r"codecs\[0\].cut_bytes.*3 entries, expected 2"),
        (_bad(calls=[1]), r"codecs\[0\].calls.*1 entries, expected 2"),
        (_bad(calls=[1.5, 1]), r"codecs\[0\].calls.*integers"),
        (_bad(encode_s_per_byte={"t0": 0.0, "t1": 0.0, "h100": 1.0}), r"encode_s_per_byte.*unknown device type 'h100'"),
        (_bad(call_s={"t0": 0.0}), r"call_s.*no entry for device type 't1'"),
        (_bad(decode_s_per_byte={"t0": -1.0, "t1": 0.0}), r"decode_s_per_byte.*entry 't0'"),
        (_bad(links="rack"), r"codecs\[0\].links.*unknown value 'rack'"),
        (_bad(cuts=[True]), r"codecs\[0\].cuts.*2 booleans"),
        (_bad(tensor_bytes=[1.0], tensor_coded=[True]), r"tensor_bytes.*without cut_tensors"),
    ],
)  # fmt: skip
def test_codec_rows_are_validated_field_by_field(problem, message):
    with pytest.raises(PlanFormatError, match=message):
        problem.validate()
    with pytest.raises(PlanFormatError, match=message):
        PartitionProblem.from_json(problem.to_json())


def test_codec_names_are_unique_per_direction_and_tensor_rows_follow_cut_tensors():
    problem = chain_problem(3, TWO, 1e8)
    problem.codecs = [*int8_rows(3), int8_rows(3)[0]]
    with pytest.raises(PlanFormatError, match="activation codec 'none' is listed twice"):
        problem.validate()
    problem = chain_problem(3, TWO, 1e8, cut_tensors=[[0, [1], 10.0, 10.0]])
    problem.codecs = int8_rows(3)
    with pytest.raises(PlanFormatError, match="needed with cut_tensors"):
        problem.validate()
    with pytest.raises(PlanFormatError, match="not a partition problem"):
        PartitionProblem.from_json(problem.to_json().replace('"links"', '"link"'))


def test_a_slow_link_takes_the_codec_and_the_step_gets_shorter():
    n = 4
    plain = chain_problem(n, TWO, 1e8, fwd=1.0, microbatches=8)  # 1 s per uncoded message, 3 s per stage
    coded = dataclasses.replace(plain, codecs=int8_rows(n))
    fast, slow = solve(coded, rerank=2), solve(plain, rerank=2)
    assert [s.codecs for s in fast.stages] == [("int8", "int8"), ("none", "none")]
    # Warming the first stage up with every microbatch hides much of the slow link, so the best plans
    # differ by less than the codec saves on one plan: the same plan uncoded is over a second slower.
    assert fast.simulated_s < slow.simulated_s
    uncoded = simulate(plain, fast.boundaries, fast.groups, fast.recompute, warmup=fast.warmup, events=False)
    assert fast.simulated_s < uncoded.step_time_s - 1.0
    assert fast.step_time_s < slow.step_time_s - 1.0
    assert fast.stages[0].comm_s == pytest.approx(2 * (1e-3 + 0.25 + 2e-4 + 1e8 * 2e-10))


def test_a_fast_link_keeps_the_wire_uncoded_when_coding_costs_more_than_it_saves():
    n = 4
    problem = chain_problem(n, TWO, 1e11, codecs=int8_rows(n, encode=1e-9))  # 1 ms raw vs 200 ms coding
    plan = solve(problem)
    assert len(plan.stages) == 2
    assert plan.stages[0].codecs == ("none", "none")
    assert plan.step_time_s == solve(dataclasses.replace(problem, codecs=None)).step_time_s


def test_an_inter_node_codec_goes_only_on_inter_node_cuts():
    devices = [("a", "t0", "n0"), ("b", "t0", "n0"), ("c", "t1", "n1")]
    problem = chain_problem(
        3, devices, 1e8, codecs=[r for r in int8_rows(3, links="inter-node") if r.name != "none"]
    )
    plan = evaluate(problem, [0, 1, 2, 3], [0, 1, 2])
    assert [s.codecs for s in plan.stages] == [("none", "none"), ("int8", "int8"), ("none", "none")]
    intra = 2 * (1e-3 + 1.0)
    assert plan.stages[0].comm_s == pytest.approx(intra)
    assert plan.stages[1].comm_s < intra / 3
    reversed_plan = evaluate(problem, [0, 1, 2, 3], [2, 0, 1])  # now the first cut leaves the node
    assert [s.codecs[0] for s in reversed_plan.stages] == ["int8", "none", "none"]


def test_a_codec_limited_to_some_cuts_is_used_only_there():
    devices = [("a", "t0", "n0"), ("b", "t1", "n1"), ("c", "t1", "n2")]
    problem = chain_problem(3, devices, 1e8, codecs=int8_rows(3, cuts=[False, True]))
    plan = evaluate(problem, [0, 1, 2, 3], [0, 1, 2])
    assert [s.codecs for s in plan.stages] == [("none", "none"), ("int8", "int8"), ("none", "none")]
    pinned = evaluate(problem, [0, 1, 2, 3], [0, 1, 2], codecs=[("int8", "none"), None, None])
    assert [s.codecs for s in pinned.stages] == [("int8", "none"), ("int8", "int8"), ("none", "none")]
    assert pinned.stages[0].comm_s < plan.stages[0].comm_s
    with pytest.raises(PlanFormatError, match="no activation codec named 'zstd'"):
        evaluate(problem, [0, 1, 2, 3], [0, 1, 2], codecs=[("zstd", "none"), None, None])
    with pytest.raises(PlanFormatError, match="one entry per stage"):
        evaluate(problem, [0, 1, 2, 3], [0, 1, 2], codecs=[("none", "none")])


@st.composite
def codec_problems(draw, min_blocks=4, max_blocks=7, max_devices=3, replicate=False) -> PartitionProblem:
    """Random chains on 2-3 devices of 1-2 types over 1-2 nodes, with random codec rows per direction
    (some pinned to a kind of link or to some cuts); "none" rows now and then."""
    n = draw(st.integers(min_blocks, max_blocks))
    types = ["t0", "t1"][: draw(st.integers(1, 2))]
    devices = [
        ProblemDevice(f"d{k}", draw(st.sampled_from(types)), draw(st.sampled_from([1e12, 30.0, 60.0])),
                      draw(st.sampled_from(["n0", "n1"])))
        for k in range(draw(st.integers(2, max_devices)))
    ]  # fmt: skip
    fwd = {t: draw(st.lists(st.floats(0.1, 2.0), min_size=n, max_size=n)) for t in types}
    cut = draw(st.lists(st.floats(0.0, 8.0), min_size=n - 1, max_size=n - 1))
    grads = [c * draw(st.sampled_from([0.0, 1.0])) for c in cut]
    same, other = draw(st.floats(4.0, 40.0)), draw(st.floats(0.5, 4.0))
    problem = PartitionProblem(
        blocks=[f"b{i}" for i in range(n)],
        fwd_s=fwd,
        bwd_s={t: [2 * f for f in fwd[t]] for t in types},
        state_bytes=draw(st.lists(st.floats(0.5, 6.0), min_size=n, max_size=n)),
        act_bytes=draw(st.lists(st.floats(0.2, 3.0), min_size=n, max_size=n)),
        cut_bytes=cut,
        cut_grad_bytes=grads,
        devices=devices,
        bandwidth_bps=[
            [math.inf if a is b else (same if a.node == b.node else other) for b in devices] for a in devices
        ],  # fmt: skip
        latency_s=[[0.0 if a is b else 0.01 for b in devices] for a in devices],
        microbatches=draw(st.integers(1, 6)),
        schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
        training=draw(st.booleans()),
        replicate=replicate,
        recompute=draw(st.booleans()),
    )
    problem.codecs = draw(codec_rows(problem))
    problem.validate()
    return problem


@st.composite
def codec_rows(draw, problem: PartitionProblem) -> list[WireCodec]:
    n, types = len(problem.blocks), sorted(problem.fwd_s)
    rows = []
    for gradient in (False, True):
        raw = [problem.cut_grad_at(i) if gradient else problem.cut_bytes[i] for i in range(n - 1)]
        names = draw(st.lists(st.sampled_from(["none", "bf16", "int8", "fp8"]), max_size=3, unique=True))
        for name in names:
            ratio = 1.0 if name == "none" else draw(st.floats(1.0, 6.0))
            seconds = st.dictionaries(st.sampled_from(types), st.floats(0.0, 0.05), min_size=len(types))
            rows.append(WireCodec(
                name, gradient, [r / ratio for r in raw], [0.0 if name == "none" else r for r in raw],
                [0 if name == "none" else draw(st.integers(1, 2)) for _ in raw],
                draw(seconds), draw(seconds), draw(seconds),
                links=draw(st.sampled_from(["all", "all", "intra-node", "inter-node"])),
                cuts=draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))),
            ))  # fmt: skip
    return rows


def _brute_force(problem: PartitionProblem, order) -> float:
    """Least objective over every cut and recompute choice of single-device stages on ``order``."""
    n, k = len(problem.blocks), len(order)
    flags = itertools.product([False, True], repeat=k) if problem.recompute else [[False] * k]
    return min(
        (step_time(problem, [0, *cuts, n], list(order), list(f))
         for f in flags for cuts in itertools.combinations(range(1, n), k - 1)),
        default=math.inf,
    )  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec_problems(), st.data())
def test_the_dp_with_codecs_matches_brute_force_on_one_device_order(problem, data):
    length = data.draw(st.integers(1, min(len(problem.blocks), len(problem.devices))))
    order = data.draw(st.permutations(range(len(problem.devices))))[:length]
    best = _brute_force(problem, order)
    chain = Chain(problem)
    found = solve_sequence(chain, list(order))
    if best == math.inf:
        assert found is None
        return
    assert found.step_s == pytest.approx(best, rel=1e-9, abs=1e-12)
    boundaries, recompute = chain.backtrack(chain.stages(list(order)), found.term_bound_s, found.trip_bound_s)
    assert step_time(problem, boundaries, list(order), recompute) == pytest.approx(best, rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec_problems(max_blocks=6))
def test_solve_with_codecs_matches_brute_force_over_every_order(problem):
    orders = [o for k in range(1, min(len(problem.blocks), len(problem.devices)) + 1)
              for o in itertools.permutations(range(len(problem.devices)), k)]  # fmt: skip
    plan = solves_like_brute_force(problem, min(_brute_force(problem, order) for order in orders))
    if plan is None:
        return
    assert plan.lower_bound_s <= plan.simulated_s * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec_problems(min_blocks=2, max_blocks=6, max_devices=4, replicate=True), st.data())
def test_pinning_no_codec_prices_the_plan_as_without_codecs(problem, data):
    k = data.draw(st.integers(1, min(len(problem.blocks), len(problem.devices))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(problem.blocks) - 1), min_size=k - 1, max_size=k - 1)))
    devices = data.draw(st.permutations(range(len(problem.devices))))
    sizes = [1] * k
    for _ in range(len(devices) - k):  # spare devices join random stages as replicas
        sizes[data.draw(st.integers(0, k - 1))] += 1
    groups = [tuple(devices[sum(sizes[:j]) : sum(sizes[: j + 1])]) for j in range(k)]
    plan = ([0, *cuts, len(problem.blocks)], groups)
    bare = dataclasses.replace(problem, codecs=None)
    pinned = evaluate(problem, *plan, bound_s=1.0, codecs=[("none", "none")] * k)
    reference = evaluate(bare, *plan, bound_s=1.0)
    assert pinned.stages == reference.stages
    assert (pinned.step_time_s, pinned.period_s) == (reference.step_time_s, reference.period_s)
    stages = stage_costs(problem, *plan, codecs=[("none", "none")] * k)
    assert simulate(problem, *plan, stages=stages).events == simulate(bare, *plan).events


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec_problems(min_blocks=2, max_blocks=6, max_devices=4))
def test_no_plan_with_codecs_simulates_faster_than_the_lower_bound(problem):
    bound = lower_bound(problem)
    n, d = len(problem.blocks), len(problem.devices)
    for k in range(1, min(n, d) + 1):
        for cuts in itertools.islice(itertools.combinations(range(1, n), k - 1), 3):
            plan = evaluate(problem, [0, *cuts, n], list(range(k)), bound_s=bound)
            if plan.step_time_s < math.inf:
                assert bound <= simulate(problem, [0, *cuts, n], list(range(k))).step_time_s * (1 + 1e-9)


# A message over the link between a (type t0) and b (type t1): latency 0.5 s, 1e8 B/s; per-type costs
# differ so that coding on the wrong side would show.
ENCODE, DECODE, CALL = {"t0": 1e-9, "t1": 2e-9}, {"t0": 1e-9, "t1": 1.5e-9}, {"t0": 0.1, "t1": 0.15}


def _hand_problem(training: bool, microbatches: int) -> PartitionProblem:
    problem = chain_problem(2, TWO, 1e8, fwd=1.0, cut=4e8, microbatches=microbatches, training=training)
    problem.bwd_s = {"t0": [1.0, 1.0], "t1": [1.0, 1.0]}
    problem.latency_s = [[0.0, 0.5], [0.5, 0.0]]
    problem.codecs = [
        row("int8", [1e8], [4e8], calls=[2], encode=ENCODE, decode=DECODE, call=CALL),
        row("int4", [5e7], [2e8], calls=[1], gradient=True, encode=ENCODE, decode=DECODE, call=CALL),
    ]
    return problem


def test_the_simulator_times_a_coded_message_on_the_link_by_hand():
    problem = _hand_problem(training=False, microbatches=4)
    plan = evaluate(problem, [0, 1, 2], [0, 1])
    # forward on a: 0.5 + 1e8 / 1e8 + 2 * (0.1 + 0.15) + 4e8 * (1e-9 + 1.5e-9) = 3 s (uncoded: 4.5 s)
    assert plan.stages[0].codecs == ("int8", "none")
    assert plan.stages[0].comm_s == pytest.approx(3.0)
    sim = simulate(problem, [0, 1, 2], [0, 1])
    # F(m) on a ends at m + 1; the link is the bottleneck: sends end at 4, 7, 10, 13; b's last F at 14.
    assert sim.step_time_s == pytest.approx(1.0 + 4 * 3.0 + 1.0)
    sends = [e for e in sim.events if e.kind == "SEND_F"]
    assert [(e.start_s, e.end_s) for e in sends] == pytest.approx([(1 + 3 * m, 4 + 3 * m) for m in range(4)])
    assert all(
        e.end_s - e.start_s == pytest.approx(1.0) for e in sim.events if e.kind == "F"
    )  # compute lanes untouched


def test_a_gradient_is_encoded_by_the_later_stage_and_decoded_by_the_earlier():
    problem = _hand_problem(training=True, microbatches=1)
    plan = evaluate(problem, [0, 1, 2], [0, 1])
    # back from b: 0.5 + 5e7 / 1e8 + (0.15 + 0.1) + 2e8 * (2e-9 + 1e-9) = 1.85 s (uncoded: 4.5 s)
    assert plan.stages[0].codecs == ("int8", "int4")
    assert plan.stages[0].comm_s == pytest.approx(3.0 + 1.85)
    sim = simulate(problem, [0, 1, 2], [0, 1])
    assert sim.step_time_s == pytest.approx(1 + 3.0 + 2 + 1.85 + 1)  # F, send, F and B, send back, B
    plain = simulate(problem, [0, 1, 2], [0, 1], codecs=[("none", "none"), None]).step_time_s
    assert plain == pytest.approx(1 + 4.5 + 2 + 4.5 + 1)


def test_wire_bytes_per_step_counts_every_message_once_per_microbatch():
    devices = [("a", "t0", "n0"), ("b", "t1", "n1"), ("c", "t1", "n2")]
    problem = chain_problem(3, devices, 1e8, microbatches=4)
    problem.cut_bytes, problem.cut_grad_bytes = [100.0, 200.0], [100.0, 0.0]
    problem.codecs = [
        row("int8", [25.0, 50.0], [100.0, 200.0]),
        row("int8", [30.0, 0.0], [100.0, 0.0], gradient=True),
    ]
    plan = ([0, 1, 2, 3], [0, 1, 2])
    pinned = evaluate(problem, *plan, codecs=[("int8", "int8"), ("none", "none"), None])
    assert wire_bytes_per_step(problem, pinned) == (4 * (25.0 + 200.0), 4 * 30.0)
    bare = dataclasses.replace(problem, codecs=None)
    assert wire_bytes_per_step(bare, evaluate(bare, *plan)) == (4 * 300.0, 4 * 100.0)
    # Tensors: a skip from block 0 to block 2 leaves stage 0 with stage 0's codec.
    problem.cut_tensors = [[0, [1], 100.0, 100.0], [0, [2], 40.0, 0.0], [1, [2], 200.0, 0.0]]
    problem.cut_bytes = [140.0, 240.0]
    problem.codecs = [
        row("int8", [35.0, 60.0], [140.0, 240.0], tensor_bytes=[25.0, 10.0, 50.0], tensor_coded=[True] * 3),
        row("int8", [30.0, 0.0], [100.0, 0.0], gradient=True, tensor_bytes=[30.0, 0.0, 0.0],
            tensor_coded=[True, False, False]),
    ]  # fmt: skip
    problem.validate()
    pinned = evaluate(problem, *plan, codecs=[("int8", "int8"), ("none", "none"), None])
    assert wire_bytes_per_step(problem, pinned) == (4 * (25.0 + 10.0 + 200.0), 4 * 30.0)


def test_a_solution_carries_its_codecs_through_its_dict():
    problem = chain_problem(4, TWO, 1e8, codecs=int8_rows(4))
    plan = evaluate(problem, [0, 2, 4], [0, 1])
    back = PartitionSolution.from_dict(plan.to_dict())
    assert back.stages[0].codecs == ("int8", "int8") and back.stages == plan.stages
