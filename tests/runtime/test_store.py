"""save_stages / load_stages: the folder's contents, exact round trips, and no code loaded from it."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from runtime_models import (
    GPT2_RULES,
    MLP_RULES,
    ResidualMLP,
    SmallCNN,
    export,
    run_in_process,
    stages_by_module,
    tiny_gpt2,
)
from torch.fx.passes.shape_prop import ShapeProp

from hetcc.errors import PlanFormatError
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.store import load_inputs, load_pipeline, load_stages, save_stages


@pytest.fixture(scope="module")
def gpt2_split():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8))
    gm = export(model, kwargs={"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    return ids, split_stages(gm, stages_by_module(gm, GPT2_RULES), 3)


def _forbid_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loading a pipeline must not unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_folder_describes_stages_edges_and_tied_groups(tmp_path, gpt2_split):
    ids, stages = gpt2_split
    save_stages(stages, str(tmp_path), PipelineMeta(len(stages), microbatches=2), inputs={"input_ids": ids})
    names = {p.name for p in tmp_path.iterdir()}
    for k in range(3):
        assert {f"stage{k}.py", f"stage{k}.graph.json", f"stage{k}.safetensors"} <= names
    document = json.loads((tmp_path / "pipeline.json").read_text())
    assert document["num_stages"] == 3 and document["meta"]["schedule"] == "1f1b"
    assert document["tied"] == [
        {"name": "transformer.wte.weight", "members": [[0, "lm_head.weight"], [2, "lm_head.weight"]]}
    ]
    assert document["stages"][1]["peers"] == [0, 2]
    assert document["stages"][2]["inputs"] == ["labels"]
    assert "torch.ops.hetcc.recv.default(hetcc_anchor, 1," in (tmp_path / "stage2.py").read_text()
    assert torch.equal(load_inputs(str(tmp_path))[0]["input_ids"], ids)


def test_gpt2_round_trip_is_exact_without_unpickling(tmp_path, monkeypatch, gpt2_split):
    ids, stages = gpt2_split
    save_stages(stages, str(tmp_path))
    _forbid_pickle(monkeypatch)
    loaded = load_stages(str(tmp_path))
    monkeypatch.undo()
    assert [s.recvs for s in loaded] == [s.recvs for s in stages]
    assert [s.tied for s in loaded] == [s.tied for s in stages]
    for before, after in zip(stages, loaded):
        assert before.module.state_dict().keys() == after.module.state_dict().keys()
    inputs = {"input_ids": ids, "labels": ids}
    for got, want in zip(run_in_process(loaded, inputs), run_in_process(stages, inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_symbolic_trace_layers_round_trip(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    stages = split_stages(gm, {"conv": 0, "bn": 0, "relu": 0, "flatten": 1, "fc": 1}, 2)
    save_stages(stages, str(tmp_path))
    loaded = load_pipeline(str(tmp_path)).stages
    assert not loaded[0].module.bn.training
    (out,) = run_in_process(loaded, {"x": x})
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def _save_mlp_and_edit_its_relu(folder, **changes) -> None:
    """Save the residual MLP in three stages, then rewrite stage 1's relu node with ``changes``."""
    gm = export(ResidualMLP(), (torch.randn(4, 8),))
    save_stages(split_stages(gm, stages_by_module(gm, MLP_RULES), 3), str(folder))
    path = folder / "stage1.graph.json"
    graph = json.loads(path.read_text())
    node = next(n for n in graph["nodes"] if n["op"] == "call_function" and "relu" in n["target"])
    node.update({k: (v(node) if callable(v) else v) for k, v in changes.items()})
    path.write_text(json.dumps(graph))


@pytest.mark.parametrize(
    "target",
    ["os.system", "builtins.eval", "builtins.exec", "builtins.__import__", "builtins.open", "torch.save",
     "torch.load", "torch.from_file", "operator.methodcaller", "operator.attrgetter", "subprocess.run"],
)  # fmt: skip
def test_tampered_graph_naming_a_function_outside_the_allow_list_is_refused(tmp_path, target):
    _save_mlp_and_edit_its_relu(tmp_path, target=target)
    with pytest.raises(PlanFormatError, match=f"disallowed function '{target}'"):
        load_stages(str(tmp_path))


