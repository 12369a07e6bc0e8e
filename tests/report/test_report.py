"""report.html and Chrome-trace timelines, read from the folder ``hetcc compile`` writes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import hetcc
from hetcc.errors import PlanFormatError
from hetcc.report import REPORT_FILE, load, measured_trace, render, simulated_trace, write_report
from hetcc.runtime.executor import StepResult
from hetcc.runtime.recorder import TRACE_DIR_ENV, ActionRecorder

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"
SECTIONS = ("Summary", "Step time against the lower bound", "Cluster", "Block chain and cuts", "Stages",
            "Per-stage time against each baseline", "Memory per device", "Simulated schedule")  # fmt: skip


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A tiny GPT-2 planned (meta device) over the mixed NVIDIA/AMD cluster, dumped to a folder."""
    from models import tiny_gpt2_factory

    folder = tmp_path_factory.mktemp("dump")
    model, kwargs = tiny_gpt2_factory()
    hetcc.compile(
        model, CLUSTERS / "mixed_nvidia_amd.yaml", example_kwargs=kwargs, microbatches=4, dump_dir=folder
    )
    return folder


def test_compile_writes_the_report_and_the_cluster_into_the_dump_folder(dump):
    assert (dump / REPORT_FILE).exists() and (dump / "cluster.json").exists()
    spec = json.loads((dump / "cluster.json").read_text())
    assert hetcc.Cluster.from_spec(spec) == hetcc.Cluster.from_file(CLUSTERS / "mixed_nvidia_amd.yaml")


def test_the_report_is_one_self_contained_page_with_every_section(dump):
    page = (dump / REPORT_FILE).read_text()
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page
    for remote in ("<script", "<link", " src=", "url(", "@import"):  # nothing fetched, nothing run
        assert remote not in page
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert len(svgs) == 6
    for picture in svgs:
        ET.fromstring(picture)  # well-formed XML


def test_the_report_marks_used_and_unused_devices_and_shows_the_schedule(dump):
    saved = load(dump)
    page = render(saved)
    used = saved.used_devices
    assert used and len(used) < len(saved.problem.devices)  # a tiny model leaves devices idle
    assert "unused" in page
    for device in used:
        assert f"{device} (" in page  # the device box names it with its type
    events = saved.simulation.events
    kinds = {e.kind for e in events}
    assert kinds >= {"F", "B"} and (len(saved.stages) == 1 or kinds >= {"SEND_F", "SEND_B"})
    assert page.count("<title>F0:") == len(saved.stages)  # every stage's first forward in the Gantt chart


def test_the_report_shows_replica_groups_recompute_and_precision_when_the_plan_has_them(dump, tmp_path):
    folder = tmp_path / "newer"
    shutil.copytree(dump, folder)
    plan = json.loads((folder / "plan.json").read_text())
    plan["precision"] = "bf16-mixed"
    for stage in plan["stages"]:
        shares = [plan["microbatches"] - 1, 1]
        stage.update(
            devices=[stage["device"], "replica-x"], shares=shares, recompute=True, precision="bf16-mixed"
        )
    (folder / "plan.json").write_text(json.dumps(plan))
    page = (write_report(folder)).read_text()
    assert "<th>recompute</th>" in page and "<th>precision</th>" in page and "replica-x" in page
    assert "precision<b>bf16-mixed</b>" in page


def test_a_folder_without_a_plan_names_the_file_and_the_command(tmp_path):
    with pytest.raises(PlanFormatError, match="(?s)plan.json does not exist.*hetcc compile"):
        write_report(tmp_path)


def test_the_simulated_trace_has_one_row_per_stage_in_microseconds(dump):
    saved = load(dump)
    trace = simulated_trace(saved.simulation, saved.rows)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(saved.simulation.events)
    assert {e["pid"] for e in spans} == set(range(len(saved.stages)))
    end_us = max(e["ts"] + e["dur"] for e in spans)
    assert end_us == pytest.approx(saved.simulation.step_time_s * 1e6)
    forwards = [e for e in spans if e["cat"] == "forward"]
    assert len(forwards) == len(saved.stages) * saved.problem.microbatches
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert names[0].startswith("stage 0 on ") and names[0].endswith("(simulated)")


