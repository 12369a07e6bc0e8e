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

ROOT = Path(__file__).resolve().parents[1]


def walkthrough_commands() -> list[str]:
    """The `hetcc ...` lines of the sh block under the README's "Command line walkthrough" heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Command line walkthrough", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("hetcc ")]


def _hetcc() -> list[str]:
    script = Path(sys.executable).parent / "hetcc"  # what `source .venv/bin/activate` puts on PATH
    return [str(script)] if script.exists() else [sys.executable, "-m", "hetcc.cli"]


def test_the_walkthrough_names_every_command_in_order():
    verbs = [shlex.split(line)[1] for line in walkthrough_commands()]
    assert verbs == ["compile", "explain", "simulate", "run", "report"]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_line_by_line(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # a checkout's layout, outputs kept in tmp
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
    losses = [float(line.split()[-1]) for line in outputs["run"].splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert (build / "report.html").exists()
    for name in ("simulated", "measured"):
        trace = json.loads((build / f"{name}.trace.json").read_text())
        kinds = {e["name"][0] for e in trace["traceEvents"] if e["ph"] == "X"}
        assert {"F", "B"} <= kinds, name
