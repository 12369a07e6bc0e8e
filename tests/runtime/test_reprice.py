"""Re-pricing a saved plan for the devices the ranks found (``hetcc.launch --allow-substitute``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hetcc
from hetcc.runtime.reprice import format_repricing, reprice, repricing_lines
from hetcc.solver.problem import PartitionProblem
from hetcc.solver.simulate import simulate

GIB = 1024**3
RESERVE = 0.1  # the cluster's memory reserve


def _cluster() -> hetcc.Cluster:
    return hetcc.Cluster.from_spec(
        {"memory_reserve": RESERVE, "nodes": [{"name": "node0", "intra_link": {"kind": "nvlink", "bandwidth": "300 GB/s"},
                                               "devices": [{"type": "A100-80GB", "count": 2}, {"type": "T4", "count": 1}]}]}
    )  # fmt: skip


def _mlp() -> torch.nn.Module:
    """A four-layer MLP wide enough that its stages' times are FLOPs, not kernel launches."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())])


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    compiled = hetcc.compile(  # one stage per rank (a ZB-V plan's ranks: the test below)
        _mlp(), _cluster(), (torch.randn(1024, 1024),), microbatches=2, replicate=False, schedule="1f1b"
    )
    folder = compiled.save_plan(tmp_path_factory.mktemp("reprice"))
    return folder, compiled


def _a100_rank(compiled) -> tuple[int, int]:
    """(pipeline rank, problem device index) of a rank planned on an A100."""
    names = [d.name for d in compiled.problem.devices]
    for entry in compiled.pipeline.meta.placement:
        if entry.type == "A100-80GB":
            return entry.rank, names.index(entry.device)
    raise AssertionError("the plan uses no A100")


def _simulated_with(compiled, device: int, kind: str, memory_bytes: float) -> float:
    """The simulator's step for the saved problem with ``device`` of type ``kind``, computed directly (its
    stages per device as the plan runs them)."""
    problem = PartitionProblem.from_json(compiled.problem.to_json())
    problem.devices[device] = dataclasses.replace(
        problem.devices[device], type=kind, memory_bytes=memory_bytes
    )
    solution = compiled.solution
    return simulate(
        problem, solution.boundaries, solution.groups, solution.recompute, warmup=solution.warmup,
        chunks=compiled.plan.chunks,
    ).step_time_s  # fmt: skip


def test_a_type_of_the_cluster_is_priced_with_its_own_times(build):
    folder, compiled = build
    rank, device = _a100_rank(compiled)
    found = {"vendor": "nvidia", "name": "Tesla T4", "memory_bytes": 16 * GIB}
    result = reprice(folder, {rank: found})
    assert result.planned_step_s == compiled.plan.step_time_s
    assert result.step_s == pytest.approx(_simulated_with(compiled, device, "T4", 16 * GIB * (1 - RESERVE)))
    assert result.step_s > result.planned_step_s
    (sub,) = result.substitutions
    assert sub.priced_as == "T4" and sub.slowdown > 2 and not result.overflows
    headline, line = format_repricing(result)
    assert headline.startswith("hetcc.launch: re-priced for the devices found: simulated step ")
    assert f"stage {sub.stage} on Tesla T4 (16 GiB) instead of A100-80GB" in line
    assert "x slower (T4: a type of the plan)" in line


