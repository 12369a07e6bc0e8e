import pytest
import torch
import torch.nn.functional as F
from models import gpt2, lm_kwargs, token_ids
from torch.utils.flop_counter import FlopCounterMode

import hetcc
from hetcc.ir import info


@pytest.fixture(scope="module")
def gpt2_12():
    """GPT-2 small (12 layers, 768 hidden) at batch 2 x seq 64."""
    with torch.device("meta"):
        model = gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257)
    ids = token_ids(2, 64, vocab=50257)
    return model, hetcc.analyze(model, example_kwargs=lm_kwargs(ids.to("meta"))), ids


def test_gpt2_12_forward_flops_match_flop_counter_on_eager_attention(gpt2_12):
    _, analysis, ids = gpt2_12
    eager = gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257, attn_implementation="eager")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        eager(**lm_kwargs(ids))
    assert analysis.total_flops() == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_gpt2_12_forward_flops_match_the_analytic_count(gpt2_12):
    model, analysis, ids = gpt2_12
    params = sum(p.numel() for p in model.parameters())
    batch, seq, hidden, layers = 2, 64, 768, 12
    attention = layers * batch * 2 * (2 * seq * seq * hidden)  # QK^T and AV
    assert analysis.total_flops() == pytest.approx(2 * params * batch * seq + attention, rel=0.03)


def test_backward_is_about_twice_forward_for_matmul_dominated_models(gpt2_12):
    _, analysis, _ = gpt2_12
    assert 1.95 <= analysis.total_flops(backward=True) / analysis.total_flops() <= 2.1


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_cpu_flash_attention_is_counted():
    b, h, s, d = 2, 4, 32, 16
    q = torch.randn(b, h, s, d)
    analysis = hetcc.analyze(Attention(), (q, q.clone(), q.clone()))
    assert analysis.total_flops() == 2 * (2 * b * h * s * s * d)


class Pointwise(torch.nn.Module):
    def forward(self, x, idx, table):
        y = (x + 1.0).view(-1)
        return y, torch.nn.functional.embedding(idx, table)


def test_bytes_views_are_free_pointwise_read_and_write_gathers_move_rows():
    x, idx, table = torch.randn(8, 16), torch.randint(0, 100, (5,)), torch.randn(100, 32)
    gm = hetcc.analyze(Pointwise(), (x, idx, table)).graph
    by_target = {n.target: info(n) for n in gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert by_target[aten.add.Tensor].bytes == 2 * 8 * 16 * 4
    assert by_target[aten.view.default].bytes == 0
    assert by_target[aten.embedding.default].bytes == 5 * 8 + 2 * 5 * 32 * 4


def test_unknown_op_takes_the_named_io_fallback():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)

    gm = hetcc.analyze(Odd(), (torch.randn(10),)).graph
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert "io-fallback" in info(node).notes and info(node).bytes == 2 * 10 * 4


def test_gpt2_sdpa_and_eager_attention_count_the_same():
    ids = lm_kwargs(token_ids(2, 16))
    sdpa = hetcc.analyze(gpt2(), example_kwargs=ids).total_flops()
    eager = hetcc.analyze(gpt2(attn_implementation="eager"), example_kwargs=ids).total_flops()
    assert sdpa == eager
