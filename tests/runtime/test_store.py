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
    save_stages(stages, str(tmp_path), {"schedule": "1f1b", "microbatches": 2}, inputs={"input_ids": ids})
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


def test_tampered_graph_naming_an_arbitrary_function_is_refused(tmp_path):
    model = ResidualMLP()
    gm = export(model, (torch.randn(4, 8),))
    save_stages(split_stages(gm, stages_by_module(gm, MLP_RULES), 3), str(tmp_path))
    path = tmp_path / "stage1.graph.json"
    graph = json.loads(path.read_text())
    node = next(n for n in graph["nodes"] if n["op"] == "call_function" and "relu" in n["target"])
    node["target"] = "os.system"
    path.write_text(json.dumps(graph))
    with pytest.raises(PlanFormatError, match="disallowed function 'os.system'"):
        load_stages(str(tmp_path))


def test_missing_folder_fails_with_the_path(tmp_path):
    with pytest.raises(PlanFormatError, match="pipeline.json"):
        load_stages(str(tmp_path / "nowhere"))
