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
    assert "predicted step" in capsys.readouterr().out


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
