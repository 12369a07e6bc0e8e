"""Fuzzing every kind of input hetcc reads: each one is either accepted or refused with a HetccError
(on the command line: a non-zero exit and no traceback). Run with ``-s`` for the tally of what was tried
and what escaped (tests/untrusted.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import random

import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from untrusted import (
    CLUSTERS,
    ESCAPED,
    JSON_VALUES,
    copy_folder,
    mutate,
    outcome,
    read_json,
    save_folders,
    summary,
    write_json,
)

import hetcc
from hetcc.cli import main
from hetcc.hardware.calibration import Calibration
from hetcc.plan import Plan
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.placement import torchrun_commands
from hetcc.runtime.store import load_inputs, load_pipeline, read_outline
from hetcc.solver.problem import PartitionProblem

# HETCC_FUZZ_EXAMPLES=500 explores further with fresh random examples; the suite's run is fixed and short.
EXAMPLES = int(os.environ.get("HETCC_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=EXAMPLES or 60, deadline=None, suppress_health_check=list(HealthCheck),
                derandomize=not EXAMPLES)  # fmt: skip
FEW = settings(FUZZ, max_examples=EXAMPLES or 40)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_folders(tmp_path_factory.mktemp("fuzz-saved"))


@pytest.fixture(scope="module", autouse=True)
def tally():
    yield
    print("\n" + summary())


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-scratch")


def _assert_no_escape(kind: str, error: BaseException | None, what: object) -> None:
    assert error is None, f"{kind}: {type(error).__name__}: {error} for {str(what)[:300]}"


# ---- cluster and calibration files ------------------------------------------------------------------
VALID_CLUSTERS = [yaml.safe_load(p.read_text()) for p in sorted(CLUSTERS.glob("*.yaml"))]


@FUZZ
@given(data=st.data(), index=st.integers(0, len(VALID_CLUSTERS) - 1), as_json=st.booleans())
def test_mutated_cluster_files(scratch, data, index, as_json):
    spec = mutate(data, VALID_CLUSTERS[index], rounds=3)
    path = scratch / ("cluster.json" if as_json else "cluster.yaml")
    try:
        path.write_text(json.dumps(spec) if as_json else yaml.safe_dump(spec))
    except (ValueError, OverflowError):  # a value JSON/YAML cannot write (e.g. a lone surrogate)
        return
    _assert_no_escape("cluster file", outcome("cluster file", lambda: hetcc.Cluster.from_file(path)), spec)


@FUZZ
@given(
    text=st.text(alphabet=st.sampled_from(list("ab:- []{}&*!|>'\"#\n\t,.0123456789e%@`?\\")), max_size=120)
)
def test_random_yaml_text(scratch, text):
    path = scratch / "random.yaml"
    path.write_text(text)
    _assert_no_escape("random YAML", outcome("random YAML", lambda: hetcc.Cluster.from_file(path)), text)


@FUZZ
@given(raw=st.binary(max_size=200), suffix=st.sampled_from([".yaml", ".json"]))
def test_random_bytes_as_cluster_and_calibration_files(scratch, raw, suffix):
    path = scratch / f"bytes{suffix}"
    path.write_bytes(raw)
    for kind, read in (("random bytes", hetcc.Cluster.from_file), ("calibration bytes", Calibration.load)):
        _assert_no_escape(kind, outcome(kind, lambda read=read: read(path)), raw)


VALID_CALIBRATION = {
    "version": 1, "device_type": "cpu", "device_name": "x", "host": "h", "torch_version": "2", "threads": 2,
    "date": "2026-11-30", "matmul_flops": {"fp32": 1.2e11}, "memory_bandwidth_bps": "10 GB/s",
    "kernel_overhead_s": "4 us",
}  # fmt: skip


@FUZZ
@given(data=st.data())
def test_mutated_calibration_files(scratch, data):
    document = mutate(data, VALID_CALIBRATION, rounds=3)
    path = scratch / "calibration.json"
    path.write_text(json.dumps(document))
    error = outcome("calibration file", lambda: Calibration.load(path))
    _assert_no_escape("calibration file", error, document)
    cluster = {"nodes": [{"name": "n", "devices": [{"type": "cpu"}]}], "calibration": str(path)}
    error = outcome("cluster naming a calibration", lambda: hetcc.Cluster.from_spec(cluster))
    _assert_no_escape("cluster naming a calibration", error, document)


# ---- saved folders --------------------------------------------------------------------------------
@FUZZ
@given(data=st.data(), which=st.sampled_from(["compiled", "split", "layers"]))
def test_mutated_pipeline_json(folders, scratch, data, which):
    folder = copy_folder(folders[which], scratch / "pipeline")
    write_json(folder / "pipeline.json", mutate(data, read_json(folder / "pipeline.json"), rounds=2))
    _assert_no_escape("pipeline.json", outcome("pipeline.json", lambda: load_pipeline(str(folder))), which)


@FUZZ
@given(data=st.data(), which=st.sampled_from(["compiled", "split", "layers"]))
def test_mutated_stage_graphs(folders, scratch, data, which):
    folder = copy_folder(folders[which], scratch / "graph")
    path = random.Random(data.draw(st.integers(0, 9))).choice(sorted(folder.glob("stage*.graph.json")))
    write_json(path, mutate(data, read_json(path), rounds=2))
    _assert_no_escape("stage graph", outcome("stage graph", lambda: load_pipeline(str(folder))), path.name)


@FUZZ
@given(data=st.data())
def test_mutated_fusion_groups(folders, scratch, data):
    folder = copy_folder(folders["compiled"], scratch / "kernels")
    (path,) = (folder / "kernels").glob("*.json")
    write_json(path, mutate(data, read_json(path), rounds=2))
    _assert_no_escape("fusion group", outcome("fusion group", lambda: load_pipeline(str(folder))), path.name)


@FUZZ
@given(
    data=st.data(),
    which=st.sampled_from(["compiled", "split", "layers"]),
    action=st.sampled_from(["truncate", "flip", "overwrite", "header", "empty"]),
)
def test_corrupted_weights(folders, scratch, data, which, action):
    folder = copy_folder(folders[which], scratch / "weights")
    if data.draw(st.booleans()):  # without checksums the damage reaches the structural checks
        document = read_json(folder / "pipeline.json")
        write_json(folder / "pipeline.json", document | {"stages": [
            {k: v for k, v in s.items() if k != "weights_sha256"} for s in document["stages"]]})  # fmt: skip
    files = sorted(folder.glob("*.safetensors"))
    path = files[data.draw(st.integers(0, len(files) - 1))]
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    if action == "truncate":
        raw = raw[:at]
    elif action == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "overwrite":
        raw[at : at + 64] = data.draw(st.binary(min_size=1, max_size=64))
    elif action == "header":
        raw[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    read = (lambda: load_inputs(str(folder))) if path.name == "inputs.safetensors" else None
    read = read or (lambda: load_pipeline(str(folder)))
    _assert_no_escape("weights file", outcome("weights file", read), (path.name, action, at))


# ---- the pipeline meta (hetcc.runtime.contract): refused, or whole --------------------------------------
def _as_version_1(meta: dict, num_stages: int) -> dict:
    """The meta as hetcc wrote it before the record (version 1): each stage's vendor beside the placement."""
    old = {k: v for k, v in meta.items() if k not in ("plan_space", "loss_scale", "state_dict")}
    return old | {"vendors": ["cpu"] * num_stages}


