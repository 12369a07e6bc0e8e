"""The runtime executes the wider plans: replicated stages with uneven microbatch routing, activation
recomputation, tied weights over replicas, and mixed precision, each described by ``Pipeline.meta``
(``hetcc.runtime.contract.PipelineMeta``).

Every run is compared with eager training in one process (``models.eager_training``): fp32 plans to
1e-5 relative in the loss and 1e-4 in every gradient, bf16-mixed to 1e-2 relative in the loss against
eager under the same ``torch.autocast``. The transfer counters show that each replica moved only its
own microbatches and that recomputed forwards moved nothing.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import eager_training
from runtime_models import (
    GPT2_RULES,
    MLP_RULES,
    ResidualMLP,
    SmallCNN,
    export,
    planned_transfers,
    stages_by_module,
    tiny_gpt2,
)

from hetcc.errors import PlanFormatError
from hetcc.hardware.schema import Where
from hetcc.passes.codegen import stage_source
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta, read_meta
from hetcc.runtime.executor import StageExecutor
from hetcc.runtime.groups import Links
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.placement import ranks_for
from hetcc.runtime.precision import LossScaler
from hetcc.runtime.store import Pipeline
from hetcc.solver.schedules import stage_actions
from hetcc.train.local import _run_meta, run_local

ADAM = {"name": "adam", "lr": 0.01}
MLP_TWO_STAGES = [("a", 0), ("b", 1), ("c", 1)]


def _mlp_pipeline(model, microbatch: torch.Tensor, **meta) -> Pipeline:
    gm = export(model, kwargs={"x": microbatch})
    return Pipeline(split_stages(gm, stages_by_module(gm, MLP_TWO_STAGES), 2), PipelineMeta(2, **meta))


def _check_fp32(result, reference) -> tuple[float, float]:
    """Loss within 1e-5 relative every step, every gradient within 1e-4; returns the worst errors."""
    losses, grads = reference
    loss_error = max(abs(got - want) / abs(want) for got, want in zip(result.losses, losses, strict=True))
    assert loss_error <= 1e-5, (result.losses, losses)
    assert set(grads) <= set(result.grads) | {"lm_head.weight"}  # a tied weight is reported once
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-4, msg=name)
    grad_error = max(float((result.grads[name] - grads[name]).abs().max()) for name in result.grads)
    print(f"max relative loss error {loss_error:.2e}, max gradient error {grad_error:.2e}")
    return loss_error, grad_error


def _check_shares(result, pipeline: Pipeline, microbatches: int, steps: int) -> None:
    """Each rank moved its own microbatches' tensors only; the replicas of a stage together moved
    what the stage's edges carry; a recomputing stage replayed its forward transfers."""
    layout = RankLayout.from_meta(pipeline.meta)
    planned = planned_transfers(pipeline.stages, 1, steps)  # per microbatch
    for rank, stats in enumerate(result.stats):
        stage = layout.ranks[rank].stage
        owned = sum(1 for m in range(microbatches) if layout.rank_running(stage, m) == rank)
        assert {key: stats[key] for key in planned[stage]} == {
            k: v * owned for k, v in planned[stage].items()
        }
        if layout.recompute[stage]:  # each recv again in the recomputed forward (a send, unless
            # checkpoint's early stop ends the recomputation before it)
            assert stats["replayed"] >= len(pipeline.stages[stage].recvs) * owned * steps > 0, rank
        else:
            assert stats["replayed"] == 0, rank
        assert stats["grads_filled"] == stats["grads_dropped"] == 0


@pytest.fixture(scope="module")
def mlp_batch():
    torch.manual_seed(0)
    return ResidualMLP(), torch.randn(8, 8), torch.randn(8, 8)