def test_private_attributes_and_methods_are_refused(tmp_path):
    _save_mlp_and_edit_its_relu(tmp_path / "method", op="call_method", target="__reduce_ex__")
    _save_mlp_and_edit_its_relu(
        tmp_path / "getattr", target="builtins.getattr",
        args=lambda node: {"tuple": [node["args"]["tuple"][0], "__class__"]},
    )  # fmt: skip
    for case in ("method", "getattr"):
        with pytest.raises(PlanFormatError, match="private attribute"):
            load_stages(str(tmp_path / case))


def test_missing_folder_fails_with_the_path(tmp_path):
    with pytest.raises(PlanFormatError, match="pipeline.json"):
        load_stages(str(tmp_path / "nowhere"))


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    """A tiny Mixtral (grouped expert matmuls: a transformers custom op) split in two and saved."""
    from model_zoo import mixtral

    import hetcc

    case = mixtral()
    kwargs = {k: (v[:2] if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
    analysis = hetcc.analyze(case.model, example_kwargs=kwargs)
    stage_of = {name: int(i >= 2) for i, b in enumerate(analysis.blocks) for name in b.nodes}
    folder = tmp_path_factory.mktemp("mixtral")
    save_stages(split_stages(analysis.graph, stage_of, 2), str(folder))
    return folder, case.model, kwargs


def test_library_operators_record_the_package_that_registers_them(mixtral_folder):
    folder, _, _ = mixtral_folder
    graphs = [json.loads((folder / f"stage{k}.graph.json").read_text()) for k in range(2)]
    assert {ns: m for g in graphs for ns, m in g["libraries"].items()} == {
        "transformers": "transformers.integrations.moe"
    }
    assert any(
        "torch.ops.transformers.grouped_mm_fallback" in n["target"] for g in graphs for n in g["nodes"]
    )


def test_a_fresh_process_imports_the_library_and_runs_the_stages_like_eager(mixtral_folder, tmp_path):
    import subprocess
    import sys

    folder, model, kwargs = mixtral_folder
    torch.save({"input_ids": kwargs["input_ids"]}, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from hetcc.runtime.store import load_pipeline\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "from runtime_models import run_in_process\n"
        "assert 'transformers' not in sys.modules\n"
        f"stages = load_pipeline({str(folder)!r}).stages\n"
        "assert 'transformers.integrations.moe' in sys.modules\n"
        f"inputs = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "outputs = run_in_process(stages, dict(inputs, labels=inputs['input_ids']))\n"
        f"torch.save(outputs[0], {str(tmp_path / 'loss.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    loss = torch.load(tmp_path / "loss.pt")
    torch.testing.assert_close(loss, model(**kwargs).loss, rtol=1e-5, atol=1e-6)


def _tamper(folder, tmp_path, edit):
    import shutil

    copy = tmp_path / "tampered"
    shutil.copytree(folder, copy)
    for k in range(2):
        path = copy / f"stage{k}.graph.json"
        graph = json.loads(path.read_text())
        edit(graph)
        path.write_text(json.dumps(graph))
    return str(copy)


@pytest.mark.parametrize(
    ("libraries", "message"),
    [({"os": "os"}, "not an importable operator library"),
     ({"transformers": "subprocess"}, "not an importable operator library"),
     ({"transformers": "transformers; import os"}, "not an importable operator library"),
     ({"aten": "aten"}, "not an importable operator library"),
     ({}, "disallowed function 'torch.ops.transformers.grouped_mm_fallback.default'")],
    ids=["stdlib", "other-package", "not-a-module-name", "torch-namespace", "undeclared"],
)  # fmt: skip
def test_library_entries_outside_the_allow_list_are_refused(mixtral_folder, tmp_path, libraries, message):
    folder, _, _ = mixtral_folder
    tampered = _tamper(folder, tmp_path, lambda graph: graph.__setitem__("libraries", libraries))
    with pytest.raises(PlanFormatError, match=message):
        load_stages(tampered)
