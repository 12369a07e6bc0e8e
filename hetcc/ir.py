"""hetcc's IR is torch.fx plus one frozen record per node in ``node.meta["hetcc"]``.

Passes add fields with ``annotate(node, field=value)``, which replaces the record (records are frozen so
a pass can never mutate another pass's result in place). ``format(gm)`` prints one node per line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx

from hetcc.errors import AnalysisError

META_KEY = "hetcc"

Number = Any  # int | float | sympy.Expr (symbolic dims)


@dataclass(frozen=True)
class NodeInfo:
    """What hetcc knows about one fx node. Sizes are per microbatch (the traced example inputs)."""

    shape: tuple[Number, ...] | None = None  # output shape (first tensor output); None for non-tensors
    dtype: torch.dtype | None = None
    fwd_flops: Number = 0
    bwd_flops: Number = 0
    bytes: Number = 0  # bytes read + written by the forward kernel(s); views cost 0
    param_bytes: int = 0  # bytes of parameters/buffers this node reads from get_attr nodes
    act_bytes: Number = 0  # bytes saved for backward by this node (0 in inference)
    block: str | None = None  # partition block this node belongs to
    stage: int | None = None  # pipeline stage after partitioning
    fwd_s: tuple[tuple[str, float], ...] = ()  # (device type, seconds) forward
    bwd_s: tuple[tuple[str, float], ...] = ()  # (device type, seconds) backward
    notes: tuple[str, ...] = field(default=())  # e.g. which fallback rule priced this node
    members: tuple[NodeInfo, ...] = ()  # a fused node: the records of the ops it replaced


def info(node: torch.fx.Node) -> NodeInfo:
    """The node's record (an empty one if no pass has annotated it yet)."""
    return node.meta.get(META_KEY) or NodeInfo()


def annotate(node: torch.fx.Node, **changes: Any) -> NodeInfo:
    """Replace the node's record with one that has ``changes`` applied; returns the new record."""
    record = dataclasses.replace(info(node), **changes)
    node.meta[META_KEY] = record
    return record


# ----------------------------------------------------------------------------------------- sizes


def to_number(value: Any) -> Number:
    """An int for concrete sizes, a sympy expression for symbolic ones (SymInt/SymFloat unwrapped)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        expr = value.node.expr
        return int(expr) if expr.is_number else expr
    return value


def nbytes(value: Any) -> Number:
    """Bytes of a tensor (or the sum over a list/tuple of tensors); 0 for non-tensors."""
    if isinstance(value, torch.Tensor):
        return to_number(value.numel()) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum((nbytes(v) for v in value), 0)
    return 0


def is_concrete(value: Number) -> bool:
    return isinstance(value, (int, float))


def number_at(value: Number, subs: dict) -> float:
    """A (possibly symbolic) size as a float once the dims ``subs`` gives are set: how one symbolic
    trace is priced at each microbatch size."""
    if is_concrete(value):
        return float(value)
    number = sympy.sympify(value).subs(subs)
    if not number.is_number:
        raise AnalysisError(
            f"cost {value} still has free dims {sorted(map(str, number.free_symbols))} at {subs}",
            hint="mark only the batch dimension dynamic for the microbatch search",
        )
    return float(number)


# -------------------------------------------------------------------------------------- printing

_DTYPE_ABBR = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
    torch.uint8: "u8",
    torch.int8: "i8",
}


def human(value: Number, unit: str = "", base: int = 1000) -> str:
    """Compact size: 453M, 1.2MB; symbolic values print as their expression."""
    if not is_concrete(value):
        return f"({value}){unit}"
    value = float(value)
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(value) < base or prefix == "P":
            text = f"{value:.0f}" if prefix == "" or abs(value) >= 100 else f"{value:.3g}"
            return f"{text}{prefix}{unit}"
        value /= base
    raise AssertionError("unreachable")


def format_type(record: NodeInfo) -> str:
    if record.shape is None or record.dtype is None:
        return ""
    dtype = _DTYPE_ABBR.get(record.dtype, str(record.dtype).removeprefix("torch."))
    return f"{dtype}[{','.join(str(s) for s in record.shape)}]"


def _format_arg(arg: Any) -> str:
    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"[{inner}]"
    return repr(arg)


def _format_target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.name().replace("::", ".")
        return name.removesuffix(".default")
    return getattr(target, "__name__", str(target))


def format_node(node: torch.fx.Node) -> str:
    """One line: ``%name = op(args)  type  flops  io  saved  params  block  stage``."""
    record = info(node)
    if node.op == "placeholder":
        head = f"%{node.name} = input {node.target!r}"
    elif node.op == "get_attr":
        head = f"%{node.name} = param {node.target}"
    elif node.op == "output":
        head = f"return {_format_arg(node.args[0])}"
    else:
        args = ", ".join(
            [_format_arg(a) for a in node.args] + [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
        )
        head = f"%{node.name} = {_format_target(node)}({args})"
    fields = [format_type(record)]
    if record.fwd_flops:
        fields.append(f"{human(record.fwd_flops)} flop")
    if record.bytes:
        fields.append(f"io {human(record.bytes, 'B')}")
    if record.act_bytes:
        fields.append(f"saved {human(record.act_bytes, 'B')}")
    if record.param_bytes:
        fields.append(f"params {human(record.param_bytes, 'B')}")
    if record.block is not None:
        fields.append(f"block {record.block}")
    if record.stage is not None:
        fields.append(f"stage {record.stage}")
    fields.extend(f"[{note}]" for note in record.notes)
    return "  ".join([head] + [f for f in fields if f])


def format(gm: torch.fx.GraphModule) -> str:  # noqa: A001 - the public name hetcc.ir.format
    """The annotated graph, one node per line."""
    return "\n".join(format_node(node) for node in gm.graph.nodes)
