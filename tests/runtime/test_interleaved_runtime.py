"""Interleaved 1F1B on the runtime: a rank runs several stages (one per chunk, ``RankPlacement.chunks``)
in the order ``schedules.interleaved_actions`` gives it, and trains exactly like eager PyTorch, with
recomputation, tied weights (on one rank and across ranks), mixed precision, evaluations and checkpoints.

Runs compare with eager training in one process (``models.eager_training``): fp32 to 1e-5 relative in
the loss and 1e-4 in every gradient, bf16-mixed to 1e-2 relative in the loss against eager under the same
``torch.autocast``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import eager_training, gpt2, token_ids
from runtime_models import export, slow_cards, stages_by_module, tiny_gpt2

import hetcc
from hetcc.errors import PlanFormatError
from hetcc.passes.comm import split_stages
from hetcc.runtime.contract import PipelineMeta
from hetcc.runtime.layout import RankLayout
from hetcc.runtime.placement import RankPlacement, interleaved_ranks, ranks_for, zbv_ranks
from hetcc.runtime.store import Pipeline
from hetcc.solver.schedules import INTERLEAVED, ZBV, interleavable, interleaved_actions, zbv_actions
from hetcc.train import checkpoint as ckpt
from hetcc.train.local import run_local

ADAM = {"name": "adam", "lr": 0.01}


class SharedDeep(torch.nn.Module):
    """Four layers; the first and the third are one module (a weight tied between stages 0 and 2, which
    interleaving over two ranks puts on one rank)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.l0, self.l1, self.l3 = (torch.nn.Linear(width, width) for _ in range(3))
        self.l2 = self.l0

    def forward(self, x):
        for layer in (self.l0, self.l1, self.l2, self.l3):
            x = torch.tanh(layer(x))
        return x


def _deep_pipeline(microbatch: torch.Tensor, **meta) -> tuple[torch.nn.Module, Pipeline]:
    torch.manual_seed(0)
    model = SharedDeep()
    gm = export(model, kwargs={"x": microbatch})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # a linear and a tanh per layer
    assert len(calls) == 8
    stages = split_stages(gm, {node.name: i // 2 for i, node in enumerate(calls)}, 4)
    return model, Pipeline(
        stages, PipelineMeta(4, schedule=INTERLEAVED, placement=interleaved_ranks(2, 2), **meta)
    )


def _check_fp32(result, reference, aliases: set[str]) -> None:
    """Losses and gradients equal eager's; a tied weight is reported once (eager has it under ``aliases``
    too)."""
    losses, grads = reference
    error = max(abs(got - want) / abs(want) for got, want in zip(result.losses, losses, strict=True))
    assert error <= 1e-5, (result.losses, losses)
    assert set(grads) - set(result.grads) == aliases and set(result.grads) <= set(grads)
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
def test_interleaved_with_a_tied_weight_on_one_rank_and_recompute_trains_like_eager():
    """Rank 0 runs stages 0 and 2, which hold one tied weight: its two copies get the sum of their
    gradients and stay equal; stage 1 recomputes its forward. Evaluations run the interleaved forwards."""
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    model, pipeline = _deep_pipeline(x[:2], microbatches=4, recompute=[False, True, False, False])
    assert [group.stages for group in pipeline.stages[0].tied] == [(0, 2), (0, 2)]  # weight, bias
    result = run_local(
        pipeline,
        {"x": x},
        y,
        F.mse_loss,
        steps=3,
        optimizer=ADAM,
        eval_data=[{"x": x, "targets": y}],
        eval_every=3,
    )
    _check_fp32(result, eager_training(model, {"x": x}, y, F.mse_loss, 3, 4, ADAM), {"l2.weight", "l2.bias"})
    assert result.stats[1]["replayed"] > 0 and result.stats[0]["replayed"] == 0
    ((step, loss),) = result.eval_losses
    assert step == 2  # after the third step
    assert loss == pytest.approx(float(F.mse_loss(_trained(model, x, y, 3), y)), rel=1e-5)


def _trained(model, x, y, steps: int) -> torch.Tensor:
    """The outputs on ``x`` after ``steps`` eager Adam steps of 4 microbatches."""
    import copy

    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=ADAM["lr"])
    for _ in range(steps):
        optimizer.zero_grad()
        sum(F.mse_loss(model(a), b) / 4 for a, b in zip(x.chunk(4), y.chunk(4))).backward()
        optimizer.step()
    return model(x).detach()


@pytest.mark.slow
def test_interleaved_gpt2_with_a_weight_tied_across_ranks_trains_like_eager():
    """wte (stage 0, rank 0) and lm_head (stage 3, rank 1) are one parameter; each transformer block is a
    stage, and M = 6 runs in two rounds of three (torch's rounds)."""
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(1))
    gm = export(model, kwargs={"input_ids": ids[:2], "labels": ids[:2].clone(), "use_cache": False})
    rules = [("transformer.wte", 0), ("transformer.wpe", 0), ("transformer.drop", 0), ("transformer.h.0", 1),
             ("transformer.h.1", 2), ("transformer.ln_f", 3), ("lm_head", 3)]  # fmt: skip
    stages = split_stages(gm, stages_by_module(gm, rules), 4)
    meta = PipelineMeta(4, schedule=INTERLEAVED, microbatches=6, placement=interleaved_ranks(2, 2))
    inputs = {"input_ids": ids, "labels": ids}
    result = run_local(Pipeline(stages, meta), inputs, steps=2, optimizer=ADAM)
    assert "transformer.wte.weight" in result.grads
    _check_fp32(
        result,
        eager_training(model, {**inputs, "use_cache": False}, None, None, 2, 6, ADAM),
        {"lm_head.weight"},
    )


