"""Every file hetcc reads and every argument it takes is checked before use: bad ones raise a HetccError
naming the file, field or argument, quickly, with a short message (issue 11, "trust no file")."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from untrusted import CLUSTERS, copy_folder, read_json, save_folders, write_json

import hetcc
from hetcc.cli import main
from hetcc.errors import ClusterError, HetccError, PlanFormatError
from hetcc.hardware.calibration import Calibration
from hetcc.runtime.files import file_sha256
from hetcc.runtime.store import load_inputs, load_pipeline, load_stage

VALID_NODE = "nodes:\n  - name: n\n    devices:\n      - {type: T4, count: 1}\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return save_folders(tmp_path_factory.mktemp("saved"))


def cluster_error(tmp_path, text: str | bytes, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ClusterError) as info:
        hetcc.Cluster.from_file(path)
    return str(info.value)


# ---- YAML / JSON parsing limits ----------------------------------------------------------------------
def _alias_bomb(levels: int, width: int) -> str:
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("levels", "width"), [(9, 9), (6, 8)])  # 460 and ~330 bytes
def test_yaml_alias_bombs_are_refused_at_once_with_a_short_message(tmp_path, levels, width):
    text = _alias_bomb(levels, width)
    assert len(text) < 500
    start = time.perf_counter()
    message = cluster_error(tmp_path, text)
    assert time.perf_counter() - start < 5  # generous: expanding it would take minutes or all memory
    assert "aliases (*name) are not allowed" in message and len(message) < 300


@pytest.mark.parametrize("name", ["deep.json", "deep.yaml"])
def test_nesting_50000_deep_is_an_error_not_a_recursion_error(tmp_path, name):
    assert "levels deep" in cluster_error(tmp_path, "[" * 50_000 + "]" * 50_000, name)


def test_non_utf8_huge_and_nul_paths_name_the_file(tmp_path):
    assert "is not UTF-8 text" in cluster_error(tmp_path, b"nodes: \xff\xfe\n")
    big = cluster_error(tmp_path, "#" * (5 * 2**20))
    assert "larger than" in big and "c.yaml" in big
    with pytest.raises(ClusterError, match="not a file path"):
        hetcc.Cluster.from_file(str(tmp_path / "a\0.yaml"))
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(ClusterError, match="folder.yaml: cannot read the cluster file"):
        hetcc.Cluster.from_file(tmp_path / "folder.yaml")
    calibration = tmp_path / "cal.json"
    calibration.write_bytes(b"\x80{}")
    with pytest.raises(ClusterError, match="cal.json: the calibration file is not UTF-8"):
        Calibration.load(calibration)


def test_integers_beyond_4300_digits_are_an_error(tmp_path):
    assert "cannot read the cluster file" in cluster_error(tmp_path, "name: " + "9" * 5000 + "\n")


# ---- quantities and counts -----------------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["1e400", str(10**400), "-5", ".nan", "-1 GiB", "'1e400 GB'"])
def test_quantities_out_of_range_are_cluster_errors(tmp_path, memory):
    text = f"nodes:\n  - name: n\n    devices:\n      - {{type: T4, memory: {memory}}}\n"
    assert "devices[0].memory" in cluster_error(tmp_path, text)


@pytest.mark.parametrize("field", ["matmul_efficiency: .nan", f"kernel_overhead: {10**400}", "count: -3"])
def test_fractions_durations_and_counts_out_of_range(tmp_path, field):
    text = f"nodes:\n  - name: n\n    devices:\n      - {{type: T4, {field}}}\n"
    assert f"devices[0].{field.split(':')[0]}" in cluster_error(tmp_path, text)


def test_a_million_devices_are_refused_quickly(tmp_path):
    start = time.perf_counter()
    message = cluster_error(tmp_path, VALID_NODE.replace("count: 1", "count: 1000000"))
    assert time.perf_counter() - start < 5 and "at most 1024" in message


def test_many_small_entries_adding_up_past_the_limit(tmp_path):
    devices = "".join("      - {type: T4, count: 600}\n" for _ in range(2))
    text = "nodes:\n  - name: n\n    intra_link: {kind: pcie, bandwidth: 32 GB/s}\n    devices:\n" + devices
    assert "more than 1024 devices" in cluster_error(tmp_path, text)


def test_a_huge_value_is_abbreviated_in_the_message(tmp_path):
    text = "nodes:\n  - name: n\n    devices:\n      - {type: [" + ", ".join(["x" * 50] * 2000) + "]}\n"
    assert len(cluster_error(tmp_path, text)) < 500


# ---- saved folders -------------------------------------------------------------------------------------
def _tampered(folders, tmp_path, which: str = "split"):
    return copy_folder(folders[which], tmp_path / which)


def _edit_pipeline(folder, change) -> None:
    document = read_json(folder / "pipeline.json")
    change(document)
    write_json(folder / "pipeline.json", document)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.clear() or d.update({"format": "hetcc-pipeline", "version": 1}), "missing required key"),
        (lambda d: d.update(num_stages=5), "num_stages: 5 stages, but the stages list has 3"),
        (lambda d: d.update(num_stages="3"), "num_stages: expected a positive integer"),
        (lambda d: d["stages"][1].update(graph="../../outside.graph.json"), "leads outside the folder"),
        (lambda d: d["stages"][1].update(graph="/etc/passwd"), "leads outside the folder"),
        (lambda d: d["stages"][1].update(weights="a\0b"), "not a file path"),
        (lambda d: d["stages"][1].update(index=7), "stages[1].index: stage 1 of the list says it is stage 7"),
        (lambda d: d["stages"][1].pop("recvs"), "stages[1]: missing required key 'recvs'"),
        (lambda d: d["stages"][1].update(training="no"), "stages[1].training: expected true or false"),
        (lambda d: d["stages"][1]["recvs"][0].update(src=9), "stages[1].recvs[0]: edge 9 -> 1"),
        (lambda d: d["stages"][1]["recvs"][0].update(shape={"a": 1}), "recvs[0].shape: expected a list"),
        (lambda d: d["stages"][1]["recvs"][0].update(dtype="__class__"), "unknown dtype"),
        (lambda d: d["stages"].__setitem__(0, [1, 2]), "stages[0]: expected a mapping"),
        (lambda d: d["meta"].update(schedule="zigzag"), "meta.schedule: unknown schedule"),
    ],
)
def test_a_tampered_pipeline_json_names_the_file_and_the_field(folders, tmp_path, change, message):
    folder = _tampered(folders, tmp_path)
    _edit_pipeline(folder, change)
    with pytest.raises(PlanFormatError, match="pipeline.json") as info:
        load_pipeline(str(folder))
    assert message in str(info.value)


@pytest.mark.parametrize("document", [[], "x", 3, None])
def test_pipeline_json_of_the_wrong_type(folders, tmp_path, document):
    folder = _tampered(folders, tmp_path)
    write_json(folder / "pipeline.json", document)
    with pytest.raises(PlanFormatError, match="not a hetcc-pipeline v1 or v2 file"):
        load_pipeline(str(folder))


# ---- the pipeline meta: the compiler -> runtime record (hetcc.runtime.contract) -----------------------
def _two_ranks(d) -> list:
    return d["meta"]["placement"]


@pytest.mark.parametrize(
    ("change", "message"),
    [  # the compiled folder: one stage on two replicas (ranks 0 and 1), two microbatches routed 0, 1
        (lambda d: _two_ranks(d).pop(), "meta.routing[0]: names a replica outside 0..0"),
        (lambda d: d["meta"]["routing"][0].pop(), "meta.routing[0]: 1 entries; expected one per microbatch (2)"),
        (lambda d: d["meta"]["routing"].append([0, 0]), "meta.routing: 2 entries for 1 stages"),
        (lambda d: d["meta"].update(recompute=[]), "meta.recompute: expected a non-empty list"),
        (lambda d: d["meta"].update(recompute=[False, True]), "meta.recompute: 2 entries for 1 stages"),
        (lambda d: _two_ranks(d)[1].update(rank=5), "meta.placement[1].rank: rank 5 at position 1, but ranks are in order"),
        (lambda d: _two_ranks(d)[1].update(stage=1), "meta.placement[1].stage: stage 1 of a 1-stage"),
        (lambda d: _two_ranks(d)[1].update(replica=0), "meta.placement: stage 0 has replicas [0, 0]"),
        (lambda d: _two_ranks(d)[1].update(memory_bytes=-1), "placement[1].memory_bytes: expected an integer >= 0"),
        (lambda d: _two_ranks(d)[1].update(local_rank=0), "two ranks share one node rank and local rank"),
        (lambda d: _two_ranks(d)[1].update(node_rank=None), "placement[1]: no node_rank or local_rank"),
        (lambda d: d["meta"].update(loss_scale={"init_scale": -1}), "loss_scale.init_scale: expected a finite"),
        (lambda d: d["meta"].update(loss_scale={"backoff_factor": 2}), "loss_scale.backoff_factor: expected a"),
        (lambda d: d["meta"].update(microbatches=0), "meta.microbatches: expected a positive integer"),
        (lambda d: _two_ranks(d)[0].update(chunks=[0, 4]), "meta.placement[0].chunks: stages [0, 4]; expected distinct"),
        (lambda d: _two_ranks(d)[0].update(chunks="01"), "meta.placement[0].chunks: expected a list"),
        (lambda d: d["meta"].update(schedule="interleaved-1f1b"), "meta.placement[0]: rank 0 runs stages [0] as replica 0; interleaved-1f1b over 1 positions"),
        (lambda d: d["meta"].update(precision="bf16"), "meta.precision: unknown precision 'bf16'"),
        (lambda d: d["meta"].update(plan_space={"recompute": "sometimes"}), "meta.plan_space.recompute"),
        (lambda d: d["meta"].update(vendors=["cpu"]), "meta.vendors: unknown key"),  # a version-1 key
        (lambda d: d["meta"].pop("routing"), "meta: missing required key 'routing'"),  # written by every v2
        (lambda d: d.pop("meta"), "missing required key 'meta'"),
    ],
)  # fmt: skip
def test_a_pipeline_meta_that_disagrees_with_itself_is_refused_naming_the_field(
    folders, tmp_path, change, message
):
    """Every list of the record has one entry per stage, rank or microbatch, every count and size is a
    number >= 0, and each says which field is wrong and to compile again, before any rank starts."""
    folder = _tampered(folders, tmp_path, "compiled")
    _edit_pipeline(folder, change)
    with pytest.raises(PlanFormatError, match="pipeline.json") as info:
        hetcc.run_local(str(folder), {"x": torch.randn(4, 4)})
    assert message in str(info.value)
    assert "hint: " in str(info.value)


def _as_version_1(document: dict, **meta) -> None:
    """What hetcc wrote before the record: version 1, each stage's vendor beside the placement, no
    plan space, loss scale or routing when they had their defaults."""
    old = {k: v for k, v in document["meta"].items() if k not in ("plan_space", "loss_scale", "state_dict")}
    document.update(version=1, meta={**old, "vendors": ["cpu"] * document["num_stages"], **meta})


def test_a_folder_of_the_previous_format_loads_with_the_defaults_it_was_written_for(folders, tmp_path):
    from hetcc.runtime.contract import PlanSpace
    from hetcc.runtime.store import pipeline_meta

    folder = _tampered(folders, tmp_path, "compiled")
    new = pipeline_meta(str(folder))
    _edit_pipeline(folder, _as_version_1)
    old = pipeline_meta(str(folder))
    assert old.placement == new.placement and old.routing == new.routing and old.inputs == new.inputs
    assert old.plan_space == PlanSpace() and old.loss_scale == {} and old.state_dict is None
    split = _tampered(folders, tmp_path, "split")  # three stages, saved without a meta: one CPU rank each
    _edit_pipeline(split, lambda d: d.update(version=1, meta={"vendors": ["cpu", "nvidia", "cpu"]}))
    meta = pipeline_meta(str(split))
    assert [(p.rank, p.stage, p.vendor) for p in meta.placement] == [
        (0, 0, "cpu"),
        (1, 1, "nvidia"),
        (2, 2, "cpu"),
    ]
    assert meta.routing == ((0,), (0,), (0,)) and meta.recompute == (False,) * 3 and meta.precision == "fp32"


@pytest.mark.parametrize(
    ("which", "change", "message"),
    [
        ("split", lambda d: d.update(version=1, meta={"vendors": ["cpu"]}), "meta.vendors: 1 vendors for 3 stages"),
        ("compiled", lambda d: _as_version_1(d, vendors=["nvidia"]),
         "meta.vendors[0]: stage 0 on 'nvidia', but placement[0] (its first rank) says 'cpu'"),
        ("compiled", lambda d: _as_version_1(d, routing=[[0, 1, 1]]), "meta.routing[0]: 3 entries"),
        ("split", lambda d: d.update(version=3), "not a hetcc-pipeline v1 or v2 file"),
        ("split", lambda d: d.update(version=0), "not a hetcc-pipeline v1 or v2 file"),
    ],
)  # fmt: skip
def test_a_folder_of_another_format_is_refused_saying_to_compile_again(
    folders, tmp_path, which, change, message
):
    folder = _tampered(folders, tmp_path, which)
    _edit_pipeline(folder, change)
    with pytest.raises(PlanFormatError, match="pipeline.json") as info:
        load_pipeline(str(folder))
    assert message in str(info.value) and "compile the model again" in str(info.value)


def test_a_link_out_of_the_folder_is_refused(folders, tmp_path):
    folder = _tampered(folders, tmp_path)
    outside = tmp_path / "elsewhere.graph.json"
    outside.write_text((folder / "stage1.graph.json").read_text())
    (folder / "stage1.graph.json").unlink()
    (folder / "stage1.graph.json").symlink_to(outside)
    with pytest.raises(PlanFormatError, match="leads outside the folder"):
        load_pipeline(str(folder))


def _edit_weights(folder, stage: int, change) -> None:
    import safetensors.torch

    path = folder / f"stage{stage}.safetensors"
    tensors = safetensors.torch.load_file(path)
    change(tensors)
    safetensors.torch.save_file(tensors, path)  # and its checksum, as someone editing both files would
    _edit_pipeline(folder, lambda d: d["stages"][stage].update(weights_sha256=file_sha256(str(path))))


def test_an_edited_weights_file_fails_its_checksum(folders, tmp_path):
    folder = _tampered(folders, tmp_path)
    path = folder / "stage1.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-64:] = b"\xff" * 64  # 64 overwritten bytes: NaNs in the last weights, same size and header
    path.write_bytes(bytes(raw))
    with pytest.raises(PlanFormatError, match="stage1.safetensors: its sha256 differs"):
        load_pipeline(str(folder))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update({"b.weight": t["b.weight"].double()}), "'b.weight' is float64[8, 8]; the stage needs float32"),
        (lambda t: t.update({"b.weight": torch.zeros(8, 9)}), "'b.weight' is float32[8, 9]"),
        (lambda t: t.update({"extra": torch.zeros(1)}), "holds unexpected ['extra']"),
        (lambda t: t.pop("b.bias"), "lacks ['b.bias']"),
    ],
)  # fmt: skip
def test_weights_of_the_wrong_dtype_shape_or_names_name_the_file_and_tensor(
    folders, tmp_path, change, message
):
    folder = _tampered(folders, tmp_path)
    _edit_weights(folder, 1, change)
    with pytest.raises(PlanFormatError, match="stage1.safetensors") as info:
        load_pipeline(str(folder))
    assert message in str(info.value)


def test_weights_without_a_record_are_still_checked_against_the_graph(folders, tmp_path):
    """An older folder lacks the ``tensors`` record: layer shapes and unused tensors are still caught."""
    folder = _tampered(folders, tmp_path, "layers")
    _edit_pipeline(folder, lambda d: [s.pop("tensors") for s in d["stages"]])
    _edit_weights(folder, 1, lambda t: t.update({"fc.weight": torch.zeros(5, 3)}))
    with pytest.raises(
        PlanFormatError, match="'fc.weight' has shape \\[5, 3\\]; layer 'fc' needs \\[5, 144\\]"
    ):
        load_pipeline(str(folder))
    _edit_weights(folder, 1, lambda t: t.update({"fc.weight": torch.zeros(5, 144), "spare": torch.zeros(2)}))
    with pytest.raises(PlanFormatError, match="does not use: \\['spare'\\]"):
        load_pipeline(str(folder))


def test_missing_truncated_corrupt_and_huge_header_weights(folders, tmp_path):
    """Without checksums (or with forged ones) the file's structure is still checked."""
    folder = _tampered(folders, tmp_path)
    _edit_pipeline(folder, lambda d: [s.pop("weights_sha256") for s in d["stages"]])
    path = folder / "stage1.safetensors"
    raw = path.read_bytes()
    for content, message in [
        (raw[: len(raw) - 7], "do not fit"),
        (raw[:5], "shorter than a header"),
        ((2**40).to_bytes(8, "little") + raw[8:], "a header of 1099511627776 bytes"),
        (raw[:8] + b"\xff" * (len(raw) - 8), "header is not JSON"),
    ]:
        path.write_bytes(content)
        with pytest.raises(PlanFormatError, match="stage1.safetensors") as info:
            load_pipeline(str(folder))
        assert message in str(info.value)
    path.unlink()
    with pytest.raises(PlanFormatError, match="stage1.safetensors: cannot read it"):
        load_pipeline(str(folder))


