"""hetcc.compile -> run_local on gloo equals eager training, for models the plan splits itself.

The cluster gives each `cpu` device too little memory for the whole model, so the planner must cut it;
everything after that (split, send/recv, schedule, optimizer) is the product path a user runs. Stages
are single devices here (`replicate=False`) so transfers can be counted per stage; replicated plans
run end to end in `tests/runtime/test_planned_plan_space.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import bert, eager_training, gpt2, llama, token_ids
from runtime_models import planned_transfers

import hetcc
from hetcc.kernels import FUSION_META_KEY

pytestmark = pytest.mark.slow
MICROBATCHES = 2


def _cpu_cluster(devices: int, memory: str) -> hetcc.Cluster:
    return hetcc.Cluster.from_spec({
        "nodes": [{"name": "host", "intra_link": {"kind": "loopback", "bandwidth": "5 GB/s", "latency": "30 us"},
                   "devices": [{"type": "cpu", "count": devices, "memory": memory}]}],
    })  # fmt: skip


def bert_loss(outputs, target):
    return F.mse_loss(outputs[0], target)


def _check(result, losses, grads):
    assert len(result.losses) == len(losses)
    for got, want in zip(result.losses, losses):
        assert abs(got - want) <= 1e-5 * abs(want), (result.losses, losses)
    assert set(grads) <= set(result.grads) | {"lm_head.weight"}  # a tied weight is reported once
    for name, grad in result.grads.items():  # parameters the loss does not reach have no eager grad
        want = grads[name] if name in grads else torch.zeros_like(grad)
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-4, msg=name)


def test_llama_compiled_over_three_devices_trains_like_eager_with_1f1b():
    model = llama(layers=3)
    ids = token_ids(4, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    compiled = hetcc.compile(model, _cpu_cluster(3, "1.5 MiB"), example_kwargs=inputs, microbatches=MICROBATCHES,
                             schedule="1f1b", optimizer="adam", replicate=False)  # fmt: skip
    assert len(compiled.plan.stages) >= 2
    optimizer = {"name": "adam", "lr": 1e-3}
    result = hetcc.run_local(compiled, inputs, steps=3, optimizer=optimizer)
    _check(result, *eager_training(model, inputs, None, None, 3, MICROBATCHES, optimizer))
    _check_transfers(result, compiled.pipeline.stages, steps=3)


def _fused_groups(stage):
    return [n.meta[FUSION_META_KEY] for n in stage.module.graph.nodes if FUSION_META_KEY in n.meta]


def _check_transfers(result, stages, steps: int):
    """Every transfer the plan has went through the stage's send/recv ops (each rank's counters)."""
    planned = planned_transfers(stages, MICROBATCHES, steps)
    assert [{key: stats[key] for key in plan} for stats, plan in zip(result.stats, planned)] == planned
    assert all(stats["grads_filled"] == stats["grads_dropped"] == 0 for stats in result.stats)


def _check_interpreted_kernels(result, stages, steps: int):
    """Every fused group ran its generated kernel through the interpreter, forward and backward, once
    per microbatch; none fell back to its original ops."""
    runs = MICROBATCHES * steps
    for stage, stats in zip(stages, result.stats, strict=True):
        groups = _fused_groups(stage)
        generated = sum(group.backward == "generated" for group in groups)
        assert stats["fused_interpreter"] == len(groups) * runs and stats["fused_eager"] == 0, stats
        assert stats["backward_interpreter"] == generated * runs, stats
        assert stats["backward_recompute"] == (len(groups) - generated) * runs, stats


@pytest.mark.usefixtures("interpreter")
def test_gpt2_with_tied_embeddings_and_fused_kernels_trains_like_eager_with_gpipe():
    model = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    compiled = hetcc.compile(model, _cpu_cluster(3, "1.5 MiB"), example_kwargs=inputs, microbatches=MICROBATCHES,
                             schedule="gpipe", optimizer="sgd", replicate=False)  # fmt: skip
    stages = compiled.pipeline.stages
    assert len(stages) == 3, "1.5 MiB per device should need all three"
    groups = [group for stage in stages for group in _fused_groups(stage)]
    assert groups, "the MLP's gelu chain and the residual + layer norm should run as generated kernels"
    assert {group.kind for group in groups} == {"pointwise", "row"}
    assert {group.backward for group in groups} == {"generated"}  # row groups too
    assert "# fused_" in stages[0].module.code
    optimizer = {"name": "sgd", "lr": 0.1}
    result = hetcc.run_local(compiled, inputs, steps=1, optimizer=optimizer)
    _check(result, *eager_training(model, inputs, None, None, 1, MICROBATCHES, optimizer))
    _check_transfers(result, stages, steps=1)
    _check_interpreted_kernels(result, stages, steps=1)


def test_bert_compiled_saved_and_run_from_its_folder_with_gpipe(tmp_path):
    model = bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # deterministic, like eager
    ids = token_ids(4, 16)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    targets = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(2))
    compiled = hetcc.compile(model, _cpu_cluster(3, "1 MiB"), example_kwargs=inputs, microbatches=MICROBATCHES,
                             schedule="gpipe", optimizer="sgd", replicate=False)  # fmt: skip
    assert len(compiled.plan.stages) >= 2
    folder = compiled.save(tmp_path / "build", inputs=inputs, targets=targets)
    assert (folder / "plan.json").exists() and (folder / "stage0.py").exists()
    assert (
        "hetcc.send" in (folder / "stage0.py").read_text()
        or "hetcc.ops.send" in (folder / "stage0.py").read_text()
    )
    optimizer = {"name": "sgd", "lr": 0.1}
    result = hetcc.run_local(folder, inputs, targets=targets, loss_fn=bert_loss, steps=1, optimizer=optimizer)
    _check(result, *eager_training(model, inputs, targets, bert_loss, 1, MICROBATCHES, optimizer))
    _check_transfers(result, compiled.pipeline.stages, steps=1)
