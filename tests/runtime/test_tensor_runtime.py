"""Tensor-parallel stages on real ranks (gloo): a stage's replica is t ranks, each holding its part of the
split weights and running the same printed graph with its collectives. Pipelines of GPT-2 (a weight tied
across stages) and Llama (grouped-query attention; 2 replicas x 2 parts with ZeRO-1) train like eager,
a checkpoint holds the whole weights and resumes exactly, and export gives the unsplit state dict."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from model_zoo import opt
from models import eager_training, gpt2, llama, token_ids
from runtime_models import slow_cards

import hetcc
from hetcc import config
from hetcc.kernels import FUSION_META_KEY
from hetcc.passes.tensor_parallel import tensor_parallel
from hetcc.runtime.placement import ranks_for
from hetcc.runtime.store import Pipeline

ADAM = {"name": "adam", "lr": 0.01}


def _compiled(model, inputs, cards: int, tmp_path_factory, microbatches: int):
    """``model`` planned on ``cards`` slow cards, one 1F1B stage each (fusion off: a fused group would make
    the tensor-parallel pass gather around it)."""
    state = sum(p.numel() * 4 for p in model.parameters()) * 4
    cluster = tmp_path_factory.mktemp("tp") / "cluster.yaml"
    cluster.write_text(slow_cards([cards], int(state * 1.5)))
    fuse, config.fuse = config.fuse, "off"
    try:
        return hetcc.compile(
            model, cluster, example_kwargs=inputs, microbatches=microbatches, replicate=False, schedule="1f1b"
        )
    finally:
        config.fuse = fuse


def _split(compiled, degrees, replicas=None, shard=None, schedule=None):
    """``compiled`` with stage k tensor parallel over ``degrees[k]`` ranks per replica (its tied weights
    kept whole) and ``replicas[k]`` replicas, microbatches dealt round robin; ``schedule``: another."""
    stages = copy.deepcopy(compiled.pipeline.stages)
    for stage, degree in zip(stages, degrees):
        if degree > 1:
            keep = frozenset(local for g in stage.tied for s, local in g.members if s == stage.index)
            stage.module, stage.tensor = tensor_parallel(stage.module, degree, keep_whole=keep)
    meta = compiled.pipeline.meta
    replicas = replicas or [1] * len(stages)
    routing = tuple(tuple(m % r for m in range(meta.microbatches)) for r in replicas)
    meta = dataclasses.replace(
        meta,
        placement=ranks_for(replicas, tensor=degrees),
        routing=routing,
        shard=tuple(shard or ()),
        schedule=schedule or meta.schedule,
        warmup=(),  # the plan's warm-ups were for its own replicas: the schedule's for these
    )
    return dataclasses.replace(compiled, pipeline=Pipeline(stages, meta))


@pytest.fixture(scope="module")
def gpt2_two_stages(tmp_path_factory):
    model = gpt2(n_layer=4, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(8, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    compiled = _compiled(model, inputs, 2, tmp_path_factory, microbatches=2)
    assert len(compiled.plan.stages) == 2, compiled.plan.explain()
    return model, inputs, compiled


def _assert_like_eager(result, model, inputs, microbatches, steps=2):
    losses, grads = eager_training(
        model, inputs, None, None, steps=steps, microbatches=microbatches, optimizer=ADAM
    )
    assert result.losses == pytest.approx(losses, rel=1e-5)
    assert set(result.grads) <= set(grads)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_gpt2_stages_of_two_parts_each_train_like_eager(gpt2_two_stages, schedule):
    """Both stages split over 2 ranks: activations cross part to part, the embedding tied to the head
    (kept whole on both stages) sums its gradient over all four ranks, counted once per stage. Under
    zb-h1 the collectives of the input gradients run in B, the weight gradients later in W."""
    model, inputs, compiled = gpt2_two_stages
    split = _split(compiled, [2, 2], schedule=schedule)
    assert split.pipeline.stages[0].tensor.sharded_params
    _assert_like_eager(hetcc.run_local(split, inputs, steps=2, optimizer=ADAM), model, inputs, 2)


@pytest.mark.slow
def test_a_split_stage_beside_a_whole_one_checkpoints_whole_and_resumes_exactly(gpt2_two_stages, tmp_path):
    """Stage 0 on 2 ranks sends to stage 1 on one, which sends each gradient back to both. The checkpoint
    holds the weights and Adam state whole (gathered to part 0), and a resume splits them again."""
    model, inputs, compiled = gpt2_two_stages
    split = _split(compiled, [2, 1])
    whole = hetcc.run_local(split, inputs, steps=3, optimizer=ADAM)
    _assert_like_eager(whole, model, inputs, 2, steps=3)
    hetcc.run_local(split, inputs, steps=2, optimizer=ADAM, checkpoint_dir=tmp_path, checkpoint_every=2)
    resumed = hetcc.run_local(split, inputs, steps=1, optimizer=ADAM, checkpoint_dir=tmp_path, resume=True)
    assert resumed.losses == pytest.approx(whole.losses[-1:], rel=1e-6)
    exported = hetcc.export(tmp_path)
    unsplit = compiled.pipeline.stages[0].module.state_dict()
    name = "transformer.h.0.attn.c_attn.weight"  # split in 3 blocks: whole again, the model's shape
    assert exported[name].shape == unsplit[name].shape
    model.load_state_dict(exported)  # strict: every key of the model, each its whole shape


@pytest.mark.slow
def test_llama_on_two_replicas_of_two_parts_with_zero1_trains_like_eager(tmp_path_factory):
    model = llama(layers=2)
    ids = token_ids(8, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    compiled = _compiled(model, inputs, 1, tmp_path_factory, microbatches=4)
    split = _split(compiled, [2], replicas=[2], shard=[True])
    result = hetcc.run_local(split, inputs, steps=2, optimizer=ADAM)
    _assert_like_eager(result, model, inputs, 4)


@pytest.mark.slow
def test_opt_on_one_stage_of_four_parts_trains_like_eager(tmp_path_factory):
    """Degree 4: OPT's 4 heads, one per rank."""
    case = opt()
    compiled = _compiled(case.model, case.inputs, 1, tmp_path_factory, microbatches=2)
    split = _split(compiled, [4])
    assert split.pipeline.stages[0].tensor.gathered_ops == []
    _assert_like_eager(
        hetcc.run_local(split, case.inputs, steps=2, optimizer=ADAM), case.model, case.inputs, 2
    )