def test_each_rank_can_load_its_own_stage_alone(folders, tmp_path):
    """A truncated stage1.safetensors fails stage 1 only: the other stages never read it."""
    folder = _tampered(folders, tmp_path)
    path = folder / "stage1.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    whole = load_pipeline(str(folders["split"])).stages
    for k in (0, 2):
        alone = load_stage(str(folder), k)
        assert alone.index == k and alone.module.code == whole[k].module.code
    with pytest.raises(PlanFormatError, match="stage1.safetensors"):
        load_stage(str(folder), 1)
    with pytest.raises(PlanFormatError, match="no stage 3"):
        load_stage(str(folder), 3)


def test_inputs_file_is_checked_too(folders, tmp_path):
    folder = _tampered(folders, tmp_path, "compiled")
    (folder / "inputs.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(PlanFormatError, match="inputs.safetensors"):
        load_inputs(str(folder))


# ---- stage graphs: nothing that runs code ---------------------------------------------------------
def _edit_graph(folder, change, stage: int = 1) -> None:
    path = folder / f"stage{stage}.graph.json"
    graph = read_json(path)
    change(graph)
    write_json(path, graph)


def _relu(graph) -> dict:
    return next(n for n in graph["nodes"] if n["op"] == "call_function" and "relu" in n["target"])


@pytest.mark.parametrize(
    "target",
    ["builtins.eval", "builtins.exec", "builtins.__import__", "builtins.open", "builtins.compile",
     "builtins.setattr", "builtins.delattr", "builtins.globals", "builtins.breakpoint", "torch.save",
     "torch.load", "operator.methodcaller", "operator.attrgetter", "os.system", "importlib.import_module",
     "torch.ops.aten.relu", "torch.ops.evil.op.default", "math.__loader__", "torch.nn.functional.Callable"],
)  # fmt: skip
def test_every_call_target_outside_the_allow_list_is_refused(folders, tmp_path, target):
    folder = _tampered(folders, tmp_path)
    _edit_graph(folder, lambda g: _relu(g).update(target=target))
    with pytest.raises(PlanFormatError, match="disallowed function"):
        load_pipeline(str(folder))


@pytest.mark.parametrize(
    ("change", "message"),
    [  # fx writes these strings into the module's Python source: each would run code while loading
        (
            lambda g: g["nodes"].insert(
                0,
                {
                    "name": "x",
                    "op": "placeholder",
                    "target": "x=print('pwned')",
                    "args": {"tuple": []},
                    "kwargs": {"dict": []},
                },
            ),
            "placeholder target",
        ),
        (
            lambda g: _relu(g).update(op="call_method", target="add(1) or print('pwned') or x.add"),
            "call_method",
        ),
        (lambda g: g["nodes"][1].update(op="get_attr", target='b"); print("pwned'), "get_attr target"),
        (lambda g: _relu(g).update(kwargs={"dict": [["x=print('pwned'), y", 1]]}), "keyword argument"),
        (lambda g: _relu(g).update(name="relu; print('pwned')"), "expected a Python name"),
    ],
)
def test_strings_fx_would_write_into_code_must_be_plain_names(folders, tmp_path, capfd, change, message):
    folder = _tampered(folders, tmp_path)
    _edit_graph(folder, change)
    with pytest.raises(PlanFormatError, match="stage1.graph.json") as info:
        load_pipeline(str(folder))
    assert message in str(info.value) and "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize(
    "change",
    [
        lambda g: g.update(nodes={"a": 1}),
        lambda g: g["nodes"].append(g["nodes"][0]),
        lambda g: g["nodes"].pop(),
        lambda g: _relu(g).update(args={"tuple": [{"node": "nowhere"}]}),
        lambda g: _relu(g).update(args={"tuple": [{"device": "warp-drive"}]}),
        lambda g: _relu(g).update(args={"tuple": [{"float": "1+1"}]}),
        lambda g: _relu(g).update(args={"slice": [1]}),
        lambda g: _relu(g).update(args=[{"node": 3}]),
        lambda g: _relu(g).update(args={"tuple": [{"dtype": "__builtins__"}]}),
        lambda g: _relu(g).update(op="call_module", target="a"),
        lambda g: g.pop("modules"),  # every section graph_to_json writes is required
        lambda g: g.pop("libraries"),
    ],
)
def test_malformed_stage_graphs_name_the_file(folders, tmp_path, change):
    folder = _tampered(folders, tmp_path)
    _edit_graph(folder, change)
    with pytest.raises(PlanFormatError, match="stage1.graph.json"):
        load_pipeline(str(folder))