@pytest.mark.slow
def test_replicated_stages_with_uneven_routing_and_recompute_train_like_eager(mlp_batch):
    """Two stages on two replicas each: stage 0 sends microbatches 0-2 from replica 0 and 3 from
    replica 1; stage 1 routes them to replicas 0, 1, 1, 0 and recomputes its forward in backward."""
    model, x, y = mlp_batch
    meta = {
        "placement": ranks_for([2, 2]),
        "routing": [[0, 0, 0, 1], [0, 1, 1, 0]],
        "recompute": [False, True],
    }
    pipeline = _mlp_pipeline(model, x[:2], microbatches=4, **meta)
    result = run_local(pipeline, {"x": x}, y, F.mse_loss, steps=2, microbatches=4, optimizer=ADAM)
    _check_fp32(result, eager_training(model, {"x": x}, y, F.mse_loss, 2, 4, ADAM))
    _check_shares(result, pipeline, microbatches=4, steps=2)
    # the last step's outputs, from both replicas of stage 1, come back in microbatch order
    torch.testing.assert_close(result.outputs[0], _eager_outputs_after(model, x, y, 1, 4), rtol=0, atol=1e-5)


def _eager_outputs_after(model, x, y, steps: int, microbatches: int) -> torch.Tensor:
    """The model's outputs on ``x`` after ``steps`` Adam steps of eager training."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=ADAM["lr"])
    for _ in range(steps):
        optimizer.zero_grad()
        chunks = zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)
        sum(F.mse_loss(model(xm), ym) / microbatches for xm, ym in chunks).backward()
        optimizer.step()
    return model(x).detach()


@pytest.mark.slow
def test_tied_gpt2_with_a_replicated_tied_stage_and_recompute_trains_like_eager():
    """wte (stage 0) and lm_head (stage 2, on two replicas) are one parameter: its gradient is summed
    over all three ranks holding it; stage 1 (a transformer block) recomputes its forward."""
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    gm = export(model, kwargs={"input_ids": ids[:2], "labels": ids[:2].clone(), "use_cache": False})
    meta = PipelineMeta(
        3, microbatches=4, placement=ranks_for([1, 1, 2]), routing=[[0] * 4, [0] * 4, [1, 0, 1, 1]],
        recompute=[False, True, False],
    )  # fmt: skip
    pipeline = Pipeline(split_stages(gm, stages_by_module(gm, GPT2_RULES), 3), meta)
    inputs = {"input_ids": ids, "labels": ids}
    result = run_local(pipeline, inputs, steps=2, microbatches=4, optimizer=ADAM)
    assert "transformer.wte.weight" in result.grads
    _check_fp32(result, eager_training(model, {**inputs, "use_cache": False}, None, None, 2, 4, ADAM))
    _check_shares(result, pipeline, microbatches=4, steps=2)


@pytest.mark.slow
def test_edge_skipping_a_stage_into_a_replicated_last_stage_trains_like_eager(mlp_batch):
    """Three stages, the last on two replicas routed 0, 1, 0, 1 (the shape of a plan hetcc.compile
    chose for GPT-2): stage 0's activation ``h`` skips stage 1 straight to stage 2 (the residual), so
    each replica of stage 2 receives microbatch m from two peers, one of them two stages back."""
    model, x, y = mlp_batch
    gm = export(model, kwargs={"x": x[:2]})
    stages = split_stages(gm, stages_by_module(gm, MLP_RULES), 3)
    assert any(edge.dst == 2 for edge in stages[0].sends)  # the skip edge
    meta = PipelineMeta(
        3, microbatches=4, placement=ranks_for([1, 1, 2]), routing=[[0] * 4, [0] * 4, [0, 1, 0, 1]]
    )
    pipeline = Pipeline(stages, meta)
    result = run_local(pipeline, {"x": x}, y, F.mse_loss, steps=2, microbatches=4, optimizer=ADAM)
    _check_fp32(result, eager_training(model, {"x": x}, y, F.mse_loss, 2, 4, ADAM))
    _check_shares(result, pipeline, microbatches=4, steps=2)
    torch.testing.assert_close(result.outputs[0], _eager_outputs_after(model, x, y, 1, 4), rtol=0, atol=1e-5)


def test_eager_reference_refuses_a_model_with_active_dropout():
    """A random GPT-2 with its default dropout (0.1) differs from any pipeline run by ~0.3-1% of the loss
    (each rank draws its own masks): that once read as a bug of replicated last stages."""
    from models import gpt2

    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    with pytest.raises(ValueError, match="active dropout"):
        eager_training(gpt2(n_layer=1), inputs, None, None, 1, 2, ADAM)
    eager_training(
        gpt2(n_layer=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), inputs, None, None, 1, 2, ADAM
    )
    eager_training(gpt2(n_layer=1).eval(), inputs, None, None, 1, 2, ADAM)


class Autocast(torch.nn.Module):
    """``model`` whose forward runs under autocast, entered anew on every call: autocast caches its
    low-precision copies of the weights until its context exits, so one context around several
    optimizer steps would keep computing with the first step's weights."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, **inputs):
        with torch.autocast("cpu", self.dtype):
            return self.model(**inputs)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_matches_eager_under_the_same_autocast_and_sends_half_width(mlp_batch, precision):
    """fp16-mixed with a loss scale that neither overflows nor underflows here: scaling by a power of
    two and unscaling is exact, so it too equals eager autocast (which has no scaler)."""
    model, x, y = mlp_batch
    pipeline = _mlp_pipeline(
        model, x[:4], precision=precision, loss_scale={"init_scale": 256.0}, microbatches=2
    )
    result = run_local(pipeline, {"x": x}, y, F.mse_loss, steps=2, microbatches=2, optimizer=ADAM)
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    losses, _ = eager_training(Autocast(model, dtype), {"x": x}, y, F.mse_loss, 2, 2, ADAM)
    error = max(abs(got - want) / abs(want) for got, want in zip(result.losses, losses, strict=True))
    print(f"{precision}: max relative loss error {error:.2e}")
    assert error <= 1e-2, (result.losses, losses)
    assert all(grad.dtype == torch.float32 for grad in result.grads.values())  # fp32 master weights
    fp32 = planned_transfers(pipeline.stages, 2, 2)
    # the activation autocast made (relu of a bf16 linear) and its gradient cross in bf16: half the bytes
    assert result.stats[0]["bytes_sent"] == fp32[0]["bytes_sent"] // 2
    assert result.stats[1]["bytes_sent"] == fp32[1]["bytes_sent"] // 2


