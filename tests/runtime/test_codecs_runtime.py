"""Codecs on real ranks: a GPT-2 split over a slow link, every cut's activations sent as int8 and their
gradients as bf16, on CPU ranks (gloo). What crosses is what one process computes with the same stages,
the bytes each rank moves are the payloads the plan predicts, and the run trains."""

from __future__ import annotations

import json
import math

import pytest
import torch
from models import eager_training, gpt2, token_ids
from runtime_models import planned_transfers, run_in_process, slow_cards

import hetcc
from hetcc.solver.codecs import wire_bytes_per_step

PINS = {"intra-node": ("int8", "bf16"), "inter-node": ("int8", "bf16")}
ADAM = {"name": "adam", "lr": 0.01}
STEPS = 2


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """A 4-layer GPT-2 whose state fits 80% per card: two or three stages, int8/bf16 codecs
    pinned on every cut."""
    model = gpt2(n_layer=4, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(8, 32)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    state = sum(p.numel() * 4 for p in model.parameters()) * 4
    cluster = tmp_path_factory.mktemp("codecs") / "cluster.yaml"
    cluster.write_text(slow_cards([2, 1], int(state * 0.8), inter_node="10 Mb/s"))
    compiled = hetcc.compile(  # 1F1B: codecs are planned on one stage per device
        model, cluster, example_kwargs=inputs, microbatches=4, compress=PINS, replicate=False, schedule="1f1b"
    )
    return model, inputs, compiled, cluster


@pytest.fixture(scope="module")
def coded_run(coded):
    _, inputs, compiled, _ = coded
    return hetcc.run_local(compiled, inputs, steps=STEPS, optimizer=ADAM)


@pytest.mark.slow
def test_coded_pipeline_moves_the_predicted_payloads_and_trains(coded, coded_run):
    model, inputs, compiled, _ = coded
    stages = compiled.pipeline.stages
    assert len(stages) >= 2, compiled.explain()
    assert all(
        e.codec == "int8" and e.grad_codec == "bf16" for s in stages for e in s.sends if e.requires_grad
    )
    result = coded_run

    # bytes on the wire: each rank's are its edges' payloads, and together the plan's prediction
    planned = planned_transfers(stages, compiled.plan.microbatches, STEPS)
    for rank, expected in enumerate(planned):
        assert {k: result.stats[rank][k] for k in expected} == expected, rank
    forward, back = wire_bytes_per_step(compiled.problem, compiled.solution)
    assert sum(stats["bytes_sent"] for stats in result.stats) == STEPS * (forward + back)
    raw = sum(math.prod(e.shape) * e.dtype.itemsize for s in stages for e in s.sends)
    assert forward < 0.3 * raw * compiled.plan.microbatches  # int8: a quarter of fp32, plus scales

    # it trains like eager within what int8 activations cost (about 1% per cut)
    losses, _ = eager_training(model, inputs, None, None, steps=STEPS, microbatches=4, optimizer=ADAM)
    assert result.losses == pytest.approx(losses, rel=2e-2)
    assert result.losses[-1] < result.losses[0]


@pytest.mark.slow
def test_encode_send_decode_across_ranks_equals_encode_decode_in_one_process(coded):
    _, inputs, compiled, _ = coded
    result = hetcc.run_local(compiled, inputs, steps=1, optimizer={"name": "sgd", "lr": 0.0})
    microbatch = {k: v.chunk(4)[0] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    in_process = run_in_process(compiled.pipeline.stages, microbatch)
    logits = result.outputs[1]  # (loss, logits), the logits concatenated over microbatches
    rows = len(microbatch["input_ids"])
    torch.testing.assert_close(logits[:rows], in_process[1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"schedule": "zb-h1"}, {"recompute": True}, {"precision": "bf16-mixed"}],
    ids=["zb-h1", "recompute", "bf16-mixed"],
)
def test_codecs_run_under_every_schedule_recompute_and_autocast(coded, coded_run, options):
    """The split backward (B sends the encoded gradient, W runs later), a recomputed forward (the recv
    replays the kept payload, the encode runs again and sends nothing) and autocast (a bf16 activation
    encodes to the same payload size) train as the 1F1B run does."""
    model, inputs, compiled, cluster = coded
    other = hetcc.compile(model, cluster, example_kwargs=inputs, microbatches=4, compress=PINS, replicate=False,
                          **{"schedule": "1f1b", **options})  # fmt: skip
    assert [s.codecs for s in other.plan.stages[:-1]] == [("int8", "bf16")] * (len(other.plan.stages) - 1)
    result = hetcc.run_local(other, inputs, steps=STEPS, optimizer=ADAM)
    if "precision" in options:  # autocast: close to fp32's, and training
        losses, _ = eager_training(model, inputs, None, None, steps=STEPS, microbatches=4, optimizer=ADAM)
        assert result.losses == pytest.approx(losses, rel=3e-2) and result.losses[-1] < result.losses[0]
        return
    same_split = [s.blocks for s in other.plan.stages] == [s.blocks for s in compiled.plan.stages]
    assert result.losses == pytest.approx(coded_run.losses, rel=1e-5 if same_split else 2e-2)


def test_a_pipeline_json_whose_ends_disagree_on_a_codec_is_refused(coded, tmp_path):
    """A gradient crosses without a header: both ends' records of an edge must agree before any rank runs."""
    from hetcc.errors import PlanFormatError
    from hetcc.runtime.store import load_pipeline

    _, inputs, compiled, _ = coded
    compiled.save(tmp_path / "build", inputs=inputs)
    path = tmp_path / "build" / "pipeline.json"
    document = json.loads(path.read_text())
    recv = document["stages"][1]["recvs"][0]
    recv["grad_codec"] = "none" if recv["grad_codec"] != "none" else "bf16"
    path.write_text(json.dumps(document))
    with pytest.raises(
        PlanFormatError, match=r"stages\[1\]\.recvs\[0\].*grad_codec differ from stage 0's send"
    ):
        load_pipeline(str(tmp_path / "build"))
