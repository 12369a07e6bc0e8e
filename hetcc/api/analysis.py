"""``Analysis``: what ``hetcc.analyze`` returns, the annotated graph and its block chain, with symbolic
dims (``torch.export.Dim``) set to numbers on request."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import sympy
import torch

from hetcc import ir
from hetcc.dump import Dumper
from hetcc.errors import AnalysisError
from hetcc.passes.blocks import Block, TiedParam, format_blocks


@dataclass
class Analysis:
    """An annotated graph and its block chain. Sizes are per call of the traced example inputs."""

    graph: torch.fx.GraphModule
    blocks: list[Block]
    tied_params: list[TiedParam]
    frontend: str
    dim_symbols: dict[str, Any] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def total_flops(self, backward: bool = False):
        return sum(((b.bwd_flops if backward else b.fwd_flops) for b in self.blocks), 0)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def evaluate(self, **dims: int) -> Analysis:
        """The same analysis with symbolic dims (``torch.export.Dim`` names) set to numbers."""
        unknown = sorted(set(dims) - set(self.dim_symbols))
        if unknown:
            raise AnalysisError(
                f"unknown dynamic dim(s) {unknown}; this analysis has {sorted(self.dim_symbols) or 'none'}",
                hint="name the torch.export.Dim objects passed in dynamic_shapes",
            )
        subs = {self.dim_symbols[name]: value for name, value in dims.items()}
        evaluated = [_substitute_block(b, subs) for b in self.blocks]
        return replace(
            self, blocks=evaluated, dim_symbols={k: v for k, v in self.dim_symbols.items() if k not in dims}
        )

    def summary(self) -> str:
        return format_blocks(self.blocks, self.tied_params, self.dim_symbols)

    def dump(self, folder: str | Path) -> None:
        dumper = Dumper(folder)
        dumper.write("traced.py", self.graph.code)
        dumper.write("analysis.txt", ir.format(self.graph))
        dumper.write("blocks.txt", self.summary())


def _substitute_block(block: Block, subs: dict) -> Block:
    changes = {}
    for f in fields(Block):
        value = getattr(block, f.name)
        if isinstance(value, sympy.Basic):
            changes[f.name] = _number(value.subs(subs))
    cut = tuple(replace(c, bytes=_number(sympy.sympify(c.bytes).subs(subs))) for c in block.cut_tensors)
    return replace(block, cut_tensors=cut, **changes)


def _number(expr):
    if isinstance(expr, sympy.Basic) and expr.is_number:
        value = float(expr)
        return int(value) if value.is_integer() else value
    return expr
