import subprocess
import sys
from pathlib import Path

import pytest

from hetcc.cli import main

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    cluster = CLUSTERS / "mixed_a100_t4.yaml"
    assert main(["compile", "models:tiny_gpt2_factory", "--cluster", str(cluster), "--out", str(out),
                 "--microbatches", "4"]) == 0  # fmt: skip
    return out


def test_compile_writes_the_plan_and_the_ir(build, capsys):
    assert (build / "plan.json").exists() and (build / "problem.json").exists()
    assert (build / "ir" / "04_blocks.txt").exists()


def test_explain_prints_the_plan_table(build, capsys):
    assert main(["explain", str(build)]) == 0
    assert "hetcc plan:" in capsys.readouterr().out


def test_simulate_replays_the_plan_and_prints_the_grid(build, capsys):
    assert main(["simulate", str(build)]) == 0
    out = capsys.readouterr().out
    assert "simulated step" in out and "F0" in out and "B0" in out


def test_errors_are_one_clear_line_and_exit_code_2(tmp_path, capsys):
    assert main(["explain", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetcc: error: ") and "plan.json does not exist" in err
    assert main(["compile", "no_colon", "--cluster", "x.yaml", "--out", str(tmp_path)]) == 2
    assert "pkg.module:factory" in capsys.readouterr().err


def test_calibrate_writes_a_file_a_cluster_can_name(tmp_path, capsys):
    out = tmp_path / "cpu.yaml"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    assert "written to" in capsys.readouterr().out
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(
        "calibration: cpu.yaml\nnodes:\n  - name: host\n    intra_link: {kind: loopback, bandwidth: 5 GB/s}\n"
        "    devices: [{type: cpu, count: 2}]\n"
    )
    from hetcc import Calibration, Cluster

    measured = Calibration.load(out)
    cpu = Cluster.from_file(cluster_file).devices[0].type
    assert cpu.achievable_flops("fp32") == pytest.approx(measured.matmul_flops["fp32"])


@pytest.mark.slow
def test_compile_with_weights_then_run_trains_from_the_folder(tmp_path, capsys):
    out = tmp_path / "build"
    assert main(["compile", "models:trainable_gpt2_factory", "--cluster", str(CLUSTERS / "cpu4.yaml"),
                 "--out", str(out), "--microbatches", "2", "--optimizer", "sgd"]) == 0  # fmt: skip
    assert (out / "stage0.py").exists() and (out / "inputs.safetensors").exists()
    capsys.readouterr()
    assert main(["run", str(out), "--steps", "2"]) == 0
    losses = [
        float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step")
    ]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


FACTORY_FILE = """
import torch

def factory():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), (torch.randn(8, 8),)

def broken():
    raise RuntimeError("no weights here")

def wrong():
    return torch.nn.Linear(2, 2)
"""


def test_compile_takes_a_factory_by_file_path_and_writes_the_report(tmp_path, capsys):
    (tmp_path / "heldout.py").write_text(FACTORY_FILE)
    out = tmp_path / "build"
    spec = f"{tmp_path / 'heldout.py'}:factory"
    assert main(["compile", spec, "--cluster", str(CLUSTERS / "cpu4.yaml"), "--out", str(out),
                 "--microbatches", "2"]) == 0  # fmt: skip
    assert (out / "report.html").exists() and (out / "stage0.py").exists()
    assert "report.html" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("broken", "raised RuntimeError: no weights here"),
        ("wrong", "returned Linear, not (model, example_inputs)"),
        ("missing", "has no function 'missing'"),
    ],
)
def test_a_factory_that_fails_is_one_error_line_not_a_traceback(tmp_path, capsys, attr, message):
    (tmp_path / "heldout.py").write_text(FACTORY_FILE)
    spec = f"{tmp_path / 'heldout.py'}:{attr}"
    assert (
        main(["compile", spec, "--cluster", str(CLUSTERS / "cpu4.yaml"), "--out", str(tmp_path / "b")]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("hetcc: error: ") and message in err and "Traceback" not in err


def test_a_missing_factory_file_is_named(tmp_path, capsys):
    spec = f"{tmp_path / 'nowhere.py'}:factory"
    assert main(["compile", spec, "--cluster", "x.yaml", "--out", str(tmp_path)]) == 2
    assert "nowhere.py does not exist" in capsys.readouterr().err


def test_every_option_of_every_command_has_help_text():
    from argparse import _HelpAction, _SubParsersAction

    from hetcc.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, _SubParsersAction))
    assert {"compile", "explain", "simulate", "run", "report", "calibrate"} <= set(commands.choices)
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if not isinstance(action, _HelpAction):
                assert action.help, f"hetcc {name} {action.option_strings or action.dest} has no help"


def test_simulate_writes_a_chrome_trace(build, tmp_path, capsys):
    import json

    trace = tmp_path / "sim.json"
    assert main(["simulate", str(build), "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["cat"] for e in events if e["ph"] == "X"} >= {"forward", "backward"}


def test_report_rewrites_the_page_from_the_folder(build, capsys):
    (build / "report.html").unlink()
    assert main(["report", str(build)]) == 0
    assert (build / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_run_on_a_plan_only_folder_says_which_factory_to_use(build, capsys):
    assert main(["run", str(build)]) == 2
    err = capsys.readouterr().err
    assert "holds a plan only" in err and "examples.models:gpt2_tiny" in err


def test_calibrate_prints_a_path_that_works_from_any_cluster_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--quick"]) == 0
    written = tmp_path / "build" / "calibration-cpu.yaml"
    assert written.exists() and not (tmp_path / "calibration.yaml").exists()
    hint = next(line for line in capsys.readouterr().out.splitlines() if "calibration: " in line)
    elsewhere = tmp_path / "clusters" / "deep"
    elsewhere.mkdir(parents=True)
    (elsewhere / "cluster.yaml").write_text(
        f"{hint.split('  ', 1)[1]}\nnodes:\n  - name: host\n    intra_link: {{kind: loopback, bandwidth: 5 GB/s}}\n"
        "    devices: [{type: cpu, count: 2}]\n"
    )
    from hetcc import Cluster

    Cluster.from_file(elsewhere / "cluster.yaml")  # the printed line resolves


def test_run_on_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    assert main(["run", str(tmp_path / "doesnotexist")]) == 2
    assert "doesnotexist does not exist or is not a folder" in capsys.readouterr().err


def test_help_errors_and_explain_start_without_importing_torch(build):
    """`hetcc --help`, an argument error, a missing folder and `hetcc explain` need no torch (it takes
    seconds to import on a loaded machine); each runs in a fresh interpreter that records what it loaded."""
    probe = (
        "import sys, hetcc.cli\n"
        "try:\n    code = hetcc.cli.main(sys.argv[1:])\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n"
    )
    for argv in (["--help"], ["compile"], ["run", "nowhere/"], ["explain", str(build)]):
        done = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120
        )
        assert done.stdout.splitlines()[-1].startswith("NO-TORCH"), (
            argv,
            done.stdout[-500:],
            done.stderr[-500:],
        )