@pytest.mark.parametrize(
    "config",
    [{"in_features": 10**9, "out_features": 10**9, "bias": True}, {"in_features": -1, "out_features": 5},
     {"in_features": 144, "out_features": 5, "device": "cpu"}, "Linear"],
)  # fmt: skip
def test_layer_configs_are_built_without_memory_and_checked(folders, tmp_path, config):
    folder = _tampered(folders, tmp_path, "layers")
    _edit_graph(folder, lambda g: g["modules"]["fc"].update(config=config))
    with pytest.raises(PlanFormatError, match=r"stage1\.(graph\.json|safetensors)"):
        load_pipeline(str(folder))


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "k(); import os; os.system('x')#"), ("kind", "evil"), ("shape", ["1);print(1)#"])],
)
def test_fusion_groups_whose_source_would_run_code_are_refused(folders, tmp_path, field, value):
    folder = _tampered(folders, tmp_path, "compiled")
    (path,) = (folder / "kernels").glob("*.json")
    group = read_json(path)
    group[field] = value
    write_json(path, group)
    with pytest.raises(PlanFormatError, match="not a fusion group hetcc wrote"):
        load_pipeline(str(folder))


def test_a_replaced_line_with_a_newline_is_refused(folders, tmp_path):
    folder = _tampered(folders, tmp_path, "compiled")
    (path,) = (folder / "kernels").glob("*.json")
    group = read_json(path)
    group["instrs"][0]["replaced"] = "x\nimport os"
    write_json(path, group)
    with pytest.raises(PlanFormatError, match="printable line"):
        load_pipeline(str(folder))


