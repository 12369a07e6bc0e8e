"""``hetcc.compile(..., schedule="interleaved-1f1b")``: v chunks on each device (or group of replicas) of
the best 1F1B pipeline (``solver.interleave.solve_interleaved``), saved with position r running stages
r, r + p, ...; ``schedule="zbv"``: that pipeline's devices in a V (``solve_zbv``). Each is replayed by the
report and trained by the runtime equal to eager PyTorch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from models import eager_training

import hetcc
from hetcc.cli import main
from hetcc.errors import HetccError, InfeasiblePlanError
from hetcc.passes.schedule_search import planned_schedule, solve_each_schedule
from hetcc.report.data import load, simulate_plan
from hetcc.solver.problem import PartitionProblem, ProblemDevice, TensorSplit
from hetcc.solver.schedules import INTERLEAVED, ZBV

ADAM = {"name": "adam", "lr": 0.01}


def _cluster(count: int) -> hetcc.Cluster:
    link = {"kind": "nvlink", "bandwidth": "300 GB/s", "latency": "5 us"}
    return hetcc.Cluster.from_spec(
        {"nodes": [{"name": "n0", "intra_link": link, "devices": [{"type": "A100-80GB", "count": count}]}]}
    )


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=6, n_embd=64, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def _compiled(count: int, schedule: str):
    """(the model, its inputs, its compile for ``count`` A100s under ``schedule`` at M = 4)."""
    model, inputs = _gpt2()
    compiled = hetcc.compile(model, _cluster(count), example_kwargs=inputs, microbatches=4, schedule=schedule)
    return model, inputs, compiled


@pytest.fixture(scope="module")
def interleaved():
    return _compiled(2, INTERLEAVED)


def test_each_device_runs_every_pth_stage_and_the_plan_replays(interleaved, tmp_path):
    _, _, compiled = interleaved
    plan = compiled.plan
    k, p = len(plan.stages), plan.ranks
    assert plan.schedule == INTERLEAVED and p == 2 and plan.chunks == k // p >= 2
    assert [s.device for s in plan.stages] == [plan.stages[j % p].device for j in range(k)]
    assert [r.stages for r in compiled.pipeline.meta.placement] == [tuple(range(r, k, p)) for r in range(p)]
    assert 0 < plan.lower_bound_s <= plan.step_time_s
    assert f"{k} stages on {p} devices ({plan.chunks} stages each)" in plan.explain()
    assert any(note.startswith(f"schedule: {INTERLEAVED} with {plan.chunks} chunks") for note in plan.notes)
    assert simulate_plan(plan, compiled.problem).step_time_s == pytest.approx(plan.step_time_s)
    saved = load(compiled.save_plan(tmp_path))  # what `hetcc simulate` and the report replay
    assert saved.simulation.step_time_s == pytest.approx(plan.step_time_s)


def test_hetcc_simulate_prints_the_interleaved_grid(interleaved, tmp_path, capsys):
    _, _, compiled = interleaved
    assert main(["simulate", str(compiled.save_plan(tmp_path))]) == 0
    out = capsys.readouterr().out
    grid = [line for line in out.splitlines() if line.startswith("rank")]
    assert len(grid) == 2  # one row per device, each running its chunks' stages
    assert f"F0.{compiled.plan.chunks - 1}" in out  # the last chunk's forward of microbatch 0


def test_interleaving_needs_two_devices_and_whole_stages():
    model, inputs = _gpt2()
    with pytest.raises(HetccError, match="takes no tensor_parallel=2"):
        hetcc.compile(model, _cluster(2), example_kwargs=inputs, microbatches=4, schedule=INTERLEAVED,
                      tensor_parallel=2)  # fmt: skip
    with pytest.raises(
        InfeasiblePlanError, match="interleaves: it needs 2 devices \\(or replica groups\\) or more"
    ):
        hetcc.compile(model, _cluster(1), example_kwargs=inputs, microbatches=4, schedule=INTERLEAVED)


@pytest.fixture(scope="module")
def replicated():
    """Four A100s: the pipeline over two groups of two, each group one position that its two replicas run
    over every other microbatch, beats interleaving four single devices (the notes give both)."""
    return _compiled(4, INTERLEAVED)


def test_interleaving_replicates_the_pipeline_whole_where_that_is_faster(replicated, tmp_path):
    _, _, compiled = replicated
    plan = compiled.plan
    k, p = len(plan.stages), plan.ranks
    assert plan.schedule == INTERLEAVED and p == 2 and plan.chunks == k // 2 >= 2
    assert [s.devices for s in plan.stages] == [plan.stages[j % 2].devices for j in range(k)]
    assert (
        all(len(s.devices) == 2 for s in plan.stages)
        and len({d for s in plan.stages for d in s.devices}) == 4
    )
    (note,) = [n for n in plan.notes if n.startswith(f"schedule: {INTERLEAVED}")]
    assert "on each of the 2 groups of 2 replicas" in note and "R = 1, v = 2" in note
    half = plan.microbatches // 2  # the 1F1B figure is one replica's, before the gradients are summed
    assert f"pipeline (one replica's {half} microbatches, no all-reduce: " in note
    assert f"{k} stages on 4 devices ({plan.chunks} stages each)" in plan.explain()
    placement = compiled.pipeline.meta.placement
    assert [(r.stage, r.replica, r.stages) for r in placement] == [
        (r, i, tuple(range(r, k, 2))) for r in range(2) for i in range(2)
    ]
    assert compiled.pipeline.meta.routing == ((0, 1, 0, 1),) * k
    assert 0 < plan.lower_bound_s <= plan.step_time_s
    assert simulate_plan(plan, compiled.problem).step_time_s == pytest.approx(plan.step_time_s)
    saved = load(compiled.save_plan(tmp_path))
    assert saved.simulation.step_time_s == pytest.approx(plan.step_time_s)


def test_hetcc_simulate_prints_one_replicas_grid(replicated, tmp_path, capsys):
    _, _, compiled = replicated
    assert main(["simulate", str(compiled.save_plan(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "replica 0 of 2, its 2 microbatches numbered 0..1:" in out
    grid = [line.split("|")[1].split() for line in out.splitlines() if line.startswith("rank")]
    cells = {cell.partition(".")[0] or cell for row in grid for cell in row}  # F1.2: chunk 2's forward of 1
    assert len(grid) == 2 and cells == {"F0", "F1", "B0", "B1", "."}


@pytest.fixture(scope="module")
def zbv():
    return _compiled(2, ZBV)


def test_zbv_lays_the_pipeline_in_a_v_and_the_plan_replays(zbv, tmp_path, capsys):
    _, _, compiled = zbv
    plan = compiled.plan
    assert plan.schedule == ZBV and plan.ranks == 2 and plan.chunks == 2 and len(plan.stages) == 4
    assert [s.devices for s in plan.stages] == [plan.stages[min(j, 3 - j)].devices for j in range(4)]
    assert [r.stages for r in compiled.pipeline.meta.placement] == [(0, 3), (1, 2)]
    assert (
        "4 stages on 2 devices (2 stages each)" in plan.explain() and "runs stages j, 3 - j" in plan.explain()
    )
    assert 0 < plan.lower_bound_s <= plan.step_time_s
    assert simulate_plan(plan, compiled.problem).step_time_s == pytest.approx(plan.step_time_s)
    assert main(["simulate", str(compiled.save_plan(tmp_path))]) == 0
    grid = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank")]
    assert len(grid) == 2 and "W0.1" in grid[0]  # the last stage's weight gradient, on rank 0


@pytest.mark.slow
@pytest.mark.parametrize("build", ["interleaved", "replicated", "zbv"])
def test_each_multi_stage_build_trains_like_eager(build, request, tmp_path):
    """Interleaved 1F1B on two devices, replicated whole on four, and ZB-V on two: wte (stage 0) and
    lm_head (the last stage) are one parameter, across ranks or (ZB-V) on rank 0, summed over every
    holder and reported once."""
    model, inputs, compiled = request.getfixturevalue(build)
    folder = compiled.save(tmp_path / "build")
    result = hetcc.run_local(folder, {k: v for k, v in inputs.items() if k != "use_cache"}, steps=2,
                             optimizer=ADAM)  # fmt: skip
    losses, grads = eager_training(model, inputs, None, None, 2, 4, ADAM)
    error = max(abs(got - want) / abs(want) for got, want in zip(result.losses, losses, strict=True))
    assert error <= 1e-5, (result.losses, losses)
    assert set(grads) - set(result.grads) == {"lm_head.weight"}  # tied to wte, reported once
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-4, msg=name)


def test_auto_keeps_a_plan_whose_devices_run_several_stages_where_it_wins_at_degree_one():
    """Two slow nodes of two cards each (4 blocks, 2 microbatches), a degree-2 row that gains nothing: with
    tensor parallelism off, ZB-V (each card two stages of a V) beats every one-stage-per-card plan; with
    ``tensor="auto"`` the search must find it too, at degree 1, not stop at the schedules tensor parts take."""
    n, inf = 4, math.inf
    fwd, bwd = {"x": [0.5] * n, "y": [0.8] * n}, {"x": [1.0] * n, "y": [1.6] * n}
    devices = [
        ProblemDevice(f"{k}{i}", k, 6.6 if k == "x" else 4.9, f"node_{k}") for k in "xy" for i in range(2)
    ]
    row = TensorSplit(
        2, fwd, bwd, None, [0.5, 0.5, 0.5, 1.1], [0.9, 0.8, 0.6, 0.5], [0.125] * 3 + [0.275], None
    )
    problem = PartitionProblem(
        blocks=[f"b{i}" for i in range(n)], fwd_s=fwd, bwd_s=bwd, state_bytes=[1.0, 1.0, 1.0, 2.2],
        act_bytes=[1.0] * n, cut_bytes=[0.9, 1 / 3, 0.1], devices=devices,
        bandwidth_bps=[[inf if a == b else (20.0 if (a < 2) == (b < 2) else 3.5) for b in range(4)] for a in range(4)],
        latency_s=[[0.0 if a == b else 0.01 for b in range(4)] for a in range(4)], microbatches=2, tensor_splits=[row],
    )  # fmt: skip
    off = solve_each_schedule(dataclasses.replace(problem, tensor_splits=None), "auto")
    one_stage = solve_each_schedule(problem, "auto", "auto", multi_stage=False)
    solved, solution, note, device_map = solve_each_schedule(problem, "auto", "auto")
    assert planned_schedule(*off[:2]) == "zbv" and off[1].simulated_s < one_stage[1].simulated_s
    assert "zbv" not in one_stage[2] and "interleaved" not in one_stage[2]  # as with a degree pinned
    assert planned_schedule(solved, solution) == "zbv" and solution.chunks == 2
    assert solution.simulated_s == pytest.approx(off[1].simulated_s, rel=1e-12)
    assert device_map == [(0,), (1,), (2,), (3,)] and f"zbv {solution.simulated_s * 1e3:.2f} ms" in note
    assert solution.lower_bound_s <= solution.simulated_s
