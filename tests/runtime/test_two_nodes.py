"""Two nodes on this host: `hetcc launch DIR --node N` started for both nodes of a compiled plan at once."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import eager_training
from runtime_models import ResidualMLP

import hetcc

ROOT = Path(__file__).parents[2]
WIDTH, ROWS, MICROBATCHES, STEPS = 64, 8, 2, 2
DEADLINE_S = 180


class MLPWithLoss(ResidualMLP):
    """ResidualMLP returning its own loss: the plan's ``meta.loss`` is "model"."""

    def forward(self, x, y):
        return F.mse_loss(super().forward(x), y)


def _two_node_cpus() -> hetcc.Cluster:
    """node0 with one CPU device, node1 with two; 40 KiB each fits one layer of the 64-wide MLP per device."""
    loopback = {"kind": "loopback", "bandwidth": "5 GB/s", "latency": "30 us"}
    return hetcc.Cluster.from_spec({
        "nodes": [{"name": "node0", "intra_link": loopback, "devices": [{"type": "cpu", "count": 1, "memory": "40 KiB"}]},
                  {"name": "node1", "intra_link": loopback, "devices": [{"type": "cpu", "count": 2, "memory": "40 KiB"}]}],
        "inter_node_link": {"kind": "ethernet", "bandwidth": "5 GB/s", "latency": "30 us"},
    })  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_nodes(folder: Path, endpoint: str, nodes: int) -> list[tuple[subprocess.Popen, Path, Path]]:
    """One `hetcc launch --node N` per node, each in its own process group (torchrun and its ranks
    under it), writing to files: a full pipe cannot stall one node while the test waits on the other."""
    env = {**os.environ, "HETCC_COMM_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
    started = []
    for node in range(nodes):
        out, err = folder / f"node{node}.out", folder / f"node{node}.err"
        command = [sys.executable, "-m", "hetcc.cli", "launch", str(folder), "--rdzv-endpoint", endpoint,
                   "--node", str(node), "--steps", str(STEPS)]  # fmt: skip
        with open(out, "w") as stdout, open(err, "w") as stderr:
            process = subprocess.Popen(
                command, env=env, cwd=ROOT, stdout=stdout, stderr=stderr, start_new_session=True
            )
        started.append((process, out, err))
    return started


def _wait_all(started: list[tuple[subprocess.Popen, Path, Path]]) -> list[tuple[int, str, str]]:
    """Every node's (exit code, stdout, stderr); past the deadline every node's group is killed and the
    test fails with what each one wrote."""
    end = time.monotonic() + DEADLINE_S
    try:
        codes = [process.wait(timeout=max(0.0, end - time.monotonic())) for process, _, _ in started]
    except subprocess.TimeoutExpired:
        for process, _, _ in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        written = "\n".join(
            f"node {n} stderr:\n{err.read_text()[-2000:]}" for n, (_, _, err) in enumerate(started)
        )
        pytest.fail(f"the two nodes did not finish within {DEADLINE_S} s\n{written}")
    return [(code, out.read_text(), err.read_text()) for code, (_, out, err) in zip(codes, started)]


@pytest.mark.slow
def test_two_nodes_started_by_hetcc_launch_train_like_eager(tmp_path):
    torch.manual_seed(0)
    model = MLPWithLoss(WIDTH)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    compiled = hetcc.compile(
        model, _two_node_cpus(), (x, y), microbatches=MICROBATCHES, optimizer="sgd", replicate=False
    )
    folder = compiled.save(tmp_path / "build", inputs={"x": x, "y": y})
    ranks = json.loads((folder / "placement.json").read_text())
    # node0's one device runs the last stage: the process torchrun starts as node 0 is rank 2, not rank 0
    assert [(r["rank"], r["stage"], r["node"], r["node_rank"], r["local_rank"]) for r in ranks] == [
        (0, 0, "node1", 1, 0), (1, 1, "node1", 1, 1), (2, 2, "node0", 0, 0),
    ]  # fmt: skip

    done = _wait_all(_start_nodes(folder, f"127.0.0.1:{_free_port()}", nodes=2))
    for node, (code, _, err) in enumerate(done):
        assert code == 0, f"node {node} exited with {code}:\n{err[-3000:]}"
    (_, out0, err0), (_, out1, err1) = done
    # each node names the stages it runs, then the torchrun command it starts
    assert "# node 0 (node0): rank 2 = stage 2 on cpu-0 (cpu)\n" in err0
    assert "# node 1 (node1): rank 0 = stage 0 on cpu-1 (cpu), rank 1 = stage 1 on cpu-2 (cpu)\n" in err1
    assert "--nnodes=2 --node-rank=1 --nproc-per-node=2" in err1
    assert out1 == ""  # the last stage's losses come from node 0
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out0, flags=re.MULTILINE)]
    # the plan's optimizer is {"name": "sgd"}: torch's default learning rate on both sides
    expected, _ = eager_training(model, {"x": x, "y": y}, None, lambda loss, _: loss, STEPS, MICROBATCHES,
                                 {"name": "sgd"})  # fmt: skip
    assert re.findall(r"^step (\d+) loss", out0, flags=re.MULTILINE) == [str(step) for step in range(STEPS)]
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
