"""ZeRO-1 on real ranks: two replicated stages of a GPT-2 on 4 CPU ranks (gloo), each stage's Adam state
split over its two replicas by torch's ``ZeroRedundancyOptimizer``. Training is eager's, each replica holds
its share of the state the plan predicts, and a checkpoint taken mid-run resumes exactly."""

from __future__ import annotations

import pytest
import torch
from models import eager_training, gpt2, token_ids
from runtime_models import slow_cards

import hetcc

ADAM = {"name": "adam", "lr": 0.01}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """75% of the model's state per card: two stages of two replicas, ZeRO-1 on both (shard=1)."""
    model = gpt2(n_layer=4, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(8, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    state = sum(p.numel() * 4 for p in model.parameters()) * 4
    cluster = tmp_path_factory.mktemp("shard") / "cluster.yaml"
    cluster.write_text(slow_cards([4], int(state * 0.75)))
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=4, shard=1)
    return model, inputs, compiled


@pytest.mark.slow
def test_zero1_replicas_train_like_eager_each_holding_its_share(sharded):
    model, inputs, compiled = sharded
    plan = compiled.plan
    assert [(len(s.devices), s.shard) for s in plan.stages] == [(2, True), (2, True)], plan.explain()
    result = hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM)
    losses, grads = eager_training(model, inputs, None, None, steps=2, microbatches=4, optimizer=ADAM)
    assert result.losses == pytest.approx(losses, rel=1e-5)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-4, msg=name)
    # measured: each replica's Adam state within 15% of the plan's share (ZeRO partitions whole tensors)
    placement = compiled.pipeline.meta.placement
    for stage in plan.stages:
        held = [result.stats[r.rank]["optimizer_state_bytes"] for r in placement if r.stage == stage.index]
        assert held == [pytest.approx(stage.memory.optimizer_bytes, rel=0.15)] * 2, (stage.index, held)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_exactly(sharded, tmp_path):
    """The replicas' shards are gathered to replica 0 when saving, and split again when loading."""
    _, inputs, compiled = sharded
    whole = hetcc.run_local(compiled, inputs, steps=3, optimizer=ADAM)
    hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM, checkpoint_dir=tmp_path, checkpoint_every=2)
    resumed = hetcc.run_local(compiled, inputs, steps=1, optimizer=ADAM, checkpoint_dir=tmp_path, resume=True)
    assert resumed.losses == pytest.approx(whole.losses[-1:], rel=1e-6)


def test_the_plan_says_which_stages_shard_and_what_each_replica_holds(sharded):
    _, _, compiled = sharded
    text = compiled.explain()
    assert "zero-1" in text and text.count(" yes") >= 2
    for stage in compiled.plan.stages:  # Adam: two states per parameter, each replica half of them
        assert stage.memory.optimizer_bytes == pytest.approx(stage.memory.grads_bytes, rel=1e-9)
    assert compiled.pipeline.meta.shard == (True, True)


@pytest.mark.parametrize(
    ("shard", "match"), [(2, "not built yet"), (3, "not built yet"), ("yes", "shard must be")]
)
def test_shard_levels_not_built_or_unknown_are_refused_before_tracing(shard, match):
    with pytest.raises(hetcc.HetccError, match=match):
        hetcc.compile(torch.nn.Linear(2, 2), "examples/clusters/cpu4.yaml", (torch.zeros(1, 2),), shard=shard)
