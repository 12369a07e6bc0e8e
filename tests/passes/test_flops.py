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


def _note(analysis, op_name: str) -> list[str]:
    return [note for n in analysis.graph.graph.nodes if op_name in str(n.target) for note in info(n).notes]


@pytest.mark.parametrize(
    ("layer", "gates"),
    [(torch.nn.LSTM(8, 16, num_layers=2, batch_first=True), 4), (torch.nn.GRU(8, 16, bidirectional=True), 3),
     (torch.nn.RNN(8, 16), 1), (torch.nn.LSTM(8, 16, proj_size=4), 4)],
    ids=["lstm-2-layers", "gru-bidirectional", "rnn-tanh", "lstm-projection"],
)  # fmt: skip
def test_recurrent_layers_count_every_gate_matmul_at_every_step(layer, gates):
    x = torch.randn(3, 5, 8)  # 15 (step, sequence) pairs whichever axis is the batch
    analysis = hetcc.analyze(layer, (x,))
    weights = [p for name, p in layer.named_parameters() if name.startswith("weight")]
    want = sum(2 * 15 * p.numel() for p in weights)  # W_ih x_t, W_hh h_t (and W_hr h_t) per step
    assert gates * layer.hidden_size == weights[0].shape[0]
    assert analysis.total_flops() == want
    assert analysis.total_flops(backward=True) == 2 * want
    notes = [note for n in analysis.graph.graph.nodes for note in info(n).notes]
    assert [note.split(":")[0] for note in notes] == ["recurrent"]


def test_grouped_expert_matmuls_count_the_routed_tokens_and_say_so_in_the_dump(tmp_path):
    from model_zoo import _mixtral_config
    from transformers import MixtralForCausalLM

    config = _mixtral_config()
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    ids = token_ids(2, 16)
    analysis = hetcc.analyze(model, example_kwargs=lm_kwargs(ids), dump_dir=tmp_path)
    with FlopCounterMode(display=False) as counter:
        model(**lm_kwargs(ids))
    routed = 2 * 16 * config.num_experts_per_tok
    experts = config.num_hidden_layers * 2 * routed * config.hidden_size * 3 * config.intermediate_size
    assert analysis.total_flops() == counter.get_total_flops() + experts  # torch's counter sees none of them
    notes = _note(analysis, "grouped_mm")
    assert len(notes) == 2 * config.num_hidden_layers
    assert all(note.startswith(f"moe: {routed} routed rows (tokens x top-k)") for note in notes)
    dump = (tmp_path / "02_flops.txt").read_text()
    summary = dump.split("priced by a rule of hetcc's own or a generic fallback")[1]
    line = next(line for line in summary.splitlines() if "transformers.grouped_mm_fallback" in line)
    assert f"x{2 * config.num_hidden_layers} " in line and "routed rows" in line
    ops = [line.split()[0] for line in summary.splitlines()[1:] if line.strip()]
    assert len(ops) == len(set(ops))  # each guessed op is listed once, with its count


def test_the_recurrent_rule_reads_the_packed_overload_too():
    from hetcc.passes.flops import FLOP_RULES

    data, batch_sizes = torch.randn(10, 8), torch.tensor([3, 3, 2, 1, 1])  # 10 real steps over 3 sequences
    hidden = [torch.zeros(1, 3, 16), torch.zeros(1, 3, 16)]
    params = [torch.randn(64, 8), torch.randn(64, 16), torch.randn(64), torch.randn(64)]
    args = (data, batch_sizes, hidden, params, True, 1, 0.0, True, False)  # aten.lstm.data
    flop, note = FLOP_RULES["aten.lstm"](args, {}, None)
    assert flop == 2 * 10 * 64 * (8 + 16) and note.startswith("recurrent:")


def test_a_call_on_concrete_sizes_is_counted_once_across_graphs(gpt2_12):
    """The stages of a model repeat its calls: a call on concrete sizes is counted once and its figures
    serve every graph; a call on symbolic sizes or an opaque constant stays its own graph's."""
    from hetcc.passes import flops as flops_pass

    model, analysis, ids = gpt2_12
    again = hetcc.analyze(model, example_kwargs=lm_kwargs(ids.to("meta")))  # counted from the cache
    assert [info(n).fwd_flops for n in again.graph.graph.nodes] == [
        info(n).fwd_flops for n in analysis.graph.graph.nodes
    ]
    key = (torch.ops.aten.mm.default, ("tuple", ("tensor", ("2", "64"), torch.float32, False)))
    assert flops_pass._concrete(key)
    assert not flops_pass._concrete((key[0], ("tuple", ("tensor", ("s0", "64"), torch.float32, False))))
    assert not flops_pass._concrete((key[0], ("tuple", ("sym", "s0"))))
    assert not flops_pass._concrete((key[0], ("tuple", ("object", 1234))))