# ---- API arguments -----------------------------------------------------------------------------------
MODEL = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
BATCH = torch.randn(8, 4)


def loss(out, target):  # module level: picklable
    return out.sum()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": None}, "unknown optimizer None"),
        ({"example_kwargs": [1, 2]}, "example_kwargs must be a dict"),
        ({"training": "no"}, "training must be True or False"),
        ({"example_inputs": (torch.randn(0, 4),)}, "example_inputs: a batch of 0 rows"),
        (
            {"example_inputs": (torch.randn(6, 4),), "microbatches": 4},
            "does not split into 4 equal microbatches",
        ),
        ({"example_inputs": 5}, "example_inputs must be a tuple"),
        ({"schedule": "zigzag"}, "schedule must be"),
        ({"cluster": 5}, "cluster must be a hetcc.Cluster"),
        ({"cluster": "no\0where.yaml"}, "not a file path"),
        ({"model": "gpt2"}, "model must be a torch.nn.Module"),
    ],
)
def test_compile_arguments_are_checked_first(kwargs, message):
    arguments = {"model": MODEL, "cluster": CLUSTERS / "cpu4.yaml", "example_inputs": (BATCH,)} | kwargs
    with pytest.raises(HetccError, match=message.replace("(", "\\(")):
        hetcc.compile(**arguments)