class SideInputMLP(torch.nn.Module):
    """Stage 1 also reads a model input ``z``: large values in it overflow the fp16 weight gradient of
    ``d`` on stage 1 only, while every gradient stage 0 sees stays finite."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.c, self.d = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x, z):
        return self.c(torch.relu(self.a(x))) + self.d(z)


@pytest.mark.slow
def test_fp16_step_is_skipped_on_every_rank_when_one_rank_overflows():
    torch.manual_seed(0)
    model = SideInputMLP()
    x, y, z = torch.randn(8, 8), torch.randn(8, 8), torch.full((8, 8), 4000.0)
    gm = export(model, kwargs={"x": x[:4], "z": z[:4]})
    stages = split_stages(gm, stages_by_module(gm, [("a", 0), ("c", 1), ("d", 1)]), 2)
    pipeline = Pipeline(stages, PipelineMeta(2, precision="fp16-mixed", loss_scale={"init_scale": 1.0}))
    result = run_local(pipeline, {"x": x, "z": z}, y, F.mse_loss, steps=3, microbatches=2, optimizer=ADAM)
    assert [record["skipped"] for record in result.records] == [True] * 3  # stage 1 found an inf ...
    assert result.grads == {}  # ... and every rank dropped its gradients, stage 0's finite ones too,
    assert result.losses[0] == result.losses[1] == result.losses[2]  # so neither stepped


def test_loss_scaler_skips_on_inf_halves_and_grows_after_good_steps():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    grads = [torch.tensor([8.0, 16.0]), torch.tensor([float("inf")])]
    assert scaler.unscale(grads) is True
    torch.testing.assert_close(grads[0], torch.tensor([1.0, 2.0]))
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0 and scaler.good_steps == 0
    assert scaler.unscale([torch.tensor([4.0])]) is False
    scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 8.0


@pytest.fixture
def one_rank(tmp_path):
    """This process as a world of one gloo rank (a single-stage pipeline needs no peers)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_recomputed_forward_updates_batchnorm_running_stats_once_like_eager():
    torch.manual_seed(0)
    model, x, y = SmallCNN().train(), torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    gm = export(model, (x[:2],))
    stage = split_stages(gm, {n.name: 0 for n in gm.graph.nodes if n.op == "call_function"}, 1)[0]
    layout = RankLayout.from_meta(PipelineMeta(1, microbatches=2, recompute=[True]))
    executor = StageExecutor(stage, Links(["cpu"], [], 30.0), 2, F.cross_entropy, layout=layout)
    inputs, targets = dict(enumerate({"x": part} for part in x.chunk(2))), dict(enumerate(y.chunk(2)))
    executor.run(inputs, targets, layout.actions("1f1b", 0))
    losses, grads = eager_training(model, {"x": x}, y, F.cross_entropy, 1, 2, ADAM)
    reference = copy.deepcopy(model)
    for part in x.chunk(2):  # the running statistics after one step: one update per microbatch
        reference(part)
    assert executor.transport.replaying is False and not executor.transport.received
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(executor.module.get_buffer(f"bn.{name}"), reference.bn.get_buffer(name))
    for local, name in stage.param_names.items():
        grad = executor.module.get_parameter(local).grad
        torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-5)


