import pytest
import torch
from models import assert_chain_in_compute_order, bert, gpt2, llama, lm_kwargs, token_ids

import hetcc
from hetcc.ir import info
from hetcc.passes.partition import tied_grad_bytes


@pytest.fixture(scope="module")
def gpt2_12(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dump")
    with torch.device("meta"):
        model = gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257)
    ids = token_ids(2, 64, vocab=50257, device="meta")
    return hetcc.analyze(model, example_kwargs=lm_kwargs(ids), dump_dir=folder), folder


def test_gpt2_12_has_embed_twelve_layers_and_head(gpt2_12):
    analysis, _ = gpt2_12
    assert [b.name for b in analysis.blocks] == ["embed"] + [f"transformer.h.{i}" for i in range(12)] + [
        "head"
    ]


def test_cut_between_layers_is_the_residual_stream_alone_the_mask_is_rematerialised(gpt2_12):
    analysis, folder = gpt2_12
    residual = 2 * 64 * 768 * 4
    layer3 = analysis.blocks[4]
    assert [c.bytes for c in layer3.cut_tensors] == [residual]  # not the causal mask every layer reads
    assert layer3.cut_tensors[0].grad and layer3.cut_grad_bytes == residual
    assert layer3.cut_bytes == residual
    text = (folder / "04_blocks.txt").read_text()
    for cut in layer3.cut_tensors:
        assert f"%{cut.node} " in text
    assert "lm_head.weight" in text  # the tied weight is reported


@pytest.mark.parametrize("build", [gpt2, llama, bert], ids=["gpt2", "llama", "bert"])
def test_blocks_are_contiguous_and_dependencies_only_go_forward(build):
    kwargs = {"input_ids": token_ids(2, 16)}
    if build is not bert:
        kwargs["use_cache"] = False
    analysis = hetcc.analyze(build(), example_kwargs=kwargs)
    assert_chain_in_compute_order(analysis.graph)
    assert len(analysis.blocks) == 4  # embed, 2 layers, head


def test_llama_rotary_cos_sin_and_mask_are_recomputed_not_carried_to_every_layer():
    analysis = hetcc.analyze(llama(layers=3), example_kwargs=lm_kwargs(token_ids(2, 16)))
    first_layer = analysis.blocks[1]
    residual = 2 * 16 * 64 * 4
    assert [(c.bytes, c.last_block, c.grad) for c in first_layer.cut_tensors] == [
        (residual, "model.layers.1", True)
    ]


def test_a_block_over_the_size_limit_is_split_by_its_children():
    analysis = hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(2, 16)), max_block_bytes=100_000)
    names = [b.name for b in analysis.blocks]
    assert "transformer.h.0/attn" in names and "transformer.h.0/mlp" in names
    assert_chain_in_compute_order(analysis.graph)
    whole = hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(2, 16)))
    assert analysis.total_flops() == whole.total_flops()


def test_under_a_symbolic_batch_the_size_limit_judges_the_traced_example():
    """The microbatch search's trace (its batch a symbol) splits where the trace of its example does:
    sizes in the symbol are taken at the example's batch (they failed to convert to a float before)."""
    kwargs, limit = lm_kwargs(token_ids(4, 16)), 500_000  # a layer: 714 kB at 4 rows, 328 kB at 1
    batch = torch.export.Dim("batch", min=1, max=4)
    dims = {"input_ids": {0: batch}, "use_cache": None}
    symbolic = hetcc.analyze(gpt2(), example_kwargs=kwargs, dynamic_shapes=dims, max_block_bytes=limit)
    concrete = hetcc.analyze(gpt2(), example_kwargs=kwargs, max_block_bytes=limit)
    one_row = hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(1, 16)), max_block_bytes=limit)
    names = [b.name for b in concrete.blocks]
    assert [b.name for b in symbolic.blocks] == names and "transformer.h.0/mlp" in names
    assert len(one_row.blocks) < len(names)


def test_a_tied_embedding_s_gradient_has_the_rows_its_lookups_read_and_the_head_s_is_whole():
    """What an exchange of the tied gradient moves (``tied_grad_bytes``): the embedding's block makes at
    most one row (with its int64 index) per token of a microbatch nonzero; the head reads it whole.
    Under a symbolic batch the rows follow the microbatch size."""
    kwargs = lm_kwargs(token_ids(4, 16))
    dims = {"input_ids": {0: torch.export.Dim("batch", min=1, max=4)}, "use_cache": None}
    symbolic = hetcc.analyze(gpt2(), example_kwargs=kwargs, dynamic_shapes=dims)
    (tied,) = symbolic.tied_params
    vocab, hidden = symbolic.graph.get_parameter(tied.name).shape
    row = tied.bytes / vocab + 8
    assert tied.bytes == vocab * hidden * 4 and len(tied.blocks) == 2
    for rows in (1, 3):
        subs = {symbolic.dim_symbols["batch"]: rows}
        assert tied_grad_bytes(symbolic.graph, [tied], subs) == [[rows * 16 * row, tied.bytes]]
    concrete = hetcc.analyze(gpt2(), example_kwargs=kwargs)
    assert tied_grad_bytes(concrete.graph, concrete.tied_params) == [[4 * 16 * row, tied.bytes]]


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.mid(h)) + h  # the skip lands after `out`