def test_dump_dir_that_is_a_file_or_unwritable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(HetccError, match="dump_dir .* is a file"):
        hetcc.analyze(MODEL, (BATCH,), dump_dir=tmp_path / "file")
    with pytest.raises(HetccError, match="dump_dir .* cannot be used"):
        hetcc.analyze(MODEL, (BATCH,), dump_dir=tmp_path / "file" / "below")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(HetccError, match="not writable"):
            hetcc.analyze(MODEL, (BATCH,), dump_dir=locked)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": 5}, "inputs must be a dict"),
        ({"inputs": {1: BATCH}}, "inputs must be a dict"),
        ({"steps": "2"}, "steps must be a positive integer"),
        ({"steps": -1}, "steps must be a positive integer"),
        ({"steps": True}, "steps must be a positive integer"),
        ({"loss_fn": lambda out, target: out.sum()}, "cannot be pickled"),
        ({"loss_fn": "mse"}, "loss_fn must be callable"),
        ({"targets": [1, 2]}, "targets must be a tensor"),
        ({"optimizer": "adam"}, "optimizer must be None or a dict"),
        ({"compiled_or_dir": 3}, "run_local takes a Compiled or a saved folder"),
    ],
)
def test_run_local_arguments_are_checked_before_any_process_starts(folders, kwargs, message):
    arguments = {"compiled_or_dir": folders["compiled"], "inputs": {"x": BATCH[:4]}, "loss_fn": loss} | kwargs
    with pytest.raises(HetccError, match=message):
        hetcc.run_local(**arguments)