def test_stage_source_says_how_the_runtime_wraps_the_forward(mlp_batch):
    model, x, _ = mlp_batch
    stage = _mlp_pipeline(model, x[:2]).stages[1]
    header = stage_source(stage, recompute=True, precision="bf16-mixed").splitlines()[1]
    assert header.startswith("# forward runs under torch.autocast(bf16) and torch.utils.checkpoint")
    assert "forward runs under" not in stage_source(stage)


def test_layout_defaults_routing_and_checks():
    default = RankLayout.from_meta(PipelineMeta(2, microbatches=3))
    assert [p.vendor for p in default.ranks] == ["cpu", "cpu"] and default.precision == "fp32"
    assert default.routing == ((0, 0, 0), (0, 0, 0)) and default.recompute == (False, False)
    assert default.actions("1f1b", 1) == [a for a in default.actions("1f1b", 1)] and default.num_ranks == 2
    meta = PipelineMeta(2, microbatches=3, placement=ranks_for([1, 2]), routing=[[0, 0, 0], [1, 0, 1]])
    layout = RankLayout.from_meta(meta)
    assert layout.stage_ranks(1) == [1, 2] and layout.replica_groups() == [[1, 2]]
    assert [layout.rank_running(1, m) for m in range(3)] == [2, 1, 2]
    assert [str(a) for a in layout.actions("1f1b", 2)] == ["F0", "B0", "F2", "B2"]
    assert [str(a) for a in layout.actions("gpipe", 1)] == ["F1", "B1"]
    assert layout.holders((0, 1)) == [0, 1, 2]
    with pytest.raises(PlanFormatError, match=r"routing\[1\]: names a replica outside 0..1"):
        PipelineMeta(2, microbatches=2, placement=ranks_for([1, 2]), routing=[[0, 0], [0, 2]])
    with pytest.raises(PlanFormatError, match="unknown precision 'fp8'"):
        PipelineMeta(2, precision="fp8")