def test_model_without_layers_is_split_by_top_level_children_and_skips_cross_cuts():
    analysis = hetcc.analyze(Residual(), (torch.randn(4, 8),))
    assert [b.name for b in analysis.blocks][:2] == ["inp", "mid"]
    inp, mid = analysis.blocks[0], analysis.blocks[1]
    assert inp.cut_bytes == 4 * 8 * 4 and inp.cut_tensors[0].last_block == "out"  # h skips over mid
    assert {c.node for c in mid.cut_tensors} == {"linear", "linear_1"} and mid.cut_bytes == 2 * 4 * 8 * 4
    skip = inp.cut_tensors[0]
    assert (skip.producer, skip.consumers) == ("inp", ("mid", "out"))  # sent to each stage that uses it


def test_opt_blocks_follow_the_computation_although_final_layer_norm_comes_first_in_parameters():
    from model_zoo import opt

    case = opt()
    params = [name for name, _ in case.model.named_parameters()]
    assert params.index("model.decoder.final_layer_norm.weight") < params.index(
        "model.decoder.layers.0.fc1.weight"
    )
    analysis = hetcc.analyze(case.model, example_kwargs=lm_kwargs(token_ids(2, 16)))
    assert [b.name for b in analysis.blocks] == ["embed"] + [
        f"model.decoder.layers.{i}" for i in range(3)
    ] + ["head"]
    head = analysis.graph.get_submodule("model.decoder.final_layer_norm")
    placeholder = next(
        n for n in analysis.graph.graph.nodes if n.target == "model.decoder.final_layer_norm.weight"
    )
    assert head is not None and info(placeholder).block == "head"  # the parameter sits with its first user


def test_encoder_decoder_is_one_chain_and_the_encoder_output_crosses_every_decoder_cut():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=3,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)  # fmt: skip
    ids = token_ids(2, 16)
    kwargs = {"input_ids": ids, "decoder_input_ids": ids, "use_cache": False}
    analysis = hetcc.analyze(T5ForConditionalGeneration(config), example_kwargs=kwargs)
    names = [b.name for b in analysis.blocks]
    assert names == ["embed", "encoder.block.0", "encoder.block.1"] + [
        f"decoder.block.{i}" for i in range(3)
    ] + ["head"]
    assert names == assert_chain_in_compute_order(analysis.graph)
    hidden = 2 * 16 * 64 * 4
    decoder_cuts = [{c.node for c in b.cut_tensors if c.bytes == hidden} for b in analysis.blocks[3:6]]
    encoder_output = set.intersection(*decoder_cuts)  # every decoder layer's cross-attention reads it
    assert len(encoder_output) == 1, decoder_cuts
    (shared,) = analysis.tied_params  # exported as lm_head.weight: encoder, decoder and head share it
    assert shared.blocks == ("embed", "decoder.block.0", "head")


def test_parameter_free_modules_join_the_block_before_them():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.0), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    )  # fmt: skip
    analysis = hetcc.analyze(model, (torch.randn(4, 8),))
    assert [b.name for b in analysis.blocks] == ["0", "3", "5"]
    relu = next(n for n in analysis.graph.graph.nodes if n.target is torch.ops.aten.relu.default)
    assert info(relu).block == "0"
    assert analysis.blocks[0].cut_bytes == 4 * 16 * 4  # the cut carries the activation's output


def test_a_leading_parameter_free_module_joins_the_first_block_with_parameters():
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )
    analysis = hetcc.analyze(model, (torch.randn(2, 3, 4),))
    assert [b.name for b in analysis.blocks] == ["1", "3"]


def test_collect_blocks_refuses_a_chain_where_data_flows_backwards():
    from hetcc.errors import AnalysisError
    from hetcc.ir import annotate
    from hetcc.passes.blocks import collect_blocks

    analysis = hetcc.analyze(Residual(), (torch.randn(4, 8),))
    gm = analysis.graph
    first = next(n for n in gm.graph.nodes if n.op == "call_function" and info(n).block == "inp")
    annotate(first, block="out")  # "out" now starts before "mid" but "inp" reads from it
    with pytest.raises(AnalysisError, match="reads %"):
        collect_blocks(gm)