class Autocast(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16):
            return self.model(x)


@pytest.mark.slow
def test_interleaved_bf16_mixed_and_checkpoints_resume_bit_identically(tmp_path):
    """bf16-mixed equals eager under the same autocast; a run stopped after two steps and resumed from its
    checkpoint (each stage's weights and its part of its rank's optimizer state in its own files) ends
    where an uninterrupted run does, and ``hetcc.export`` merges the stages' weights."""
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    model, pipeline = _deep_pipeline(x[:4], microbatches=2, precision="bf16-mixed")

    def run(folder, steps, **options):
        return run_local(pipeline, {"x": x}, y, F.mse_loss, steps=steps, optimizer=ADAM,
                         checkpoint_dir=tmp_path / folder, checkpoint_every=1, **options)  # fmt: skip

    straight = run("straight", 3)
    losses, _ = eager_training(Autocast(model), {"x": x}, y, F.mse_loss, 3, 2, ADAM)
    error = max(abs(got - want) / abs(want) for got, want in zip(straight.losses, losses, strict=True))
    assert error <= 1e-2, (straight.losses, losses)
    run("stopped", 2)
    resumed = run("stopped", 1, resume=True)
    assert resumed.first_step == 2 and resumed.losses == straight.losses[2:]
    want, got = hetcc.export(tmp_path / "straight"), hetcc.export(tmp_path / "stopped")
    assert set(got) == set(want) >= {"l0.weight", "l1.weight", "l3.bias"}
    assert all(torch.equal(got[name], want[name]) for name in want)
    for stage in range(4):  # each stage's file holds the optimizer state of its own parameters
        a = ckpt.load_checkpoint(tmp_path / "straight", stage, 3)["optimizer"]
        b = ckpt.load_checkpoint(tmp_path / "stopped", stage, 3)["optimizer"]
        assert len(a["state"]) == len(pipeline.stages[stage].param_names) == 2
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


