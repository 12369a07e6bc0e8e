"""``hetcc replan`` from the command line: train on three devices, plan again for the two left, go on."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from hetcc.cli import main

pytestmark = pytest.mark.slow  # two multi-process runs

# Three Linear(256, 256) layers: with Adam each holds about 1 MiB (weights, gradients, two moments), so
# devices of 1.35 MiB usable need three stages and devices of 2.7 MiB two: the stage counts follow from
# memory, not from timings that could tip either way.
FACTORY = """
import torch

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(256, 256) for _ in range(3))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.c(torch.relu(self.b(torch.relu(self.a(x))))), y)

def factory():
    torch.manual_seed(0)
    return Regression(), {"x": torch.randn(8, 256), "y": torch.randn(8, 256)}
"""


def _cpus(path, count: int, memory: str):
    path.write_text(
        f"nodes:\n  - name: host\n    intra_link: {{kind: loopback, bandwidth: 5 GB/s}}\n"
        f"    devices: [{{type: cpu, count: {count}, memory: {memory}}}]\n"
    )
    return str(path)


def _losses(out: str) -> dict[int, float]:
    return {
        int(line.split()[1]): float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")
    }


def _stdout():
    """What ``main`` prints, outside a test's capsys (a module-scoped fixture has none)."""
    return contextlib.redirect_stdout(io.StringIO())


def _stages(folder) -> int:
    return len(json.loads((folder / "plan.json").read_text())["stages"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A three-stage build trained two steps with a checkpoint after each: (folder, model spec, losses)."""
    root = tmp_path_factory.mktemp("replan_cli")
    (root / "regression.py").write_text(FACTORY)
    model, three = f"{root / 'regression.py'}:factory", root / "three"
    assert main(["compile", model, "--cluster", _cpus(root / "three.yaml", 3, "1.5 MiB"), "--out", str(three),
                 "--microbatches", "4"]) == 0  # fmt: skip
    assert _stages(three) == 3
    with _stdout() as out:
        assert main(["run", str(three), "--steps", "2", "--checkpoint-every", "1"]) == 0
    return three, model, _losses(out.getvalue())


def test_replan_moves_a_three_stage_run_onto_two_devices_and_training_goes_on(trained, tmp_path, capsys):
    three, model, first = trained
    assert sorted(first) == [0, 1]
    two = tmp_path / "two"
    assert main(["replan", str(three), "--model", model, "--cluster", _cpus(tmp_path / "two.yaml", 2, "3 MiB"),
                 "--out", str(two)]) == 0  # fmt: skip
    assert _stages(two) == 2 and f"hetcc run {two} --resume" in capsys.readouterr().out
    assert main(["run", str(two), "--steps", "2", "--resume"]) == 0
    second = _losses(capsys.readouterr().out)
    assert sorted(second) == [2, 3] and all(math.isfinite(loss) for loss in second.values())
    assert second[2] < first[0]  # it went on from the trained weights, not from the start


def test_replan_with_a_cluster_file_that_does_not_exist_names_it(trained, tmp_path, capsys):
    three, model, _ = trained
    missing = tmp_path / "gone.yaml"
    code = main(
        ["replan", str(three), "--model", model, "--cluster", str(missing), "--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hetcc: error: ")
    assert f"{missing}: cannot read the cluster file" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
