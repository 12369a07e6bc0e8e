import pytest
import torch
from models import MLP, gpt2, lm_kwargs, token_ids

import hetcc
from hetcc.errors import TraceError


def test_export_is_the_front_end_and_every_tensor_node_has_a_fake_value():
    traced = hetcc.trace(gpt2(), example_kwargs=lm_kwargs(token_ids(2, 8)))
    assert traced.frontend == "export"
    compute = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert compute and all("val" in n.meta for n in compute)
    assert all(
        n.meta.get("nn_module_stack")
        for n in compute
        if n.target is not torch.ops.aten._assert_tensor_metadata.default
    )


def test_a_trace_only_priced_records_no_source_lines_and_the_setting_is_restored():
    from hetcc.passes.trace import without_stack_traces

    x = torch.randn(4, 8)
    kept = [n for n in hetcc.trace(MLP(), (x,)).gm.graph.nodes if n.op == "call_function"]
    assert kept and all(n.meta.get("stack_trace") for n in kept)
    with pytest.raises(RuntimeError, match="inside"), without_stack_traces():
        dropped = [n for n in hetcc.trace(MLP(), (x,)).gm.graph.nodes if n.op == "call_function"]
        assert dropped and not any(n.meta.get("stack_trace") for n in dropped)
        raise RuntimeError("inside")
    assert not torch.fx.config.do_not_emit_stack_traces


def test_traced_graph_runs_equal_to_eager():
    model = gpt2().eval()
    kwargs = lm_kwargs(token_ids(2, 8))
    traced = hetcc.trace(model, example_kwargs=kwargs)
    torch.testing.assert_close(traced.gm(**kwargs)[0], model(**kwargs).logits)


def test_a_hugging_face_model_traces_without_use_cache_given():
    """hetcc passes use_cache=False itself (export cannot capture a returned DynamicCache), with a
    dict of dynamic shapes too (export wants an entry for every argument)."""
    kwargs = {"input_ids": token_ids(2, 8)}
    batch = torch.export.Dim("batch", min=1, max=4)
    for dynamic_shapes in (None, {"input_ids": {0: batch}}):
        traced = hetcc.trace(gpt2(), example_kwargs=kwargs, dynamic_shapes=dynamic_shapes)
        assert traced.frontend == "export"
        assert [n.target for n in traced.gm.graph.find_nodes(op="placeholder")] == ["input_ids", "use_cache"]
    assert set(traced.dim_symbols) == {"batch"}


def test_falls_back_to_symbolic_trace_when_export_rejects_the_model(monkeypatch):
    def reject(*args, **kwargs):
        raise RuntimeError("export says no")

    monkeypatch.setattr(torch.export, "export", reject)
    traced = hetcc.trace(MLP(), (torch.randn(3, 8),))
    assert traced.frontend == "symbolic_trace"
    shapes = {n.name: tuple(n.meta["val"].shape) for n in traced.gm.graph.nodes if n.op != "output"}
    assert shapes["fc2"] == (3, 4)
    analysis = hetcc.analyze(MLP(), (torch.randn(3, 8),))
    assert analysis.total_flops() == 2 * 3 * 8 * 16 + 2 * 3 * 16 * 4


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # the line the error must point at
            return x * 2
        return x


def test_trace_error_gives_both_causes_the_user_line_and_fixes():
    with pytest.raises(TraceError) as caught:
        hetcc.trace(DataDependent(), (torch.randn(4),))
    message = str(caught.value)
    assert "torch.export:" in message and "torch.fx.symbolic_trace:" in message
    assert "test_trace.py" in message and "if x.sum() > 0" in message
    assert "use_cache=False" in message


def test_meta_device_model_traces_without_real_weights():
    with torch.device("meta"):
        model = gpt2()
        ids = token_ids(2, 8, device="meta")
    analysis = hetcc.analyze(model, example_kwargs=lm_kwargs(ids))
    reference = hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(2, 8)))
    assert analysis.total_flops() == reference.total_flops()
    assert [b.act_bytes for b in analysis.blocks] == [b.act_bytes for b in reference.blocks]


def test_fake_tensor_mode_model_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = gpt2()
        ids = torch.randint(0, 128, (2, 8))
    analysis = hetcc.analyze(model, example_kwargs=lm_kwargs(ids))
    assert (
        analysis.total_flops()
        == hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(2, 8))).total_flops()
    )


def test_non_module_is_a_trace_error():
    with pytest.raises(TraceError, match="expects a torch.nn.Module"):
        hetcc.trace(lambda x: x, (torch.randn(2),))


def test_a_data_dependent_expert_loop_names_the_model_line_and_suggests_grouped_experts():
    from model_zoo import _mixtral_config
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM(_mixtral_config(experts_implementation="eager"))
    with pytest.raises(TraceError) as caught:
        hetcc.trace(model, example_kwargs=lm_kwargs(token_ids(2, 8)))
    text = str(caught.value)
    assert "modeling_mixtral.py:" in text and "for expert_idx in expert_hit" in text
    assert 'experts_implementation="grouped_mm"' in text
    assert text.count("for expert_idx") == 1  # the fallback's own error does not repeat export's line


def test_a_data_dependent_branch_in_user_code_names_the_users_line():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            for row in x.nonzero():  # a loop whose length only the data knows
                x = x + row.sum()
            return x

    with pytest.raises(TraceError) as caught:
        hetcc.trace(Branchy(), (torch.ones(3),))
    text = str(caught.value)
    assert "test_trace.py:" in text and "for row in x.nonzero()" in text
    assert "make the loop bound static" in text


def test_a_failed_export_prints_nothing_before_the_error(capfd):
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(TraceError, match="loops or branches on tensor values"):
        hetcc.trace(Branchy(), (torch.ones(3),))
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and "symbolic_shapes" not in err  # torch's graph and warning


def test_a_transformers_models_capture_error_is_whole_sentences_and_names_no_unrelated_cause():
    """symbolic_trace cannot follow a whole transformers model, so its error is no second cause; the
    export error is cut after a whole sentence, not mid-sentence."""
    with pytest.raises(TraceError) as caught:
        hetcc.trace(gpt2(), example_kwargs={"input_ids": token_ids(2, 8), "use_cache": True})  # a cache out
    text = str(caught.value)
    assert "symbolic_trace" not in text and "co_varnames" not in text
    export_line = next(line for line in text.splitlines() if line.strip().startswith("torch.export:"))
    assert "DynamicCache" in export_line and export_line.rstrip().endswith("."), export_line


def test_a_long_error_line_is_cut_after_its_last_whole_sentence():
    from hetcc.passes.trace import _first_line

    error = RuntimeError("First sentence here. " * 10 + "If you do not need it, please " + "x " * 200)
    cut = _first_line(error)
    assert len(cut) <= 300 and cut.endswith("First sentence here.")
