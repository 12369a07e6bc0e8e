"""Multi-process training (gloo, one process per stage) equals eager single-process training.

Each fixture is one spawned run shared by several assertions. Losses must agree to 1e-5 relative and
every gradient to 1e-4; grads are checked after step 1 (one-step runs) and after step 3 (three-step
runs, which also checks that the optimizer steps on every stage matched eager's). Every rank's transfer
counters must show that the split's edges moved through the stage's send/recv ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from runtime_models import (
    CNN_RULES,
    GATED_RULES,
    GPT2_RULES,
    MLP_RULES,
    GatedMLP,
    ResidualMLP,
    SmallCNN,
    eager_reference,
    export,
    planned_transfers,
    stages_by_module,
    tiny_gpt2,
)

from hetcc import config
from hetcc.passes.comm import split_stages
from hetcc.train.local import run_local

pytestmark = pytest.mark.slow
MICROBATCHES = 2


def _run(
    model, microbatch_inputs, inputs, rules, num_stages, *, targets, loss_fn, schedule, steps, optimizer
):
    gm = export(model, kwargs=microbatch_inputs)
    stages = split_stages(gm, stages_by_module(gm, rules), num_stages)
    result = run_local(
        stages, inputs, targets, loss_fn, steps=steps, schedule=schedule,
        microbatches=MICROBATCHES, optimizer=optimizer,
    )  # fmt: skip
    reference = eager_reference(model, inputs, targets, loss_fn, steps, MICROBATCHES, optimizer)
    return result, reference, stages


def _check(result, reference, stages, output_index=0):
    _check_transfers(result, stages)
    losses, grads, outputs = reference
    assert len(result.losses) == len(losses)
    for got, want in zip(result.losses, losses):
        assert abs(got - want) <= 1e-5 * abs(want), (result.losses, losses)
    assert set(result.grads) == set(grads[-1])
    for name, grad in grads[-1].items():
        torch.testing.assert_close(result.grads[name], grad, rtol=0, atol=1e-4, msg=name)
    torch.testing.assert_close(result.outputs[output_index], outputs, rtol=1e-5, atol=1e-5)


def _check_transfers(result, stages):
    planned = planned_transfers(stages, MICROBATCHES, len(result.losses))
    assert [{key: stats[key] for key in plan} for stats, plan in zip(result.stats, planned)] == planned
    assert all(stats["grads_filled"] == stats["grads_dropped"] == 0 for stats in result.stats)


@pytest.fixture(scope="module", params=[("gpipe", 1), ("1f1b", 3)], ids=["gpipe-1step", "1f1b-3steps"])
def mlp_run(request):
    schedule, steps = request.param
    torch.manual_seed(0)
    model = ResidualMLP()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    optimizer = {"name": "adam", "lr": 0.01} if steps > 1 else {"name": "sgd", "lr": 0.1}
    return _run(
        model, {"x": x[:4]}, {"x": x}, MLP_RULES, 3, targets=y, loss_fn=F.mse_loss,
        schedule=schedule, steps=steps, optimizer=optimizer,
    )  # fmt: skip


def test_residual_mlp_over_three_stages_matches_eager(mlp_run):
    _check(*mlp_run)


@pytest.fixture(scope="module")
def cnn_run():
    # Train-mode BatchNorm normalises each microbatch by its own statistics, so the reference runs
    # eager microbatch by microbatch; running stats update in the same order in both.
    torch.manual_seed(0)
    model = SmallCNN().train()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    return _run(
        model, {"x": x[:2]}, {"x": x}, CNN_RULES, 2, targets=y, loss_fn=F.cross_entropy,
        schedule="gpipe", steps=3, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
    )  # fmt: skip


def test_cnn_with_train_mode_batchnorm_matches_eager_per_microbatch(cnn_run):
    _check(*cnn_run)


@pytest.fixture(scope="module", params=[("1f1b", 3), ("gpipe", 1)], ids=["1f1b-3steps", "gpipe-1step"])
def gpt2_run(request):
    schedule, steps = request.param
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids[:2], "labels": ids[:2].clone(), "use_cache": False}
    return _run(
        model, example, {"input_ids": ids, "labels": ids}, GPT2_RULES, 3, targets=None, loss_fn=None,
        schedule=schedule, steps=steps, optimizer={"name": "adam", "lr": 0.01},
    )  # fmt: skip


def test_gpt2_with_tied_embeddings_matches_eager(gpt2_run):
    result, reference, stages = gpt2_run
    assert "transformer.wte.weight" in result.grads and "lm_head.weight" not in result.grads
    _check(result, reference, stages, output_index=1)  # outputs: (loss per microbatch, logits)


def test_gradients_autograd_never_computes_are_settled_outside_the_ops():
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with config.patch(comm_timeout_s=30.0):  # a wait left unmatched fails in 30 s, not 120
        result, reference, stages = _run(
            GatedMLP(), {"x": x[:4]}, {"x": x}, GATED_RULES, 2, targets=y, loss_fn=F.mse_loss,
            schedule="1f1b", steps=2, optimizer={"name": "sgd", "lr": 0.1},
        )  # fmt: skip
    assert sorted(edge.requires_grad for edge in stages[0].sends) == [False, True, True]  # mask; h, gate
    losses, grads, outputs = reference
    for got, want in zip(result.losses, losses, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (result.losses, losses)
    for name, grad in grads[-1].items():
        torch.testing.assert_close(result.grads[name], grad, rtol=0, atol=1e-4, msg=name)
    # Per step and microbatch: the gate's zero gradient is sent by rank 1 and dropped by rank 0.
    settled = [(stats["grads_filled"], stats["grads_dropped"]) for stats in result.stats]
    assert settled == [(0, 4), (4, 0)]
    assert result.stats[0]["recvs"] == result.stats[1]["sends"] == 4  # the gradient of h only