def _check_whole(meta, num_stages: int) -> None:
    """What every reader of an accepted record relies on: one entry per stage, rank and microbatch, ranks in
    order, each stage's replicas 0..R-1, no negative count or size, and the runtime's views work."""
    assert meta.num_stages == num_stages and [p.rank for p in meta.placement] == list(
        range(len(meta.placement))
    )
    replicas = [sorted(p.replica for p in meta.placement if p.stage == k) for k in range(num_stages)]
    assert all(r == list(range(len(r))) and r for r in replicas)
    assert sum(map(len, replicas)) == len(meta.placement) and len(meta.recompute) == num_stages
    assert len(meta.routing) == num_stages
    assert all(len(row) == meta.microbatches and all(0 <= r < len(replicas[k]) for r in row)
               for k, row in enumerate(meta.routing))  # fmt: skip
    assert all(p.memory_bytes >= 0 and (p.local_index or 0) >= 0 for p in meta.placement)
    layout = RankLayout.from_meta(meta)
    for rank in range(layout.num_ranks):
        layout.actions(meta.schedule, rank, training=meta.training)
    if meta.placement[0].node_rank is not None:
        torchrun_commands(meta.placement, "build", "10.0.0.1:29500")


@FUZZ
@given(data=st.data(), which=st.sampled_from(["compiled", "split"]), version=st.sampled_from([1, 2]))
def test_mutated_pipeline_meta(folders, scratch, data, which, version):
    """pipeline.json's meta mutated, in this format and the previous one: every folder is refused with a
    HetccError or read into a record that is whole (a failed check of ``_check_whole`` escapes)."""
    folder = copy_folder(folders[which], scratch / "meta")
    document = read_json(folder / "pipeline.json")
    meta = document["meta"] if version == 2 else _as_version_1(document["meta"], document["num_stages"])
    document.update(version=version, meta=mutate(data, meta, rounds=3))
    write_json(folder / "pipeline.json", document)
    read = lambda: _check_whole(read_outline(str(folder)).meta, document["num_stages"])  # noqa: E731
    _assert_no_escape("pipeline meta", outcome("pipeline meta", read), document["meta"])


