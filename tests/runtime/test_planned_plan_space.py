"""Plans hetcc chose with replicas and recomputation run, from ``hetcc.compile`` to ``run_local``, and
train exactly like eager PyTorch: 4 CPU ranks, 1F1B, two Adam steps."""

from __future__ import annotations

import pytest
import torch
from models import eager_training, gpt2, token_ids
from runtime_models import slow_cards

import hetcc
from hetcc.solver.schedules import splits_backward, warmup_forwards

# Slow cards on fast links: compute dominates, so replicas (no bubbles) beat a 4-deep pipeline.
FOUR_SLOW_CARDS = slow_cards([4], "MEMORY")
ADAM = {"name": "adam", "lr": 0.01}


def _gpt2_on(tmp_path, cards: str, share: float):
    """A 4-layer GPT-2 without dropout (each rank draws its own masks, so only a deterministic model can
    match eager), its batch, and the cluster ``cards`` with MEMORY set to ``share`` of the model's
    parameters, gradients and Adam state."""
    model = gpt2(n_layer=4, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(8, 16)
    state = sum(p.numel() * 4 for p in model.parameters()) * 4
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(cards.replace("MEMORY", str(int(state * share))))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, cluster


def _trains_like_eager(compiled, model, inputs, autocast=None):
    """Two Adam steps on 4 CPU ranks against eager's: losses to 1e-5 (1e-3 under bf16 autocast), and in
    fp32 every gradient to 1e-4. Returns the run."""
    result = hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM)
    losses, grads = eager_training(model, inputs, None, None, steps=2, microbatches=compiled.plan.microbatches,
                                   optimizer=ADAM, autocast=autocast)  # fmt: skip
    assert result.losses == pytest.approx(losses, rel=1e-5 if autocast is None else 1e-3)
    if autocast is None:
        for name, grad in result.grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-4, msg=name)
    assert set(result.grads) <= set(grads) and len(result.grads) > 0
    return result


@pytest.mark.slow
def test_replicated_recomputing_plan_trains_like_eager(tmp_path):
    # 75% of the model's parameters, gradients and Adam state fit one card: two stages at least.
    model, inputs, cluster = _gpt2_on(tmp_path, FOUR_SLOW_CARDS, 0.75)
    compiled = hetcc.compile(
        model, cluster, example_kwargs=inputs, microbatches=4, recompute=True, schedule="1f1b"
    )  # one stage per replica group (under "auto" an interleaved plan of single devices wins here)
    plan = compiled.plan
    assert len(plan.stages) >= 2 and any(len(s.devices) > 1 for s in plan.stages), plan.explain()
    assert all(s.recompute for s in plan.stages)
    assert sum(len(s.devices) for s in plan.stages) == 4
    _trains_like_eager(compiled, model, inputs)


@pytest.mark.slow
@pytest.mark.parametrize(("share", "precision"), [(0.75, "fp32"), (0.44, "bf16-mixed")])
def test_zb_h1_plans_train_like_eager(tmp_path, share, precision):
    """Zero-bubble H1 as hetcc plans it: at 75% memory two replicated stages (the second splits its
    backward in B and W), at 44% four stages, the first recomputing (its backward runs whole), under
    bf16 autocast, the last deferring one weight gradient where ZB-H1 defers three (its memory holds
    no more); GPT-2's tied embedding; fused groups (the suite fuses them all)."""
    model, inputs, cluster = _gpt2_on(tmp_path, FOUR_SLOW_CARDS, share)
    compiled = hetcc.compile(
        model, cluster, example_kwargs=inputs, microbatches=4, schedule="zb-h1", precision=precision
    )
    layout = [(len(s.devices), s.recompute) for s in compiled.plan.stages]
    split = splits_backward("zb-h1", [s.recompute for s in compiled.plan.stages])
    assert compiled.plan.schedule == "zb-h1" and any(split), layout
    deferred = [s.deferred for s in compiled.plan.stages]
    if share == 0.75:
        assert layout == [(2, False), (2, False)] and deferred == [0, 2]
    else:
        assert layout == [(1, True), (1, False), (1, False), (1, False)]
        assert deferred == [0, 1, 2, 1], deferred  # ZB-H1: [0, 1, 2, 3]
    assert compiled.pipeline.meta.deferred == tuple(deferred)  # what the ranks run
    assert all(s.peak_memory_bytes <= s.device_memory_bytes for s in compiled.plan.stages)
    _trains_like_eager(compiled, model, inputs, torch.bfloat16 if precision == "bf16-mixed" else None)


