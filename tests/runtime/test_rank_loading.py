"""Each rank reads pipeline.json and its own stage's files only; a resumed run numbers its steps on
from the checkpoint's step (``RunResult.first_step``, ``hetcc run``, ``hetcc.launch``)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.nn.functional as F
from runtime_models import MLP_RULES, ResidualMLP, export, mlp_batches, stages_by_module

from hetcc import cli, launch
from hetcc.errors import HetccError, PlanFormatError
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.store import save_stages
from hetcc.train.local import run_local
from hetcc.train.startup import load_rank

SGD = {"name": "sgd", "lr": 0.1}


def _saved_mlp(folder, num_stages: int) -> None:
    """A ResidualMLP split over ``num_stages`` stages, saved with its inputs, targets and run meta."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = export(ResidualMLP(), (x,))
    rules = [(prefix, min(stage, num_stages - 1)) for prefix, stage in MLP_RULES]
    stages = split_stages(gm, stages_by_module(gm, rules), num_stages)
    meta = PipelineMeta(num_stages, loss="mse_loss", optimizer=SGD)
    save_stages(stages, str(folder), meta, inputs={"x": x}, targets=y)


def test_a_rank_reads_only_its_own_stage(tmp_path):
    _saved_mlp(tmp_path, 3)
    weights = tmp_path / "stage1.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    (tmp_path / "stage1.graph.json").unlink()
    for rank in (0, 2):
        outline, (stage,) = load_rank(str(tmp_path), rank)
        assert stage.index == rank and stage.is_last == (rank == 2)
        assert [s.inputs for s in outline.stages] == [("x",), (), ()]  # the others, from pipeline.json
        assert outline.stages[0].input_shapes == {"x": (4, 8)} and outline.meta.optimizer == SGD
    with pytest.raises(PlanFormatError, match="stage1.graph.json"):
        load_rank(str(tmp_path), 1)


def test_run_local_reports_a_damaged_stage_once_before_starting_ranks(tmp_path):
    _saved_mlp(tmp_path, 2)
    weights = tmp_path / "stage1.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(PlanFormatError, match="stage1.safetensors"):
        run_local(str(tmp_path), {"x": torch.randn(4, 8)}, torch.randn(4, 8), F.mse_loss)


@pytest.mark.slow
def test_hetcc_run_resume_numbers_steps_from_the_checkpoint(tmp_path, capsys):
    _saved_mlp(tmp_path, 2)
    run = ["run", str(tmp_path), "--loss", "mse_loss"]
    assert cli.main([*run, "--steps", "2"]) == 0
    assert _printed_steps(capsys) == ["0", "1"]
    assert cli.main([*run, "--steps", "2", "--resume"]) == 0
    assert _printed_steps(capsys) == ["2", "3"]


@pytest.fixture
def one_rank_world(monkeypatch):
    """The environment torchrun gives a one-process world (``python -m hetcc.launch`` in this process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(port))


@pytest.mark.usefixtures("one_rank_world")
def test_launch_resume_numbers_steps_from_the_checkpoint(tmp_path, capsys):
    """``python -m hetcc.launch`` in this process as a one-rank world (a one-stage pipeline)."""
    _saved_mlp(tmp_path, 1)
    assert launch.main([str(tmp_path), "--steps", "3", "--checkpoint-every", "3"]) == 0
    assert _printed_steps(capsys) == ["0", "1", "2"]
    assert launch.main([str(tmp_path), "--steps", "2", "--resume"]) == 0
    assert _printed_steps(capsys) == ["3", "4"]


def _printed_steps(capsys) -> list[str]:
    """The step numbers of the ``step <i> loss <value>`` lines printed since the last call."""
    return [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


@pytest.mark.usefixtures("one_rank_world")
def test_launch_trains_on_the_data_it_is_given(tmp_path, capsys):
    """``--data pkg.module:factory``: step k trains batch k of what the factory returns (eager SGD on the
    same batches agrees); a factory that does not exist is named before the process group starts."""
    _saved_mlp(tmp_path, 1)
    assert launch.main([str(tmp_path), "--steps", "3", "--data", "runtime_models:mlp_batches"]) == 0
    printed = [
        float(line.split()[3]) for line in capsys.readouterr().out.splitlines() if line.startswith("step ")
    ]
    torch.manual_seed(0)
    torch.randn(4, 8), torch.randn(4, 8)  # as _saved_mlp draws its example batch before the model
    model = ResidualMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD["lr"])
    for got, batch in zip(printed, mlp_batches(), strict=True):
        optimizer.zero_grad()
        loss = F.mse_loss(model(batch["x"]), batch["targets"])
        loss.backward()
        optimizer.step()
        assert abs(got - loss.item()) <= 1e-6 * loss.item()
    with pytest.raises(HetccError, match="runtime_models has no function 'nothing'"):
        launch.main([str(tmp_path), "--steps", "1", "--data", "runtime_models:nothing"])


def test_launch_outside_torchrun_or_with_a_bad_step_count_is_one_clear_error(tmp_path, monkeypatch):
    _saved_mlp(tmp_path, 1)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(HetccError, match="MASTER_ADDR and MASTER_PORT are not set: hetcc.launch runs in"):
        launch.main([str(tmp_path)])
    with pytest.raises(SystemExit):  # argparse's usage error, before anything starts
        launch.main([str(tmp_path), "--steps", "-1"])
