"""The README's command-line walkthrough runs line by line, as a user types it, without an error."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

ROOT = Path(__file__).resolve().parents[1]


def walkthrough_commands() -> list[str]:
    """The `hetcc ...` lines of the sh block under the README's "Command line walkthrough" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Command line walkthrough", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("hetcc ")]


def _users_environ() -> dict[str, str]:
    """The environment without the suite's own fusion setting (conftest): the README runs the default."""
    return {k: v for k, v in os.environ.items() if k != "HETCC_FUSE"}


def _hetcc() -> list[str]:
    script = Path(sys.executable).parent / "hetcc"  # what `source .venv/bin/activate` puts on PATH
    return [str(script)] if script.exists() else [sys.executable, "-m", "hetcc.cli"]


def test_the_walkthrough_names_every_command_in_order():
    verbs = [shlex.split(line)[1] for line in walkthrough_commands()]
    assert verbs == ["compile", "explain", "simulate", "run", "report"]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_line_by_line(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # a checkout's layout, outputs kept in tmp
    env = {**_users_environ(), "PYTHONPATH": str(ROOT)}
    outputs = {}
    for line in walkthrough_commands():
        words = shlex.split(line)
        done = subprocess.run(_hetcc() + words[1:], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"`{line}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, line
        outputs[words[1]] = done.stdout
    build = tmp_path / "build" / "gpt2"
    assert "hetcc plan:" in outputs["explain"] and "simulated step" in outputs["simulate"]
    stages = json.loads((build / "plan.json").read_text())["stages"]
    assert len(stages) >= 2 and any(len(stage["devices"]) > 1 for stage in stages), outputs[
        "explain"
    ]  # a pipeline of groups
    losses = [float(line.split()[-1]) for line in outputs["run"].splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert (build / "report.html").exists()
    for name in ("simulated", "measured"):
        trace = json.loads((build / f"{name}.trace.json").read_text())
        kinds = {e["name"][0] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert {"F", "B"} <= kinds, name


def train_commands() -> list[str]:
    """The lines of the sh block under the README's "Train on your data" heading."""
    section = (ROOT / "README.md").read_text().split("## Train on your data", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("hetcc ")]


@pytest.mark.slow
def test_the_readme_trains_on_the_standard_library_resumes_and_exports(tmp_path):
    """As a user types them (a shell, the venv's bin on PATH, no Triton interpreter): the job trains,
    evaluates, resumes at step 200 and exports weights the model loads strictly."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in _users_environ().items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    printed = []
    for line in train_commands():
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert done.returncode == 0, f"`{line}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, line
        printed.append(done.stdout)
    first, resumed = printed[2], printed[3]
    losses = {int(w[1]): float(w[3]) for w in (ln.split() for ln in first.splitlines() + resumed.splitlines())
              if w[:1] == ["step"] and w[2:3] == ["loss"]}  # fmt: skip
    assert sorted(losses) == list(range(300))
    assert sum(losses[s] for s in range(290, 300)) / 10 < losses[0] - 1.5  # ln 256 = 5.5 falls below 4
    assert "eval after step 99: loss" in first and "eval after step 199: loss" in first
    assert "trained weights: build/lm/checkpoints" in first and "measured step" in first
    assert resumed.startswith("resumed at step 200 from build/lm/checkpoints")
    records = (tmp_path / "build/lm/checkpoints/metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == list(range(300))  # the resumed run appended
    sys.path.insert(0, str(ROOT))
    from examples.models import gpt2_bytes

    model, _ = gpt2_bytes()
    model.load_state_dict(safetensors.torch.load_file(tmp_path / "build/lm.safetensors"), strict=True)


@pytest.mark.slow
def test_the_demo_runs_and_its_pipeline_trains_like_eager(tmp_path):
    """``make demo``, the README's first command: it plans, re-splits a small copy on the big plan's
    stages, trains it on CPU processes and prints its losses beside eager PyTorch's."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], cwd=tmp_path,
                          env=_users_environ(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if re.fullmatch(r"\s*\d+\s+\S+\s+\S+\s*", line)]
    assert rows and all(float(ours) == pytest.approx(float(eager), rel=1e-5) for _, ours, eager in rows)
    assert "demo done" in done.stdout
