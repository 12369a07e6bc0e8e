"""Codecs on the wire as the planner and the comm pass see them: ``compress=`` read and checked, the
problem's codec rows priced from the cut tensors' shapes, the stage code that encodes and decodes."""

from __future__ import annotations

import pytest
import torch
from models import gpt2, token_ids

import hetcc
from hetcc.errors import PlanFormatError
from hetcc.passes.compress import DEFAULT_BUDGET, compress_spec
from hetcc.wire import get_codec

SLOW_LINKS = "examples/clusters/mixed_a100_t4.yaml"


def test_compress_reads_off_auto_and_pins():
    assert compress_spec("off").off and compress_spec(None).off
    assert compress_spec("auto").budget == DEFAULT_BUDGET
    spec = compress_spec({"inter-node": "int8", "h.1": ("int4", "bf16"), "budget": {"activations": "fp8"}})
    assert spec.links == {"inter-node": ("int8", "none")}
    assert spec.cuts == {"h.1": ("int4", "bf16")}
    assert spec.budget == ("fp8", "none")


@pytest.mark.parametrize(
    ("compress", "match"),
    [
        ("fast", "compress must be 'off', 'auto' or a dict"),
        ({"inter-node": "int3"}, "int3"),
        ({"inter-node": ("int8",)}, "codec name or an"),
        ({"h.99": "int8"}, "neither 'budget'"),
    ],
)
def test_bad_compress_names_what_is_wrong(compress, match):
    with pytest.raises(PlanFormatError, match=match):
        compress_spec(compress, ["h.0", "h.1"])


@pytest.fixture(scope="module")
def tiny_gpt2():
    model = gpt2(n_layer=2, n_embd=64, vocab=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = token_ids(4, 32)
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def test_pinned_codecs_become_encode_and_decode_ops_in_the_stage_code(tiny_gpt2):
    model, inputs = tiny_gpt2
    pins = {"intra-node": ("int8", "bf16"), "inter-node": ("int8", "bf16")}
    compiled = hetcc.compile(model, SLOW_LINKS, example_kwargs=inputs, microbatches=2, compress=pins,
                             replicate=False)  # fmt: skip
    stages = compiled.pipeline.stages
    assert len(stages) >= 2, compiled.explain()
    coded = [e for s in stages for e in s.sends if e.codec != "none"]
    assert coded and all(e.codec == "int8" and e.grad_codec in ("bf16", "none") for e in coded)
    for edge in coded:  # each coded edge: encode -> send(payload, source=x) and recv -> decode
        sender = stages[edge.src].module.code
        receiver = stages[edge.dst].module.code
        assert f"encode_{edge.value} = torch.ops.hetcc.encode.default(" in sender
        assert f"source = {edge.value}" in sender
        payload = get_codec("int8").payload_bytes(edge.shape)
        assert f"[{payload}], torch.uint8" in receiver and f"decode_{edge.value} = " in receiver
    # the plan's table and notes say what each cut sends, before and after
    text = compiled.explain()
    assert "int8/bf16" in text and "MiB/mb" in text


def test_off_plans_and_prints_exactly_as_before(tiny_gpt2):
    model, inputs = tiny_gpt2
    plain = hetcc.compile(model, SLOW_LINKS, example_kwargs=inputs, microbatches=2)
    assert all(s.codecs == ("none", "none") for s in plain.plan.stages)
    assert all("hetcc.encode" not in s.module.code for s in plain.pipeline.stages)
    assert "codecs" not in plain.explain()


def test_codec_rows_price_the_cut_tensors(tiny_gpt2):
    model, inputs = tiny_gpt2
    compiled = hetcc.compile(model, SLOW_LINKS, example_kwargs=inputs, microbatches=2, compress="auto")
    problem = compiled.problem
    names = {(row.name, row.gradient) for row in problem.codecs}
    assert ("int8", False) in names and ("bf16", True) in names and ("none", False) in names
    assert ("int4", False) not in names and ("int8", True) not in names  # the default budget
    int8 = next(r for r in problem.codecs if r.name == "int8" and not r.gradient)
    for cut, raw in enumerate(problem.cut_bytes):
        assert int8.cut_bytes[cut] <= raw
        assert int8.coded_bytes[cut] > 0 or int8.cut_bytes[cut] == raw
    # a [2, 32, 64] fp32 hidden state: 16 KiB raw, its int8 payload 4096 bytes + 32 tiles' fp32 scales
    assert get_codec("int8").payload_bytes((2, 32, 64)) == 4096 + 32 * 4
    hidden = 2 * 32 * 64 * torch.float32.itemsize
    assert any(int8.cut_bytes[cut] == raw - hidden + 4096 + 128 for cut, raw in enumerate(problem.cut_bytes))


def test_dump_report_and_replay_show_each_cut_before_and_after(tiny_gpt2, tmp_path):
    from hetcc.report import load

    model, inputs = tiny_gpt2
    pins = {"intra-node": ("int8", "bf16"), "inter-node": ("int4", "bf16")}
    compiled = hetcc.compile(model, SLOW_LINKS, example_kwargs=inputs, microbatches=2, compress=pins,
                             replicate=False, dump_dir=tmp_path)  # fmt: skip
    comm = next(tmp_path.glob("*_comm.txt")).read_text()
    assert "(as int8, grad bf16)" in comm or "(as int4, grad bf16)" in comm
    assert "forward 16 KiB -> " in comm and "per microbatch" in comm
    assert "codecs (act/grad)" in (tmp_path / "report.html").read_text()
    saved = load(tmp_path)  # the report's replay runs the plan's own codecs: the plan's step
    assert saved.simulation.step_time_s == pytest.approx(compiled.plan.step_time_s, rel=1e-12)


def test_a_tensor_without_gradient_crosses_whole():
    """A mask or gate selects; a lossy codec would change what it selects, not only round it."""
    from hetcc.passes.comm import wire_codecs

    assert wire_codecs((64, 64), torch.float32, True, "int8", "bf16") == ("int8", "bf16")
    assert wire_codecs((64, 64), torch.float32, False, "int8", "bf16") == ("none", "none")
    assert wire_codecs((4, 4), torch.float32, True, "int8", "bf16") == ("none", "none")  # too small to pay


def test_auto_plans_report_their_own_simulated_gap(tiny_gpt2):
    model, inputs = tiny_gpt2
    plan = hetcc.compile(model, SLOW_LINKS, example_kwargs=inputs, microbatches=2, compress="auto").plan
    assert plan.gap == pytest.approx(plan.step_time_s / plan.lower_bound_s - 1, rel=1e-9)
    assert any(note.startswith("compress:") for note in plan.notes)