@FUZZ
@given(data=st.data())
def test_mutated_placement_json(folders, scratch, data):
    """A folder with only a plan: ``hetcc launch`` prints its torchrun commands from placement.json."""
    from hetcc.launch import node_commands

    folder = copy_folder(folders["compiled"], scratch / "placement")
    (folder / "pipeline.json").unlink()
    write_json(folder / "placement.json", mutate(data, read_json(folder / "placement.json"), rounds=2))
    run = lambda: node_commands(str(folder), "10.0.0.1:29500", [])  # noqa: E731
    _assert_no_escape("placement.json", outcome("placement.json", run), read_json(folder / "placement.json"))


# ---- plan and problem JSON (hetcc.plan and hetcc.solver.problem) ----------------------------------------
@FUZZ
@given(data=st.data())
def test_an_accepted_plan_has_no_negative_or_infinite_figure(folders, data):
    """plan.json mutated: refused, or every time, FLOP count and byte count is a finite number >= 0 (a
    negative size was once accepted and printed by ``hetcc explain`` and the report)."""
    document = mutate(data, read_json(folders["compiled"] / "plan.json"), rounds=2)

    def read():
        for stage in Plan.from_json(json.dumps(document)).stages:
            figures = [
                getattr(stage, f.name) for f in dataclasses.fields(stage) if f.type in ("float", "int")
            ]
            figures += list(dataclasses.asdict(stage.memory).values())
            assert all(math.isfinite(v) and v >= 0 for v in figures), stage

    _assert_no_escape("plan figures", outcome("plan figures", read), document)


@FUZZ
@given(data=st.data(), which=st.sampled_from(["plan.json", "problem.json"]))
def test_mutated_plan_and_problem_json(folders, data, which):
    document = mutate(data, read_json(folders["compiled"] / which), rounds=2)
    read = Plan.from_json if which == "plan.json" else PartitionProblem.from_json
    outcome(
        which, lambda: read(json.dumps(document))
    )  # escapes fail test_nothing_escaped_the_plan_problem_export_and_report_readers


# ---- readers owned elsewhere: hetcc.export (train/export.py) and the report (report/data.py) ------
@FUZZ
@given(data=st.data(), which=st.sampled_from(["pipeline.json", "stage0.safetensors", "plan.json"]))
def test_export_and_report_of_tampered_folders(folders, scratch, data, which):
    from hetcc.report import load
    from hetcc.train.export import export

    folder = copy_folder(folders["compiled"], scratch / "export")
    if which.endswith(".json"):
        write_json(folder / which, mutate(data, read_json(folder / which), rounds=2))
    else:
        raw = (folder / which).read_bytes()
        (folder / which).write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    outcome("export", lambda: export(folder))  # escapes are reported by the test below
    outcome("report", lambda: load(folder))


def test_nothing_escaped_the_plan_problem_export_and_report_readers():
    """The fuzz tests above record what plan.json / problem.json readers, ``hetcc.export`` and the report
    loader let through as a non-HetccError; runs after them (file order)."""
    kinds = ("plan.json", "problem.json", "export", "report")
    escaped = {kind: ESCAPED[kind] for kind in kinds if ESCAPED[kind]}
    assert not escaped, f"escaped: { {k: (len(v), v[:2]) for k, v in escaped.items()} }"


# ---- API arguments ---------------------------------------------------------------------------------------
MODEL = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
ODD_VALUES = JSON_VALUES | st.sampled_from(
    [torch.randn(0, 4), torch.randn(3, 4), torch.tensor(1.0), lambda x: x, object(), b"bytes", -1.5, 2**70]
)


@FEW
@given(
    argument=st.sampled_from(["example_inputs", "example_kwargs", "training", "optimizer", "schedule", "dump_dir",
                              "cluster", "model"]),
    value=ODD_VALUES,
)  # fmt: skip
def test_odd_compile_arguments(scratch, argument, value):
    arguments = {"model": MODEL, "cluster": CLUSTERS / "cpu4.yaml", "example_inputs": (torch.randn(4, 4),),
                 "microbatches": 2, "dump_dir": None} | {argument: value}  # fmt: skip
    if argument == "dump_dir" and isinstance(value, str):
        arguments["dump_dir"] = scratch / "dump" / value.replace("/", "_")[:20] if value else value
    _assert_no_escape(
        "compile argument", outcome("compile argument", lambda: hetcc.compile(**arguments)), value
    )