@pytest.mark.slow
@pytest.mark.parametrize(("share", "microbatches"), [(0.5, 8), (0.44, 4)])
def test_zb_h2_plans_train_like_eager(tmp_path, share, microbatches):
    """Zero-bubble H2 as hetcc plans it, under bf16 autocast with GPT-2's tied embedding: at 50% memory
    and 8 microbatches a replicated stage, and stages warming up with more forwards than 1F1B's (the
    ranks run the recorded warm-ups); at 44% and 4, four stages, the first recomputing."""
    model, inputs, cluster = _gpt2_on(tmp_path, FOUR_SLOW_CARDS, share)
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=microbatches, schedule="zb-h2",
                             precision="bf16-mixed")  # fmt: skip
    stages = compiled.plan.stages
    replicas = [len(s.devices) for s in stages]
    assert compiled.plan.schedule == "zb-h2" and any(splits_backward("zb-h2", [s.recompute for s in stages]))
    assert compiled.pipeline.meta.warmup == tuple(s.warmup for s in stages)  # what the ranks run
    beyond = [s.warmup > w for s, w in zip(stages, warmup_forwards("1f1b", replicas, microbatches))]
    if share == 0.5:
        assert any(beyond) and max(replicas) > 1, compiled.explain()
    else:
        assert len(stages) == 4 and stages[0].recompute, compiled.explain()
    assert all(s.peak_memory_bytes <= s.device_memory_bytes for s in stages)
    _trains_like_eager(compiled, model, inputs, torch.bfloat16)


@pytest.mark.slow
def test_bf16_mixed_plan_trains_like_eager_under_autocast(tmp_path):
    model = gpt2(n_layer=2, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 16)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    cluster = "examples/clusters/mixed_a100_t4.yaml"
    with hetcc.config.patch(fuse="cost"):  # the default: fuse where one call beats the ops' host time
        plain = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=2, precision="bf16-mixed")
    # the two 8-op gelu chains fuse; the 2-3 op residual groups stay ops (their ops cost the host less)
    assert any("2 of 7 fused" in note and note.startswith("fusion:") for note in plain.plan.notes)
    fused = [n.meta["hetcc_fusion"] for stage in plain.pipeline.stages for n in stage.module.graph.nodes
             if "hetcc_fusion" in n.meta]  # fmt: skip
    assert len(fused) == 2 and all(len(group.instrs) == 8 for group in fused)
    with hetcc.config.patch(fuse="all"):
        compiled = hetcc.compile(
            model, cluster, example_kwargs=inputs, microbatches=2, precision="bf16-mixed"
        )
    assert compiled.plan.precision == "bf16-mixed" and "bf16-mixed" in compiled.explain().splitlines()[0]
    # fused groups run under autocast too, their kernels generated for the dtypes autocast gives them
    assert any(
        "fusion_group" in node.name for stage in compiled.pipeline.stages for node in stage.module.graph.nodes
    )
    result = hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM)
    assert sum(rank["fused_interpreter"] for rank in result.stats) > 0
    assert sum(rank["fused_eager"] for rank in result.stats) == 0
    losses, _ = eager_training(
        model, inputs, None, None, steps=2, microbatches=2, optimizer=ADAM, autocast=torch.bfloat16
    )
    assert result.losses == pytest.approx(losses, rel=1e-3)  # measured: 1.5e-5
    assert result.losses[0] != pytest.approx(4.885914325714111, rel=1e-6)  # not the fp32 run's loss


# One card whose fused-kernel call costs nothing, one where it costs 10 ms: fusion by cost fuses groups in
# the first card's stage only, which also recomputes (its memory needs it).
FREE_AND_DEAR_CALLS = """
name: fused-and-not
memory_reserve: 0
custom_types:
  - {name: FreeCall, base: A100-80GB, host_fused_op: 0 s, host_fused_backward_op: 0 s, peak_flops: {fp32: 20 GFLOP/s}}
  - {name: DearCall, base: A100-80GB, host_fused_op: 10 ms, host_fused_backward_op: 10 ms, peak_flops: {fp32: 20 GFLOP/s}}
nodes:
  - name: node0
    intra_link: {kind: nvlink, bandwidth: 300 GB/s, latency: 2 us}
    devices: [{type: FreeCall, memory: MEMORY}, {type: DearCall, memory: MEMORY}]
"""


@pytest.mark.slow
def test_a_plan_fusing_by_cost_in_one_stage_and_not_the_next_trains_like_eager(tmp_path):
    model, inputs, cluster = _gpt2_on(tmp_path, FREE_AND_DEAR_CALLS, 1.0)  # the whole model fits one card
    with hetcc.config.patch(fuse="cost"):
        compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=2)
    fused_op = hetcc.kernels.fused  # what a fused node calls
    fused = {
        compiled.plan.stages[s.index].device_type: sum(n.target == fused_op for n in s.module.graph.nodes)
        for s in compiled.pipeline.stages
    }
    assert fused["FreeCall"] > 0 and fused["DearCall"] == 0, (fused, compiled.explain())
    result = _trains_like_eager(compiled, model, inputs)
    assert sum(rank["fused_interpreter"] for rank in result.stats) > 0
