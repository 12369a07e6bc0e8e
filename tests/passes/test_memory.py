import pytest
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


class _Attention(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.qkv, self.dropout = torch.nn.Linear(32, 96), dropout

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(2, 64, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout
        )


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_keeps_what_a_fused_kernel_keeps_whatever_the_model_device(device, dropout):
    """Left to dispatch, meta tensors and CPU dropout take the math path and keep the 4 x 64 x 64
    probabilities per sample; a GPU's fused kernel keeps q, k, v, the mask as a bias, out and lse."""
    with torch.device(device):
        model = _Attention(dropout)
    mask = torch.ones(64, 64, dtype=torch.bool).tril().expand(2, 1, 64, 64)
    gm = hetcc.analyze(model, (torch.randn(2, 64, 32, device=device), mask.to(device))).graph
    sdpa = next(
        info(n) for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default
    )
    qkv_out = 3 * 2 * 64 * 96 // 3 * 4 + 2 * 4 * 64 * 8 * 4  # q, k, v views of one [2, 64, 96] output; out
    lse, bias, rng = 2 * 4 * 64 * 4, 2 * 64 * 64 * 4, 2 * 8  # lse in fp32; the mask as a bias; seed, offset
    assert sdpa.act_bytes == qkv_out + lse + bias + rng
