"""``hetcc.analyze``: trace a model and run the analysis passes, the first half of ``hetcc.compile``."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import sympy
import torch

from hetcc import config, ir
from hetcc.dump import Dumper
from hetcc.errors import AnalysisError
from hetcc.passes.blocks import Block, TiedParam, blocks, collect_blocks
from hetcc.passes.flops import flops, format_flops
from hetcc.passes.memory import memory
from hetcc.passes.shapes import shapes
from hetcc.trace import trace


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
        return format_blocks(self)

    def dump(self, folder: str | Path) -> None:
        dumper = Dumper(folder)
        dumper.write("traced.py", self.graph.code)
        dumper.write("analysis.txt", ir.format(self.graph))
        dumper.write("blocks.txt", format_blocks(self))


def analyze(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    dump_dir: str | Path | None = None,
    *,
    training: bool = True,
    max_block_bytes: float | None = None,
    dumper: Dumper | None = None,
) -> Analysis:
    """Trace ``model`` and annotate every node with shape, FLOPs, bytes, parameters and activations.

    ``dumper`` continues a dump folder's numbering (``hetcc.compile`` passes its own).
    """
    dumper = dumper or Dumper(dump_dir)
    with dumper.step("trace", "traced.py", lambda: traced.gm.code):
        traced = trace(model, example_inputs, example_kwargs, dynamic_shapes)
    gm = traced.gm
    with dumper.step("shapes", "shapes.txt", lambda: ir.format(gm)):
        shapes(gm)
    with dumper.step("flops", "flops.txt", lambda: format_flops(gm)):
        flops(gm)
    with dumper.step("memory", "memory.txt", lambda: ir.format(gm)):
        memory(gm, training=training)
    limit = config.max_block_bytes if max_block_bytes is None else max_block_bytes
    result = Analysis(gm, [], [], traced.frontend, traced.dim_symbols, dumper.timings_ms)
    with dumper.step("blocks", "blocks.txt", lambda: format_blocks(result)):
        blocks(gm, max_block_bytes=limit)
        result.blocks, result.tied_params = collect_blocks(gm)
    if config.debug >= 1:
        print(format_blocks(result), file=sys.stderr)
    return result


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


def format_blocks(analysis: Analysis) -> str:
    """The block chain as a table, then every cut's crossing tensors by name, then tied parameters."""
    h = ir.human
    lines = [
        f"{'block':<24} {'nodes':>6} {'fwd flop':>10} {'bwd flop':>10} {'params':>9} {'saved act':>10} {'cut':>9}"
    ]
    for b in analysis.blocks:
        lines.append(
            f"{b.name:<24} {len(b.nodes):>6} {h(b.fwd_flops):>10} {h(b.bwd_flops):>10} "
            f"{h(b.param_bytes, 'B'):>9} {h(b.act_bytes, 'B'):>10} {h(b.cut_bytes, 'B'):>9}"
        )
    lines.append(
        f"total: {len(analysis.blocks)} blocks, {h(analysis.total_flops())} fwd flop, "
        f"{h(analysis.total_flops(backward=True))} bwd flop, {h(analysis.param_bytes, 'B')} params"
    )
    lines.append("\ncuts (tensors alive across each boundary, per microbatch):")
    for left, right in zip(analysis.blocks, analysis.blocks[1:]):
        crossing = ", ".join(f"%{c.node} {h(c.bytes, 'B')} (to {c.last_block})" for c in left.cut_tensors)
        lines.append(f"  {left.name} | {right.name}: {h(left.cut_bytes, 'B')} = {crossing or 'nothing'}")
    if analysis.tied_params:
        lines.append("\ntied parameters (held by every stage that uses them, counted once above):")
        lines.extend(
            f"  {t.name} {h(t.bytes, 'B')} used by {', '.join(t.blocks)}" for t in analysis.tied_params
        )
    return "\n".join(lines)


__all__ = ["Analysis", "analyze", "format_blocks"]