@pytest.mark.slow
def test_a_planned_tensor_parallel_stage_trains_like_eager_holding_what_the_plan_predicts(
    tmp_path, monkeypatch
):
    """compile(tensor_parallel=2) on two cards that together hold what one cannot: one stage of two
    parts, every fusion group fused in the graph each part runs. It trains like eager, and each rank's
    measured weights and Adam state are within 15% of the plan's per-device figures."""
    monkeypatch.setattr(config, "fuse", "all")
    model = gpt2(n_layer=2, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(8, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    state = sum(p.numel() * 4 for p in model.parameters()) * 4
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(slow_cards([2], int(state * 1.0)).replace("20 GFLOP/s", "1 GFLOP/s"))
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=2, tensor_parallel=2)
    (stage,) = compiled.plan.stages
    assert stage.tensor == 2, compiled.plan.explain()
    assert sum(FUSION_META_KEY in n.meta for n in compiled.stages[0].module.graph.nodes) >= 4
    result = hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM)
    _assert_like_eager(result, model, inputs, 2)
    for rank in result.stats:
        assert rank["parameter_bytes"] == pytest.approx(stage.memory.params_bytes, rel=0.15)
        assert rank["optimizer_state_bytes"] == pytest.approx(stage.memory.optimizer_bytes, rel=0.15)


@pytest.mark.slow
def test_planned_stages_of_two_parts_trade_whole_tensors_across_a_sequence_parallel_boundary(
    tmp_path, monkeypatch
):
    """compile(tensor_parallel=2) of Llama on two nodes of two cards: two stages of two parts, each part
    holding half the tokens of the residual stream between its matmuls (sequence parallel) and its
    fusion groups fused. What stage 0 sends is gathered whole first; it trains like eager."""
    monkeypatch.setattr(config, "fuse", "all")
    model = llama()
    ids = token_ids(8, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    state = sum(p.numel() * 4 for p in model.parameters()) * 4
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        slow_cards([2, 2], int(state * 0.45), inter_node="1 Gb/s").replace("20 GFLOP/s", "1 GFLOP/s")
    )
    compiled = hetcc.compile(
        model, cluster, example_kwargs=inputs, microbatches=2, tensor_parallel=2, replicate=False
    )
    assert [s.tensor for s in compiled.plan.stages] == [2, 2], compiled.plan.explain()
    graph = compiled.stages[0].module.graph
    (send,) = [n for n in graph.nodes if n.target is torch.ops.hetcc.send.default]
    assert send.args[0].target is torch.ops.hetcc.all_gather.default  # the tokens gathered
    assert any(n.target is torch.ops.hetcc.reduce_scatter.default for n in graph.nodes)
    assert all(any(FUSION_META_KEY in n.meta for n in s.module.graph.nodes) for s in compiled.stages)
    _assert_like_eager(hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM), model, inputs, 2)