# ---- plan.json: one reader (hetcc.plan.read_plan) for hetcc explain, the report, metrics, re-pricing -------
def _first_stage(plan: dict) -> dict:
    return plan["stages"][0]


@pytest.mark.parametrize(
    ("change", "field"),
    [  # every time, FLOP count and byte count is a finite number >= 0
        (lambda p: _first_stage(p)["memory"].update(params_bytes=-1e9), "stages[0].memory.params_bytes"),
        (lambda p: _first_stage(p)["memory"].update(activations_bytes=float("inf")), "memory.activations_bytes"),
        (lambda p: _first_stage(p).update(device_memory_bytes=-1), "stages[0].device_memory_bytes"),
        (lambda p: _first_stage(p).update(fwd_flops=-5), "stages[0].fwd_flops"),
        (lambda p: _first_stage(p).update(comm_s=float("nan")), "stages[0].comm_s"),
        (lambda p: _first_stage(p).update(inflight=-1), "stages[0].inflight"),
        (lambda p: _first_stage(p).update(bubble=2.0), "stages[0].bubble"),
        (lambda p: _first_stage(p).update(precision="bf16"), "stages[0].precision"),
        (lambda p: _first_stage(p).update(blocks="abc"), "blocks must be a list"),
        (lambda p: p["baselines"].update(uniform=-0.5), "baselines"),
        (lambda p: p.update(microbatch_rows=-3), "microbatch_rows"),
        (lambda p: p.update(precision="fp8"), "precision"),
        (lambda p: p.update(notes="one note"), "notes must be a list"),
    ],
)  # fmt: skip
def test_a_plan_json_with_a_negative_or_odd_figure_is_refused_by_every_reader(
    folders, tmp_path, capsys, change, field
):
    from hetcc.plan import read_plan
    from hetcc.report import write_report

    folder = _tampered(folders, tmp_path, "compiled")
    plan = read_json(folder / "plan.json")
    change(plan)
    write_json(folder / "plan.json", plan)
    for read in (read_plan, write_report):
        with pytest.raises(PlanFormatError, match="plan.json") as info:
            read(folder)
        assert field in str(info.value) and "compile the model again" in str(info.value)
    assert main(["explain", str(folder)]) == 2  # a HetccError: not printed
    assert field in capsys.readouterr().err


