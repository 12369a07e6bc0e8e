import pytest
import torch
from models import MLP, gpt2, lm_kwargs, token_ids
from torch.export import Dim

import hetcc
from hetcc.errors import AnalysisError


@pytest.fixture(scope="module")
def symbolic():
    dims = {"input_ids": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=128)}, "use_cache": None}
    return hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(2, 16)), dynamic_shapes=dims)


def test_dynamic_dims_make_flops_a_sympy_expression(symbolic):
    assert set(symbolic.dim_symbols) == {"batch", "seq"}
    assert symbolic.total_flops().free_symbols == set(symbolic.dim_symbols.values())


@pytest.mark.parametrize(("batch", "seq"), [(3, 8), (4, 32)])
def test_symbolic_analysis_evaluates_to_the_concrete_one(symbolic, batch, seq):
    evaluated = symbolic.evaluate(batch=batch, seq=seq)
    concrete = hetcc.analyze(gpt2(), example_kwargs=lm_kwargs(token_ids(batch, seq)))
    assert evaluated.total_flops() == concrete.total_flops()
    assert evaluated.total_flops(backward=True) == concrete.total_flops(backward=True)
    for got, want in zip(evaluated.blocks, concrete.blocks):
        assert (got.bytes, got.act_bytes, got.cut_bytes) == (want.bytes, want.act_bytes, want.cut_bytes)


def test_evaluate_rejects_unknown_dims(symbolic):
    with pytest.raises(AnalysisError, match=r"unknown dynamic dim\(s\) \['tokens'\]"):
        symbolic.evaluate(tokens=3)


def test_dump_dir_gets_numbered_files_each_headed_by_its_pass(tmp_path):
    hetcc.analyze(MLP(), (torch.randn(3, 8),), dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00_traced.py", "01_shapes.txt", "02_flops.txt", "03_memory.txt", "04_blocks.txt"]
    assert (tmp_path / "02_flops.txt").read_text().startswith("# after flops (")


def test_env_dump_dir_and_debug_levels(tmp_path, capsys):
    with hetcc.config.patch(dump_dir=str(tmp_path), debug=1):
        hetcc.analyze(MLP(), (torch.randn(3, 8),))
    assert (tmp_path / "04_blocks.txt").exists()
    err = capsys.readouterr().err
    assert "total: 2 blocks" in err and "# after flops" not in err
    with hetcc.config.patch(debug=2):
        hetcc.analyze(MLP(), (torch.randn(3, 8),))
    assert "# after flops" in capsys.readouterr().err


def test_ir_format_prints_one_annotated_line_per_node():
    analysis = hetcc.analyze(MLP(), (torch.randn(3, 8),))
    lines = hetcc.ir.format(analysis.graph).splitlines()
    assert lines[0] == "%fc1_weight = param fc1.weight  f32[16,8]  params 512B  block fc1"
    linear = next(line for line in lines if line.startswith("%linear ="))
    assert linear == (
        "%linear = aten.linear(%x, %fc1_weight, %fc1_bias)  f32[3,16]  768 flop  io 864B  saved 96B  block fc1"
    )
    assert lines[-1] == "return [%linear_1]  block fc2"


def test_config_patch_rejects_unknown_knobs():
    with pytest.raises(AttributeError, match="no knob"):
        with hetcc.config.patch(debgu=1):
            pass


def test_the_symbolic_summary_prints_the_users_dim_names(symbolic):
    import re

    summary = symbolic.summary()
    assert "batch" in summary and "seq" in summary
    assert not re.search(r"\bs\d+\b", summary), summary  # not torch's s70, s72
