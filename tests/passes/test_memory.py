import torch
from models import MLP, gpt2, lm_kwargs, token_ids

import hetcc
from hetcc.ir import info


def _by_name(gm):
    return {n.name: info(n) for n in gm.graph.nodes}


def test_saved_activations_are_what_autograd_saves_each_storage_once():
    gm = hetcc.analyze(MLP(), (torch.randn(3, 8),)).graph
    records = _by_name(gm)
    assert records["linear"].act_bytes == 3 * 8 * 4  # fc1 keeps its input for grad(weight)
    assert records["relu"].act_bytes == 3 * 16 * 4  # relu keeps its output
    assert records["linear_1"].act_bytes == 0  # fc2's input is relu's output, already saved
    total = sum(info(n).act_bytes for n in gm.graph.nodes)
    assert total == 3 * 8 * 4 + 3 * 16 * 4  # fc2's input is relu's saved output: not charged twice


def test_parameters_counted_once_and_never_as_activations():
    analysis = hetcc.analyze(MLP(), (torch.randn(3, 8),))
    assert analysis.param_bytes == (8 * 16 + 16 + 16 * 4 + 4) * 4


def test_inference_saves_nothing():
    gm = hetcc.analyze(MLP(), (torch.randn(3, 8),), training=False).graph
    assert all(info(n).act_bytes == 0 for n in gm.graph.nodes)


def test_tied_embedding_counted_once():
    model = gpt2()
    analysis = hetcc.analyze(model, example_kwargs=lm_kwargs(token_ids(2, 8)))
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedupes ties
    assert analysis.param_bytes == unique
    assert [t.name for t in analysis.tied_params] == ["lm_head.weight"]
    assert analysis.tied_params[0].bytes == 128 * 64 * 4
    assert analysis.tied_params[0].blocks == ("embed", "head")