# ---- the command line ----------------------------------------------------------------------------------
def test_cli_errors_are_one_line_without_a_traceback(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HETCC_DEBUG", raising=False)
    broken = copy_folder(folders["compiled"], tmp_path / "broken")
    (broken / "plan.json").write_text('{"stages": 3}')
    (tmp_path / "file").write_text("")
    cases = [
        (["explain", str(broken)], "plan"),
        (["compile", "untrusted:FusedMLP", "--cluster", str(CLUSTERS / "cpu4.yaml"), "--out", str(tmp_path / "file")],
         "is a file, not a folder"),
        (["calibrate", "--out", str(tmp_path / "file" / "cal.yaml"), "--quick"], "is a file, not a folder"),
        (["calibrate", "--out", str(tmp_path / "cal.txt"), "--quick"], "must end in .yaml"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(argv) in (1, 2), argv
        err = capsys.readouterr().err
        assert err.startswith("hetcc: error: ") and message in err and "Traceback" not in err, (argv, err)


def test_hetcc_debug_shows_the_traceback(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HETCC_DEBUG", "1")
    broken = copy_folder(folders["compiled"], tmp_path / "broken")
    (broken / "plan.json").write_text("[]")
    assert main(["explain", str(broken)]) in (1, 2)
    assert "Traceback" in capsys.readouterr().err


def test_a_valid_folder_still_loads_and_matches_its_record(folders):
    for folder in folders.values():
        pipeline = load_pipeline(str(folder))
        document = json.loads((folder / "pipeline.json").read_text())
        for stage, entry in zip(pipeline.stages, document["stages"]):
            saved = {k: list(v.shape) for k, v in stage.module.state_dict().items() if k in entry["tensors"]}
            assert saved == {k: v["shape"] for k, v in entry["tensors"].items()}
            assert all(not math.isnan(float(v.sum())) for v in stage.module.state_dict().values())
