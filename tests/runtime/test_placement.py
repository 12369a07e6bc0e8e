"""Placement: the saved rank list, the torchrun command per node, and each rank's device check at start."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_models import MLP_RULES, ResidualMLP, export, stages_by_module

import hetcc
from hetcc import cli
from hetcc.errors import PlanFormatError
from hetcc.launch import read_placement
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta, placement_json
from hetcc.runtime.placement import device_mismatch, placement, rank_at, torchrun_commands
from hetcc.runtime.store import save_stages
from hetcc.train import checkpoint as ckpt

ROOT = Path(__file__).parents[2]
TWO_NODES = ROOT / "examples" / "clusters" / "mixed_a100_t4.yaml"


def _two_node_placement():
    """Stage 0 on a T4 of node1, stages 1 and 2 on A100s of node0: a node's stages need not be consecutive."""
    cluster = hetcc.Cluster.from_file(TWO_NODES)
    return placement([[cluster.device(name)] for name in ("t4-1", "a100-80gb-0", "a100-80gb-2")])


def test_placement_lists_every_rank_with_its_device_node_and_torchrun_position():
    ranks = _two_node_placement()
    assert [(r.rank, r.stage, r.replica, r.device, r.node, r.local_index) for r in ranks] == [
        (0, 0, 0, "t4-1", "node1", 1), (1, 1, 0, "a100-80gb-0", "node0", 0), (2, 2, 0, "a100-80gb-2", "node0", 2),
    ]  # fmt: skip
    assert [(r.node_rank, r.local_rank) for r in ranks] == [(1, 0), (0, 0), (0, 1)]
    assert ranks[0].type == "T4" and ranks[0].vendor == "nvidia"
    assert rank_at(ranks, 1, 0).stage == 0 and rank_at(ranks, 0, 1).stage == 2


