"""A saved folder run by torchrun + hetcc.launch, and a rank dying mid-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runtime_models import (
    MLP_RULES,
    ResidualMLP,
    eager_reference,
    export,
    planned_transfers,
    stages_by_module,
)

from hetcc import config
from hetcc.errors import RuntimeFailure
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.executor import FAULT_ENV
from hetcc.runtime.store import save_stages
from hetcc.train.local import run_local

pytestmark = pytest.mark.slow
TWO_STAGES = [(prefix, min(stage, 1)) for prefix, stage in MLP_RULES]


def _two_stage_mlp(width: int = 8, rows: int = 8):
    torch.manual_seed(0)
    model = ResidualMLP(width)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    gm = export(model, (x[: rows // 2],))
    return model, x, y, split_stages(gm, stages_by_module(gm, TWO_STAGES), 2)


def test_torchrun_launch_of_a_saved_folder_matches_eager(tmp_path):
    # A gloo send completes only once its recv is posted, so 1F1B deadlocks (rank 0 sends F1 while
    # rank 1 sends B0's gradient) unless sends are non-blocking; 4 MiB activations make it plain.
    model, x, y, stages = _two_stage_mlp(width=512, rows=4096)
    optimizer = {"name": "sgd", "lr": 0.1}
    meta = PipelineMeta(2, microbatches=2, loss="mse_loss", optimizer=optimizer)
    save_stages(stages, str(tmp_path), meta, inputs={"x": x}, targets=y)
    losses_file = tmp_path / "losses.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "hetcc.launch", str(tmp_path), "--steps", "2", "--losses-out", str(losses_file),
        "--stats-out", str(tmp_path / "stats"),
    ]  # fmt: skip
    env = {**os.environ, "HETCC_COMM_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1 loss" in done.stdout
    expected, _, _ = eager_reference(model, {"x": x}, y, F.mse_loss, 2, 2, optimizer)
    for got, want in zip(json.loads(losses_file.read_text()), expected, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    for rank, planned in enumerate(planned_transfers(stages, microbatches=2, steps=2)):
        stats = json.loads((tmp_path / "stats" / f"stats_rank{rank}.json").read_text())
        assert {key: stats[key] for key in planned} == planned


def test_a_dead_rank_becomes_runtime_failure_on_the_others(monkeypatch):
    _, x, y, stages = _two_stage_mlp()
    monkeypatch.setenv(FAULT_ENV, "1:1")  # rank 1 exits at the start of step 1
    with config.patch(comm_timeout_s=20.0), pytest.raises(RuntimeFailure) as failure:
        run_local(stages, {"x": x}, y, F.mse_loss, steps=3, microbatches=2)
    message = str(failure.value)
    assert "rank 1 exited with code 1" in message
    # rank 0 raised (it was not killed by the deadline), naming the dead peer and what it waited for
    assert "rank 0: RuntimeFailure: rank 0 failed waiting for" in message
    assert "rank 1" in message.split("rank 0: RuntimeFailure:")[1]


def test_a_rank_whose_stage_files_are_damaged_stops_every_rank_at_once_naming_it(tmp_path):
    """Two ranks as two nodes would start them (no torchrun agent to stop the survivor): rank 1 cannot
    load its stage, and rank 0, which could, stops at start too (not at the 120 s communication
    timeout), both naming rank 1's cause."""
    _, x, y, stages = _two_stage_mlp()
    meta = PipelineMeta(2, microbatches=2, loss="mse_loss")
    save_stages(stages, str(tmp_path), meta, inputs={"x": x}, targets=y)
    (tmp_path / "stage1.graph.json").write_text("{")  # damaged
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    started = time.monotonic()
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "HETCC_COMM_TIMEOUT_S": "120", "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [sys.executable, "-m", "hetcc.launch", str(tmp_path), "--steps", "2"]
        ranks.append(
            subprocess.Popen(
                command, env=env, cwd=Path(__file__).parents[2], stderr=subprocess.PIPE, text=True
            )
        )
    errors = [process.communicate(timeout=300)[1] for process in ranks]
    assert time.monotonic() - started < 60  # well inside the 120 s timeout
    for rank, (process, stderr) in enumerate(zip(ranks, errors)):
        assert process.returncode == 1, stderr[-2000:]
        line = next(ln for ln in stderr.splitlines() if ln.startswith(f"hetcc.launch rank {rank}:"))
        assert "the pipeline cannot start: rank 1: PlanFormatError" in line and "stage1.graph.json" in line
