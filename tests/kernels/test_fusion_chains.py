"""Random chains of pointwise ops with broadcast operands: fused forward and backward match eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import export_and_fuse, fused_groups
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fusion_numerics import assert_matches_eager

# Each step maps (value, other operand) to a new value with fusible ops only, and stays in a safe
# domain (no overflow, no log of negatives) so fp16 results are comparable.
STEPS = {
    "add": lambda v, o: v + o,
    "sub": lambda v, o: v - o,
    "mul": lambda v, o: v * o,
    "div": lambda v, o: v / (abs(o) + 1.0),
    "neg": lambda v, o: -v,
    "tanh": lambda v, o: torch.tanh(v),
    "sigmoid": lambda v, o: torch.sigmoid(v),
    "relu": lambda v, o: torch.relu(v),
    "gelu": lambda v, o: F.gelu(v),
    "gelu_tanh": lambda v, o: F.gelu(v, approximate="tanh"),
    "silu": lambda v, o: F.silu(v),
    "exp_tanh": lambda v, o: torch.exp(torch.tanh(v)),
    "log": lambda v, o: torch.log(torch.abs(v) + 1.0),
    "sqrt": lambda v, o: torch.sqrt(torch.abs(v) + 1.0),
    "rsqrt": lambda v, o: torch.rsqrt(torch.abs(v) + 1.0),
    "square": lambda v, o: torch.pow(v, 2),
    "cube": lambda v, o: torch.pow(torch.tanh(v), 3.0),
    "where": lambda v, o: torch.where(v > o, v, o * 0.5),
}
BINARY = {"add", "sub", "mul", "div", "where"}
OPERAND_SHAPES = {"full": (3, 10), "row": (10,), "column": (3, 1), "zero_dim": (), "scalar": None}


class RandomChain(torch.nn.Module):
    def __init__(self, steps: list[tuple[str, int | float]], also_return: int | None):
        super().__init__()
        self.steps, self.also_return = steps, also_return

    def forward(self, x, *extras):
        value, kept = x, None
        for k, (name, operand) in enumerate(self.steps):
            other = extras[operand] if isinstance(operand, int) else operand
            value = STEPS[name](value, other)
            kept = value if k == self.also_return else kept
        return (value,) if kept is None else (value, kept)


@st.composite
def chains(draw):
    names = draw(st.lists(st.sampled_from(sorted(STEPS)), min_size=2, max_size=6))
    steps, shapes = [], []
    for name in names:
        kind = draw(st.sampled_from(sorted(OPERAND_SHAPES))) if name in BINARY else "scalar"
        if kind == "scalar":
            steps.append((name, draw(st.sampled_from([-1.5, 0.5, 2.0]))))
        else:
            steps.append((name, len(shapes)))
            shapes.append(OPERAND_SHAPES[kind])
    also_return = draw(st.none() | st.integers(0, len(steps) - 2))
    return RandomChain(steps, also_return), shapes, draw(st.integers(0, 2**16))


def chain_inputs(shapes, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=generator).to(dtype) for s in [(3, 10), *shapes])


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@settings(max_examples=20, deadline=None, derandomize=True)
@given(case=chains())
def test_random_chain_matches_eager(dtype, case):
    module, shapes, seed = case
    args = chain_inputs(shapes, seed, dtype)
    _, fused = export_and_fuse(module, args)
    # Steps add 1-3 fusible ops each and nothing else sits in the chain: it must fuse into one group.
    assert len(fused_groups(fused)) == 1, fused.code
    assert_matches_eager(module, args, dtype)