def test_layout_runs_the_weight_gradients_each_stage_defers():
    """zb-h1 ranks run the deferral the plan gives each stage; a record without one runs ZB-H1's (the
    replicas before the stage), and a record read from a file names a bad entry."""
    zb = PipelineMeta(3, schedule="zb-h1", microbatches=4, placement=ranks_for([1, 2, 1]),
                      routing=[[0] * 4, [0, 1, 0, 1], [0] * 4])  # fmt: skip
    assert zb.deferred == (0, 1, 3)  # ZB-H1's: the replicas before each stage
    assert (
        RankLayout.from_meta(zb).actions("zb-h1", 3)
        == stage_actions("zb-h1", 3, 4, replicas=[1, 2, 1], deferred=[0, 1, 3])[2]
    )
    capped = RankLayout.from_meta(replace(zb, deferred=(0, 0, 1)))
    assert [str(a) for a in capped.actions("zb-h1", 3)] == ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "F3",
                                                            "B3", "W2", "W3"]  # fmt: skip
    assert [str(a) for a in capped.actions("zb-h1", 1)] == ["F0", "F2", "B0", "W0", "B2", "W2"]
    where = Where("pipeline.json", error=PlanFormatError)
    record = json.loads(json.dumps(zb.to_json()))  # as pipeline.json holds it
    assert read_meta({k: v for k, v in record.items() if k != "deferred"}, 3, where).deferred == (0, 1, 3)
    with pytest.raises(PlanFormatError, match=r"pipeline.json: deferred\[1\]"):
        read_meta({**record, "deferred": [0, -1, 2]}, 3, where)
    with pytest.raises(PlanFormatError, match="deferred: 2 entries for 3 stages"):
        PipelineMeta(3, deferred=(0, 1))
    # run_local's schedule override: a 1F1B plan run as zb-h1 defers ZB-H1's; a zb-h1 plan keeps its own
    assert _run_meta(PipelineMeta(3, microbatches=4, deferred=(0, 0, 0)), "zb-h1", None).deferred == (0, 1, 2)
    assert _run_meta(replace(zb, deferred=(0, 0, 1)), "zb-h1", None).deferred == (0, 0, 1)


def test_layout_runs_the_warm_up_each_stage_was_planned():
    """Ranks run the forwards before the first backward that the record gives each stage (a record
    without them runs the schedule's own); a bad entry is named; a run under another schedule or
    microbatch count warms up by its own rule."""
    meta = PipelineMeta(3, schedule="zb-h2", microbatches=6, placement=ranks_for([1, 2, 1]),
                        routing=[[0] * 6, [0, 1] * 3, [0] * 6])  # fmt: skip
    assert meta.warmup == (6, 5, 1)  # ZB-H2's min(M, 2 x the replicas from the stage on - 1)
    tuned = RankLayout.from_meta(replace(meta, warmup=(5, 3, 1)))
    assert [str(a) for a in tuned.actions("zb-h2", 0)][:6] == ["F0", "F1", "F2", "F3", "F4", "B0"]
    assert tuned.actions("zb-h2", 1) == [
        a
        for a in stage_actions("zb-h2", 3, 6, replicas=[1, 2, 1], warmup=[5, 3, 1])[1]
        if a.microbatch % 2 == 0
    ]
    where = Where("pipeline.json", error=PlanFormatError)
    record = json.loads(json.dumps(meta.to_json()))
    assert read_meta({k: v for k, v in record.items() if k != "warmup"}, 3, where).warmup == (6, 5, 1)
    with pytest.raises(
        PlanFormatError, match=r"pipeline.json: warmup\[1\]: 2 forwards .* expected 3 \(1F1B's\)"
    ):
        read_meta({**record, "warmup": [6, 2, 1]}, 3, where)
    with pytest.raises(
        PlanFormatError, match=r"pipeline.json: warmup\[1\]: 6 forwards .* the stage before's 5"
    ):
        read_meta({**record, "warmup": [5, 6, 1]}, 3, where)  # stage 1 would wait on a forward stage 0 holds
    assert _run_meta(meta, "1f1b", None).warmup == (4, 3, 1)
    assert _run_meta(PipelineMeta(3, schedule="zb-h2", microbatches=6), None, 3).warmup == (3, 3, 1)
    assert _run_meta(replace(meta, warmup=(5, 3, 1)), "zb-h2", 6).warmup == (5, 3, 1)