@FEW
@given(
    argument=st.sampled_from(["compiled_or_dir", "inputs", "targets", "loss_fn", "steps", "optimizer"]),
    value=ODD_VALUES,
)
def test_odd_run_local_arguments(folders, scratch, argument, value):
    """Every odd value is refused before a process starts (a valid one would start them: skipped)."""
    arguments = {"compiled_or_dir": folders["compiled"], "inputs": {"x": torch.randn(4, 4)}, "steps": 1}
    arguments[argument] = value
    if argument == "compiled_or_dir" and isinstance(value, str):
        arguments[argument] = scratch / "no-folder" / value.replace("/", "_")[:20]
    from hetcc import api

    checked = outcome("run_local argument", lambda: api.checks.check_run_args(**{k: v for k, v in (
        {"loss_fn": None, "targets": None, "optimizer": None} | arguments).items()}))  # fmt: skip
    _assert_no_escape("run_local argument", checked, value)


# ---- the command line ----------------------------------------------------------------------------------
@FUZZ
@given(data=st.data(), command=st.sampled_from(["explain", "simulate", "run", "report"]))
def test_cli_commands_on_tampered_folders(folders, scratch, data, command, monkeypatch_module):
    folder = copy_folder(folders["compiled"], scratch / "cli")
    name = data.draw(st.sampled_from(["plan.json", "problem.json", "pipeline.json"]))
    write_json(folder / name, mutate(data, read_json(folder / name), rounds=2))
    argv = [command, str(folder)] + (["--steps", "0"] if command == "run" else [])
    _run_cli("CLI command", argv)


@FUZZ
@given(
    argv=st.lists(
        st.sampled_from(["compile", "explain", "simulate", "run", "report", "calibrate", "--out", "--cluster",
                         "--steps", "-1", "x", "untrusted:FusedMLP", "untrusted:nothing", "/dev/null",
                         "--microbatches", "0", "--schedule", "zigzag", "nowhere.yaml", "README.md", "\0"]),
        max_size=6,
    )
)  # fmt: skip
def test_cli_random_arguments(argv, monkeypatch_module):
    if "calibrate" in argv[:1] and "--out" not in argv:  # would measure this machine: slow, not a bad input
        return
    _run_cli("CLI arguments", argv)


def _run_cli(kind: str, argv: list[str]) -> None:
    err = io.StringIO()
    codes = []

    def run():
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                codes.append(main(argv))
            except SystemExit as exit_:  # argparse's usage errors
                codes.append(exit_.code)

    _assert_no_escape(kind, outcome(kind, run, accept=()), argv)
    if "Traceback" in err.getvalue():
        ESCAPED[kind].append(f"traceback for {argv}")
    assert "Traceback" not in err.getvalue(), (argv, err.getvalue())


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("HETCC_DEBUG", raising=False)
        patch.setattr("hetcc.hardware.measure.calibrate", _no_measuring)
        yield patch


def _no_measuring(*args, **kwargs):
    raise hetcc.HetccError("measuring is not fuzzed")


# ---- values passed in Python rather than read from a file ---------------------------------------------
@FUZZ
@given(
    table=JSON_VALUES, field=st.sampled_from(["matmul_flops", "memory_bandwidth_bps", "host_op_s", "threads"])
)
@example(table={"": 10**400}, field="matmul_flops")  # an int no float holds: found by a 300-example run
@example(table=10**400, field="memory_bandwidth_bps")
def test_odd_calibration_and_device_type_values(table, field):
    """A record converts a value only after it is checked: each odd one is a ClusterError naming it."""
    from hetcc.hardware.presets import DeviceType

    arguments = {"device_type": "cpu", "matmul_flops": {"fp32": 1e11}, "memory_bandwidth_bps": 2e10,
                 "kernel_overhead_s": 1e-5, field: table}  # fmt: skip
    _assert_no_escape(
        "Calibration value", outcome("Calibration value", lambda: Calibration(**arguments)), table
    )
    made = outcome("DeviceType value", lambda: DeviceType("t", "nvidia", table, 2**30, 1e12))
    _assert_no_escape("DeviceType value", made, table)


@FEW
@given(path=JSON_VALUES)
def test_a_cluster_file_that_is_not_a_path(path):
    _assert_no_escape("cluster path", outcome("cluster path", lambda: hetcc.Cluster.from_file(path)), path)


def test_saving_onto_a_file_or_an_unwritable_place_is_a_hetcc_error(tmp_path):
    from untrusted import FusedMLP

    compiled = hetcc.compile(FusedMLP(), CLUSTERS / "cpu4.yaml", (torch.randn(4, 4),), microbatches=2)
    a_file = tmp_path / "taken"
    a_file.write_text("the user's")
    unwritable = "/proc/hetcc-build"  # not even root can make a folder there (a read-only mount would do)
    for place in (a_file, a_file / "below", unwritable, "nul\0"):
        with pytest.raises(hetcc.HetccError, match="build folder"):
            compiled.save(place)
    assert a_file.read_text() == "the user's"