def test_the_recorder_writes_nothing_unless_asked_and_its_files_merge_into_one_trace(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    off, timed = ActionRecorder(0), StepResult()
    with off.record("F", 0, timed):
        time.sleep(0.01)
    off.end_step()
    assert off.events == [] and not list(tmp_path.iterdir())
    assert timed.busy_s >= 0.01  # the step's busy time is added up whether or not the trace is on
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    for rank in range(2):
        recorder = ActionRecorder(rank)
        for kind in ("F", "B"):
            with recorder.record(kind, 0, StepResult()):
                pass
        recorder.end_step()
    trace = measured_trace(tmp_path, [(0, 0, "cpu-0"), (1, 0, "cpu-1")])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in spans) == [(0, "B0"), (0, "F0"), (1, "B0"), (1, "F0")]
    assert min(e["ts"] for e in spans) == 0.0
    recorder = ActionRecorder(0)  # interleaved: rank 0 runs stages 0 and 2; its chunk 1 is stage 2
    for chunk in (0, 1):
        with recorder.record("F", 3, StepResult(), chunk):
            pass
    recorder.end_step()
    trace = measured_trace(tmp_path, [((0, 2), 0, "cpu-0"), ((1, 3), 0, "cpu-1")])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "F3"]
    assert sorted(e["pid"] for e in spans) == [0, 2]
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert (2, "cpu-0 compute") in names and (3, "cpu-1 compute") in names


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _console_messages(page: Path) -> tuple[str, list[str]]:
    """The DOM headless Chromium rendered, and every console message the page produced."""
    done = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.browser
@pytest.mark.skipif(_chromium() is None, reason="no chromium binary (apt-get install chromium)")
def test_headless_chromium_renders_the_report_without_console_errors(dump, tmp_path):
    broken = tmp_path / "broken.html"  # the check itself sees a page's errors
    broken.write_text("<html><body><script>console.error('boom'); missing();</script></body></html>")
    assert len(_console_messages(broken)[1]) == 2
    dom, messages = _console_messages(dump / REPORT_FILE)
    assert messages == []
    assert dom.count("<svg") == 6 and "Simulated schedule" in dom


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda plan: plan["stages"][0].update(blocks=7), "stage 0's blocks must be a list"),
        (lambda plan: plan["stages"][0].update(devices=[1, 2]), "stage 0 names no devices"),
        (lambda plan: plan.update(stages=[]), "'stages': must be a non-empty list"),
        (lambda plan: plan["stages"][0].update(memory="lots"), "stage 0's memory must be a JSON object"),
        (lambda plan: plan["stages"][0]["memory"].update(grads_bytes=-1), r"stages\[0\].memory.grads_bytes"),
    ],
)
def test_an_edited_plan_is_a_plan_format_error_naming_the_field(dump, tmp_path, edit, message):
    folder = tmp_path / "edited"
    shutil.copytree(dump, folder)
    plan = json.loads((folder / "plan.json").read_text())
    edit(plan)
    (folder / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PlanFormatError, match=message):
        write_report(folder)


def test_every_bar_of_the_baseline_chart_names_its_stage_and_devices(dump):
    saved = load(dump)
    page = render(saved)
    chart = page.split("<h2>Per-stage time against each baseline</h2>", 1)[1].split("</svg>", 1)[0]
    bars = sum(len(solution.stages) for solution in saved.baselines.values()) + len(saved.stages)
    labels = re.findall(r">stage (\d+): ([^<]+)</text>", chart)
    assert len(labels) == bars  # one label per bar, hetcc's and each baseline's
    first = saved.stages[0].devices[0]
    assert labels[0][0] == "0" and labels[0][1].startswith(first)
    assert "bar: compute, in the stage&#x27;s colour; grey: cut transfers" in chart  # what the colours mean


def test_a_zero_bubble_schedules_weight_gradients_show_in_the_gantt_chart_and_the_trace():
    from types import SimpleNamespace

    from test_simulate import homogeneous

    from hetcc.report.charts import gantt_chart
    from hetcc.solver.simulate import simulate

    problem = homogeneous(3, 4, "zb-h1")
    problem.wgrad_s = {"t": [1.0] * 3}
    simulation = simulate(problem, [0, 1, 2, 3], [0, 1, 2])
    page = gantt_chart(SimpleNamespace(simulation=simulation, rows={}))
    assert "weight gradient" in page and "<title>W0:" in page
    trace = simulated_trace(simulation, {(k, 0): f"gpu{k}" for k in range(3)})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (
        sum(e["cat"] == "weight gradient" for e in spans) == 2 * 4
    )  # the split stages' W, one per microbatch