def test_launch_prints_one_torchrun_command_per_node(tmp_path, capsys):
    (tmp_path / "placement.json").write_text(json.dumps(placement_json(_two_node_placement())))
    assert cli.main(["launch", str(tmp_path), "--rdzv-endpoint", "10.0.0.1:29500", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    node0, node1 = out.split("\n\n")
    assert node0.splitlines()[1] == (
        f"torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --master-addr=10.0.0.1 --master-port=29500 "
        f"-m hetcc.launch {tmp_path} --steps 5"
    )
    assert "rank 1 = stage 1 on a100-80gb-0 (A100-80GB, GPU 0), rank 2 = stage 2 on a100-80gb-2" in node0
    assert "--node-rank=1 --nproc-per-node=1" in node1 and "rank 0 = stage 0 on t4-1 (T4, GPU 1)" in node1
    with pytest.raises(ValueError, match="HOST:PORT"):
        torchrun_commands(_two_node_placement(), "build", "no-port")


def test_a_rank_checks_its_device_against_the_plan():
    a100, t4 = _two_node_placement()[1], _two_node_placement()[0]
    gib = 1024**3
    assert (
        device_mismatch(a100, {"vendor": "nvidia", "name": "NVIDIA A100-SXM4-80GB", "memory_bytes": 80 * gib})
        is None
    )
    assert device_mismatch(t4, {"vendor": "nvidia", "name": "Tesla T4", "memory_bytes": 15.6 * gib}) is None
    small = device_mismatch(
        a100, {"vendor": "nvidia", "name": "NVIDIA A100-PCIE-40GB", "memory_bytes": 40 * gib}
    )
    assert (
        "planned on a100-80gb-0, a A100-80GB with 80 GiB, but found NVIDIA A100-PCIE-40GB with 40 GiB"
        in small
    )
    assert "found Tesla T4" in device_mismatch(
        a100, {"vendor": "nvidia", "name": "Tesla T4", "memory_bytes": 16 * gib}
    )
    assert "found CPU (cpu)" in device_mismatch(a100, {"vendor": "cpu", "name": "CPU", "memory_bytes": 0})


def _gpu_planned_folder(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    gm = export(ResidualMLP(), (x[:4],))
    stages = split_stages(gm, stages_by_module(gm, [(p, min(s, 1)) for p, s in MLP_RULES]), 2)
    cluster = hetcc.Cluster.from_file(TWO_NODES)
    meta = PipelineMeta(
        2, microbatches=2, loss="mse_loss", optimizer={"name": "sgd", "lr": 0.1},
        placement=placement([[cluster.device("a100-80gb-0")], [cluster.device("a100-80gb-1")]]),
    )  # fmt: skip
    save_stages(stages, str(tmp_path), meta, inputs={"x": x}, targets=y)
    return tmp_path


def _torchrun(folder, *args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "hetcc.launch", str(folder), *args]  # fmt: skip
    env = {**os.environ, "HETCC_COMM_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU plan started on a host without GPUs")
def test_a_gpu_plan_stops_on_a_cpu_host_unless_substitutes_are_allowed(tmp_path):
    folder = _gpu_planned_folder(tmp_path)
    refused = _torchrun(folder, "--steps", "1")
    assert refused.returncode != 0
    # both ranks refuse; torchrun may stop one before it says so (whichever fails first ends the job)
    assert re.search(
        r"rank (\d) \(stage \1\) was planned on a100-80gb-\1, a A100-80GB \(nvidia\), but found CPU \(cpu\)",
        refused.stderr,
    )
    assert "--allow-substitute" in refused.stderr
    allowed = _torchrun(folder, "--steps", "2", "--checkpoint-every", "1", "--allow-substitute")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert allowed.stderr.count("running on it anyway (--allow-substitute)") == 2  # once per rank
    assert allowed.stderr.count("running a GPU plan on CPU (ranks 0, 1): times are not re-priced") == 1
    assert "step 1 loss" in allowed.stdout
    assert ckpt.latest_complete_step(folder / "checkpoints", 2) == 2  # the trained weights, by default
    assert set(hetcc.export(folder)) == {"a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_launch_runs_the_command_of_one_node(tmp_path):
    folder = _gpu_planned_folder(tmp_path)
    cpus = hetcc.Cluster.from_file(ROOT / "examples" / "clusters" / "cpu4.yaml")
    document = json.loads((folder / "pipeline.json").read_text())
    document["meta"]["placement"] = placement_json(
        placement([[cpus.device("cpu-0")], [cpus.device("cpu-1")]])
    )
    (folder / "pipeline.json").write_text(json.dumps(document))
    command = [sys.executable, "-m", "hetcc.cli", "launch", str(folder), "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               "--node", "0", "--steps", "2"]  # fmt: skip
    env = {**os.environ, "HETCC_COMM_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--nnodes=1 --node-rank=0 --nproc-per-node=2" in done.stderr  # the command it ran
    assert "step 1 loss" in done.stdout
    assert ckpt.latest_complete_step(folder / "checkpoints", 2) == 2


def test_launch_refuses_a_placement_json_that_disagrees_with_pipeline_json(tmp_path):
    """The ranks run what pipeline.json places; a placement.json saying otherwise would print torchrun
    commands that start them on other devices."""
    folder = _gpu_planned_folder(tmp_path)
    (folder / "placement.json").write_text(json.dumps(placement_json(_two_node_placement())))
    with pytest.raises(PlanFormatError, match="place the ranks differently") as info:
        read_placement(str(folder))
    assert "compile the model again" in str(info.value)
    plan_only = tmp_path / "plan-only"  # placement.json alone: read and checked as pipeline.json's is
    plan_only.mkdir()
    for ranks, message in (
        ([{"rank": 0, "stage": 1}], r"placement.json: stage 0 has replicas \[\]"),
        (
            [{"rank": 0, "stage": 0, "memory_bytes": -1}],
            r"placement.json: \[0\].memory_bytes: expected an integer >= 0",
        ),
    ):
        (plan_only / "placement.json").write_text(json.dumps(ranks))
        with pytest.raises(PlanFormatError, match=message):
            read_placement(str(plan_only))