def test_a_zbv_plan_is_priced_with_both_stages_of_the_rank_on_the_device_found(tmp_path):
    """A rank of a ZB-V plan runs two stages (its V): the device found re-prices both, and the step is the
    simulator's for the plan's two-stage ranks on it."""
    compiled = hetcc.compile(
        _mlp(), _cluster(), (torch.randn(1024, 1024),), microbatches=4, replicate=False, schedule="zbv"
    )
    plan = compiled.plan
    assert plan.chunks == 2 and plan.ranks == 2, plan.explain()
    folder = compiled.save_plan(tmp_path)
    rank, device = _a100_rank(compiled)
    result = reprice(folder, {rank: {"vendor": "nvidia", "name": "Tesla T4", "memory_bytes": 16 * GIB}})
    (sub,) = result.substitutions
    assert sub.stages == (rank, 2 * plan.ranks - 1 - rank) and sub.priced_as == "T4"
    problem = PartitionProblem.from_json(compiled.problem.to_json())
    bounds = compiled.solution.boundaries
    blocks = [i for j in sub.stages for i in range(bounds[j], bounds[j + 1])]

    def seconds(kind: str) -> float:
        return sum(problem.fwd_s[kind][i] + problem.bwd_s[kind][i] for i in blocks)

    assert sub.slowdown == pytest.approx(seconds("T4") / seconds("A100-80GB")) and sub.slowdown > 1.5
    expected = _simulated_with(compiled, device, "T4", 16 * GIB * (1 - RESERVE))
    assert result.step_s == pytest.approx(expected) and result.step_s > result.planned_step_s
    line = format_repricing(result)[1]
    assert line.startswith(
        f"  stages {', '.join(map(str, sub.stages))} on Tesla T4 (16 GiB) instead of A100-80GB"
    )
    assert "stages forward+backward" in line
    tiny = reprice(folder, {rank: {"vendor": "nvidia", "name": "Tesla T4", "memory_bytes": 2**20}})
    (overflow,) = tiny.overflows  # the device's two stages, counted together, once
    assert overflow.stage == rank and overflow.stages == sub.stages
    assert format_repricing(tiny)[-1].startswith(
        f"  stages {', '.join(map(str, sub.stages))} no longer fit (one device)"
    )


def test_a_preset_outside_the_cluster_is_priced_by_the_peak_ratio(build):
    folder, compiled = build
    rank, _ = _a100_rank(compiled)
    found = {"vendor": "nvidia", "name": "NVIDIA H200", "memory_bytes": 141 * GIB}
    result = reprice(folder, {rank: found})
    (sub,) = result.substitutions
    assert sub.slowdown == pytest.approx(19.5 / 67)  # fp32 peaks: A100 19.5, H200 67 TFLOP/s
    assert result.step_s < result.planned_step_s
    line = format_repricing(result)[1]
    assert (
        "x faster (H200: A100-80GB's times x its fp32 peak over H200's, 19.5/67 TFLOP/s, an approximation)"
        in line
    )


def test_a_device_with_too_little_memory_says_the_stage_no_longer_fits(build):
    folder, compiled = build
    rank, _ = _a100_rank(compiled)
    stage = compiled.pipeline.meta.placement[rank].stage
    found = {"vendor": "nvidia", "name": "Tesla T4", "memory_bytes": 2**20}
    result = reprice(folder, {rank: found})
    (overflow,) = result.overflows
    assert overflow.stage == stage and overflow.usable_bytes == pytest.approx(2**20 * (1 - RESERVE))
    assert f"  stage {stage} no longer fits: needs " in format_repricing(result)[-1]
    assert format_repricing(result)[-1].endswith(", has 922 KiB usable")


def test_a_gpu_plan_on_cpu_ranks_is_not_repriced(build, tmp_path):
    folder, _ = build
    cpu = {"vendor": "cpu", "name": "CPU", "memory_bytes": 0}
    assert repricing_lines(folder, {0: cpu, 1: cpu}) == [
        "hetcc.launch: running a GPU plan on CPU (ranks 0, 1): times are not re-priced"
    ]
    assert repricing_lines(
        tmp_path, {1: cpu}
    ) == [  # said before reading the folder (a pipeline without a plan)
        "hetcc.launch: running a GPU plan on CPU (rank 1): times are not re-priced"
    ]


def test_an_unknown_gpu_says_why_it_cannot_be_repriced(build, tmp_path):
    folder, _ = build
    found = {"vendor": "nvidia", "name": "NVIDIA Quux 9000", "memory_bytes": 48 * GIB}
    (line,) = repricing_lines(folder, {0: found})
    assert line.startswith(
        "hetcc.launch: rank 0 found 'NVIDIA Quux 9000', which names no GPU hetcc has figures"
    )
    assert "the plan cannot be re-priced for it" in line
    (line,) = repricing_lines(tmp_path, {0: found})  # not a compiled folder: one line, no traceback
    assert line.startswith("hetcc.launch: cannot re-price the plan for the devices found: ")
    assert "plan.json does not exist" in line