class Deep(torch.nn.Module):
    """Eight layers; the first and the last are one module (a weight tied across ranks 0 and 3)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(7))

    def forward(self, x):
        for layer in (*self.layers, self.layers[0]):
            x = torch.tanh(layer(x))
        return x


@pytest.mark.slow
def test_interleaved_over_four_ranks_trains_like_eager():
    """Four ranks of two stages each (every rank pair exchanging several stages' messages), M = 4 in one
    round, stage 5 recomputing, the first layer's weight tied to the last's."""
    torch.manual_seed(0)
    model, x, y = Deep(), torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    gm = export(model, kwargs={"x": x[:2]})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # a linear and a tanh per layer
    stages = split_stages(gm, {node.name: i // 2 for i, node in enumerate(calls)}, 8)
    recompute = [k == 5 for k in range(8)]
    meta = PipelineMeta(
        8, schedule=INTERLEAVED, microbatches=4, placement=interleaved_ranks(4, 2), recompute=recompute
    )
    result = run_local(Pipeline(stages, meta), {"x": x}, y, F.mse_loss, steps=2, optimizer=ADAM)
    _check_fp32(result, eager_training(model, {"x": x}, y, F.mse_loss, 2, 4, ADAM), set())
    assert result.stats[1]["replayed"] > 0  # rank 1 runs stage 5


@pytest.mark.slow
def test_interleaved_replicated_whole_trains_like_eager():
    """Four ranks: two pipeline positions of four stages each (v = 4), each on two replicas that run every
    other microbatch (M = 8, four each, in two rounds); stage 5 recomputes, and the first layer's weight is
    tied to the last's, stages 0 and 7 on the two positions: its gradient is summed over all four ranks."""
    torch.manual_seed(0)
    model, x, y = Deep(), torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.randn(16, 8)
    gm = export(model, kwargs={"x": x[:2]})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # a linear and a tanh per layer
    stages = split_stages(gm, {node.name: i // 2 for i, node in enumerate(calls)}, 8)
    meta = PipelineMeta(
        8, schedule=INTERLEAVED, microbatches=8, placement=interleaved_ranks(2, 4, replicas=2),
        routing=[[m % 2 for m in range(8)]] * 8, recompute=[k == 5 for k in range(8)],
    )  # fmt: skip
    result = run_local(Pipeline(stages, meta), {"x": x}, y, F.mse_loss, steps=2, optimizer=ADAM)
    _check_fp32(result, eager_training(model, {"x": x}, y, F.mse_loss, 2, 8, ADAM), set())
    replayed = [stats["replayed"] for stats in result.stats]
    assert replayed[0] == replayed[1] == 0 and replayed[2] > 0 and replayed[3] > 0  # position 1 runs stage 5


def test_each_replica_of_an_interleaved_pipeline_runs_its_own_microbatches_in_rounds():
    routing = [[m % 2 for m in range(8)]] * 4
    meta = PipelineMeta(4, schedule=INTERLEAVED, microbatches=8, placement=interleaved_ranks(2, 2, replicas=2),
                        routing=routing)  # fmt: skip
    layout = RankLayout.from_meta(meta)
    assert [(p.stage, p.replica, p.stages) for p in layout.ranks] == [
        (0, 0, (0, 2)), (0, 1, (0, 2)), (1, 0, (1, 3)), (1, 1, (1, 3))
    ]  # fmt: skip
    odd = {m: 2 * m + 1 for m in range(4)}  # replica 1 runs microbatches 1, 3, 5, 7 as its 0..3
    assert layout.actions(INTERLEAVED, 3) == [
        type(a)(a.kind, odd[a.microbatch], a.chunk) for a in interleaved_actions(2, 2, 4)[1]
    ]
    assert [layout.rank_running(k, 5) for k in range(4)] == [1, 3, 1, 3]
    assert layout.replica_groups() == [[0, 1], [2, 3]]  # each once, for both of a rank's stages


def test_each_rank_runs_its_row_of_the_interleaved_order_on_its_chunks_stages():
    meta = PipelineMeta(6, schedule=INTERLEAVED, microbatches=4, placement=interleaved_ranks(2, 3))
    layout = RankLayout.from_meta(meta)
    assert [p.stages for p in layout.ranks] == [(0, 2, 4), (1, 3, 5)]
    assert layout.actions(INTERLEAVED, 1) == interleaved_actions(2, 3, 4)[1]
    assert layout.actions(INTERLEAVED, 0, training=False) == interleaved_actions(2, 3, 4, training=False)[0]
    assert [layout.rank_running(k, 3) for k in range(6)] == [0, 1, 0, 1, 0, 1]
    assert layout.holders([2, 5]) == [0, 1] and layout.holders([4]) == [0]


@pytest.mark.parametrize(
    ("stages", "changes", "message"),
    [
        (4, {"placement": interleaved_ranks(2, 2), "microbatches": 1}, r"1 microbatches over 2 positions, \[1\]"),
        (4, {"placement": (RankPlacement(0, 0, chunks=(0, 1)), RankPlacement(1, 2, chunks=(2, 3)))},
         r"rank 0 runs stages \[0, 1\]"),
        (3, {"placement": interleaved_ranks(1, 3)}, "2 positions or more"),
        (4, {"placement": interleaved_ranks(2, 2, replicas=2)[:3], "routing": [[0, 1, 0, 1]] * 2 + [[0] * 4] * 2},
         "rank 0 runs stages .* on the same number of replicas"),
        (4, {"placement": interleaved_ranks(2, 2, replicas=2), "routing": [[0, 1, 0, 1]] * 3 + [[1, 0, 1, 0]]},
         "runs the same microbatches at every stage"),
        (4, {"placement": interleaved_ranks(2, 2, replicas=2), "routing": [[0, 0, 0, 1]] * 4},
         r"4 microbatches over 2 positions, \[3, 1\] per replica"),
        (4, {"placement": tuple(RankPlacement(r, r // 2, tensor=r % 2, chunks=(r // 2, r // 2 + 2)) for r in range(4))},
         "runs its stages whole"),
    ],
)  # fmt: skip
def test_an_interleaved_record_that_does_not_run_is_refused(stages, changes, message):
    with pytest.raises(PlanFormatError, match=message):
        PipelineMeta(stages, schedule=INTERLEAVED, **{"microbatches": 4, **changes})


def test_a_rank_of_several_stages_needs_the_interleaved_schedule():
    with pytest.raises(PlanFormatError, match="only under 'interleaved-1f1b'"):
        PipelineMeta(4, schedule="1f1b", microbatches=4, placement=interleaved_ranks(2, 2))
    with pytest.raises(PlanFormatError, match="its stage \\(1\\) first"):
        PipelineMeta(2, placement=(RankPlacement(0, 1, chunks=(0, 1)),), schedule=INTERLEAVED)
    assert PipelineMeta(2, placement=ranks_for([1, 1])).placement[1].stages == (1,)


def _messages(rows: list, ranks: int, chunks: int) -> tuple[dict, dict]:
    """Per directed rank pair, the messages its sender posts and its receiver takes, in order: a forward
    takes its input at its start and sends its output at its end, a backward likewise with gradients."""
    last, posted, taken = ranks * chunks - 1, {}, {}
    for rank, row in enumerate(rows):
        for action in row:
            k, step = action.chunk * ranks + rank, 1 if action.kind == "F" else -1
            if 0 <= k - step <= last:  # what it takes from the stage before it (after, for a backward)
                taken.setdefault(((k - step) % ranks, rank), []).append(
                    (action.kind, action.microbatch, k - step)
                )
            if 0 <= k + step <= last:
                posted.setdefault((rank, (k + step) % ranks), []).append((action.kind, action.microbatch, k))
    return posted, taken


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_every_rank_pair_posts_and_takes_its_messages_in_one_order(ranks):
    """Messages between two ranks pair up by their order (``runtime.groups``): under the interleaved order
    the several stage pairs two ranks share still post and take them alike, for any M it takes."""
    for chunks in (2, 3, 4):
        for microbatches in (m for m in range(ranks, 3 * ranks + 1) if interleavable(ranks, m)):
            posted, taken = _messages(interleaved_actions(ranks, chunks, microbatches), ranks, chunks)
            assert posted == taken, (chunks, microbatches)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_zbv_trains_like_eager(ranks):
    """ZB-V: rank r runs stages r and 2p - 1 - r, every backward split into B and W. Two ranks: the first
    layer's weight is tied to the third's (stages 0 and 2, on ranks 0 and 1); four ranks: to the last's
    (stages 0 and 7, both on rank 0). One stage recomputes; M = 4, fewer than ZB-V's 2p - 1 on four ranks.
    Rank pairs exchange several stage pairs' messages out of their posted order, each pair on its own
    channel, and the last rank hands the V's turn from one of its stages to the other in memory."""
    torch.manual_seed(0)
    model = SharedDeep() if ranks == 2 else Deep()
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    gm = export(model, kwargs={"x": x[:2]})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]  # a linear and a tanh per layer
    stages = split_stages(gm, {node.name: i // 2 for i, node in enumerate(calls)}, 2 * ranks)
    meta = PipelineMeta(
        2 * ranks, schedule=ZBV, microbatches=4, placement=zbv_ranks(ranks),
        recompute=[k == 1 for k in range(2 * ranks)],
    )  # fmt: skip
    result = run_local(Pipeline(stages, meta), {"x": x}, y, F.mse_loss, steps=2, optimizer=ADAM)
    aliases = {"l2.weight", "l2.bias"} if ranks == 2 else set()
    _check_fp32(result, eager_training(model, {"x": x}, y, F.mse_loss, 2, 4, ADAM), aliases)
    assert result.stats[1]["replayed"] > 0  # rank 1 runs stage 1


def test_zbv_ranks_run_their_rows_and_keep_an_order_per_stage_pair():
    meta = PipelineMeta(6, schedule=ZBV, microbatches=5, placement=zbv_ranks(3))
    layout = RankLayout.from_meta(meta)
    assert [p.stages for p in layout.ranks] == [(0, 5), (1, 4), (2, 3)]
    assert all(layout.actions(ZBV, r) == zbv_actions(3, 5)[r] for r in range(3))
    channels = layout.channels(ZBV)
    assert (0, 1, 0, 1) in channels and (1, 0, 4, 5) in channels and (1, 2, 1, 2) in channels
    assert not any(a == b for a, b, _, _ in channels)  # stages 2 and 3 share rank 2: handed over in memory
    # only the pairs that talk: a chain, and a skip from stage 0 to stage 4 (say, an attention mask)
    peers = [{1, 4}, {0, 2}, {1, 3}, {2, 4}, {0, 3, 5}, {4}]
    assert layout.channels(ZBV, peers) == [
        (0, 1, 0, 1),
        (0, 1, 0, 4),
        (1, 2, 1, 2),
        (2, 1, 3, 4),
        (1, 0, 4, 5),
    ]
    assert len(channels) == 12  # of the 15 pairs, all but the three on one rank
    assert layout.channels(INTERLEAVED) == []
    with pytest.raises(PlanFormatError, match=r"rank 0 runs stages \[0, 2\] .* stages r and 2p - 1 - r"):
        PipelineMeta(4, schedule=ZBV, microbatches=4, placement=interleaved_ranks(2, 2))


@pytest.mark.slow
def test_tensor_parallel_auto_keeps_and_trains_an_interleaved_plan_where_degree_one_wins(tmp_path):
    """Two nodes of two slow cards on a 1 Gb/s link, a 6-layer GPT-2 in 4 microbatches: no tensor degree
    pays, and interleaving (each card several stages) beats one stage per card; ``tensor_parallel="auto"``
    keeps that plan, as ``False`` would, and it trains like eager."""
    model = gpt2(n_layer=6, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 16)
    cluster = tmp_path / "cards.yaml"
    cluster.write_text(slow_cards([2, 2], 2**30, inter_node="1 Gb/s").replace("20 GFLOP/s", "1 GFLOP/s"))
    inputs = {"input_ids": ids, "labels": ids}
    compiled = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=4, tensor_parallel="auto")
    plan = compiled.plan
    assert plan.schedule == INTERLEAVED and all(s.tensor == 1 for s in plan.stages), plan.notes
    assert len(plan.stages) > plan.ranks and "tensor parallel: degrees priced 2" in " ".join(plan.notes)
    result = hetcc.run_local(compiled, inputs, steps=2, optimizer=ADAM)
    _check_fp32(
        result,
        eager_training(model, {**inputs, "use_cache": False}, None, None, 2, 4, ADAM),
        {"lm_head.weight"},
    )
