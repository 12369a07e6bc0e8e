"""Per-op knowledge for fusion: which aten ops fuse, their Triton lowering, derivative and eager form.

One table, ``RULES``, keyed by a short op name ("add", "gelu_tanh", "layer_norm"), and one map from aten
overloads to a small *normalizer* that reads an fx node's arguments into canonical operands, or says
the node cannot fuse (e.g. dropout in training mode). Adding a pointwise op is one ``Rule`` entry and
one ``ATEN`` line.

Inside a kernel every floating value is fp32 (loads upcast, stores cast back); comparisons give
Triton booleans. Templates name operands ``{a}``, ``{b}``, ``{c}``, the op's result ``{out}`` and the
incoming gradient ``{g}``.

Row ops run in a row program (one program per row, ``mask`` the valid lanes, ``n_cols`` their count).
Their forward emitter names the per-row statistics it computes (``{out}_rstd``, ``{out}_xhat``); their
``grad_lines`` emitter, run once the op's adjoint ``{g}`` is known, computes the masked row sums of
``{g}`` that their gradient templates read beside those statistics.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _tanh(x: str) -> str:
    # Triton has no tanh that the interpreter also runs; 2*sigmoid(2x)-1 is exact to ~1e-7 absolute.
    return f"(2.0 * tl.sigmoid(2.0 * ({x})) - 1.0)"


def _gelu_tanh_inner(a: str) -> str:
    return f"{_SQRT_2_OVER_PI!r} * ({a} + 0.044715 * {a} * {a} * {a})"


@dataclass(frozen=True)
class Rule:
    """How one canonical op computes (Triton and eager) and differentiates.

    ``triton`` is an expression template (pointwise) or, for row ops, a function emitting lines.
    ``grads`` has one template per operand (None: no gradient flows to it, e.g. a condition).
    ``eager`` runs the op with torch on canonical operands (tensors or Python scalars).
    ``grad_lines`` (row ops) emits, from ``(out, g, *operands)``, the backward lines computing the row
    sums its ``grads`` templates read: a row op's gradient couples every lane of the row.
    """

    triton: str | Callable[..., list[str]]
    grads: tuple[str | None, ...]
    eager: Callable[..., torch.Tensor]
    flops_per_element: int = 1
    row: bool = False  # a row-wise reduction over the last dim (ends a group)
    grad_lines: Callable[..., list[str]] | None = None


def _row_sum(value: str) -> str:
    """The sum of ``value`` over the row's valid lanes (masked-off lanes may hold inf or nan)."""
    return f"tl.sum(tl.where(mask, {value}, 0.0), 0)"


def _row_softmax(out: str, a: str) -> list[str]:
    return [
        f"{out}_x = tl.where(mask, {a}, float('-inf'))",
        f"{out}_e = tl.where(mask, tl.exp({out}_x - tl.max({out}_x, 0)), 0.0)",
        f"{out} = {out}_e / tl.sum({out}_e, 0)",
    ]


def _softmax_grad_lines(out: str, g: str, a: str) -> list[str]:
    # d/da softmax: out * (g - sum(g * out))
    return [f"{out}_gsum = {_row_sum(f'{g} * {out}')}"]


def _affine(out: str, w: str, b: str) -> str:
    """``{out}_xhat`` scaled by an optional weight and shifted by an optional bias."""
    return f"{out}_xhat" + (f" * {w}" if w != "None" else "") + (f" + {b}" if b != "None" else "")


def _row_layer_norm(out: str, a: str, w: str, b: str, eps: str) -> list[str]:
    return [
        f"{out}_mean = {_row_sum(a)} / n_cols",
        f"{out}_d = tl.where(mask, {a} - {out}_mean, 0.0)",
        f"{out}_rstd = tl.rsqrt(tl.sum({out}_d * {out}_d, 0) / n_cols + {eps})",
        f"{out}_xhat = {out}_d * {out}_rstd",
        f"{out} = {_affine(out, w, b)}",
    ]


def _layer_norm_grad_lines(out: str, g: str, a: str, w: str, b: str, eps: str) -> list[str]:
    # d/da: rstd * (g*w - mean(g*w) - xhat * mean(g*w * xhat)); d/dw: g * xhat; d/db: g
    return [
        f"{out}_gx = {g}" + (f" * {w}" if w != "None" else ""),
        f"{out}_gmean = {_row_sum(f'{out}_gx')} / n_cols",
        f"{out}_gxmean = {_row_sum(f'{out}_gx * {out}_xhat')} / n_cols",
    ]


def _row_mean(out: str, a: str) -> list[str]:
    # A per-row scalar: later ops in the same program broadcast it over the row.
    return [f"{out} = {_row_sum(a)} / n_cols"]


def _row_rms_norm(out: str, a: str, w: str, eps: str) -> list[str]:
    return [
        f"{out}_ms = {_row_sum(f'{a} * {a}')} / n_cols",
        f"{out}_rstd = tl.rsqrt({out}_ms + {eps})",
        f"{out}_xhat = {a} * {out}_rstd",
        f"{out} = {_affine(out, w, 'None')}",
    ]


def _rms_norm_grad_lines(out: str, g: str, a: str, w: str, eps: str) -> list[str]:
    # d/da: rstd * (g*w - xhat * mean(g*w * xhat)); d/dw: g * xhat
    return [
        f"{out}_gx = {g}" + (f" * {w}" if w != "None" else ""),
        f"{out}_gxmean = {_row_sum(f'{out}_gx * {out}_xhat')} / n_cols",
    ]


def _pow_expr(a: str, exponent: float) -> str:
    if exponent == 0.5:
        return f"tl.sqrt({a})"
    if exponent == int(exponent) and 1 <= abs(exponent) <= 4:
        product = " * ".join([a] * int(abs(exponent)))
        return f"({product})" if exponent > 0 else f"(1.0 / ({product}))"
    return f"tl.exp({exponent!r} * tl.log({a}))"


RULES: dict[str, Rule] = {
    "add": Rule("{a} + {b}", ("{g}", "{g}"), operator.add),
    "sub": Rule("{a} - {b}", ("{g}", "-{g}"), operator.sub),
    "mul": Rule("{a} * {b}", ("{g} * {b}", "{g} * {a}"), operator.mul),
    "div": Rule("{a} / {b}", ("{g} / {b}", "-{g} * {out} / {b}"), operator.truediv),
    "neg": Rule("-{a}", ("-{g}",), operator.neg),
    "abs": Rule("tl.abs({a})", ("tl.where({a} > 0.0, {g}, tl.where({a} < 0.0, -{g}, 0.0))",), torch.abs),
    "exp": Rule("tl.exp({a})", ("{g} * {out}",), torch.exp),
    "log": Rule("tl.log({a})", ("{g} / {a}",), torch.log),
    "sqrt": Rule("tl.sqrt({a})", ("{g} * 0.5 / {out}",), torch.sqrt),
    "rsqrt": Rule("tl.rsqrt({a})", ("{g} * -0.5 * {out} * {out} * {out}",), torch.rsqrt),
    "tanh": Rule(_tanh("{a}"), ("{g} * (1.0 - {out} * {out})",), torch.tanh),
    "sigmoid": Rule("tl.sigmoid({a})", ("{g} * {out} * (1.0 - {out})",), torch.sigmoid),
    "relu": Rule("tl.maximum({a}, 0.0)", ("tl.where({a} > 0.0, {g}, 0.0)",), torch.relu),
    "silu": Rule(
        "{a} * tl.sigmoid({a})",
        ("{g} * tl.sigmoid({a}) * (1.0 + {a} * (1.0 - tl.sigmoid({a})))",),
        torch.nn.functional.silu,
        flops_per_element=4,
    ),
    "gelu_erf": Rule(
        f"0.5 * {{a}} * (1.0 + tl.erf({{a}} * {_INV_SQRT_2!r}))",
        (
            f"{{g}} * (0.5 * (1.0 + tl.erf({{a}} * {_INV_SQRT_2!r}))"
            f" + {{a}} * {_INV_SQRT_2PI!r} * tl.exp(-0.5 * {{a}} * {{a}}))",
        ),
        lambda a: torch.nn.functional.gelu(a, approximate="none"),
        flops_per_element=8,
    ),
    "gelu_tanh": Rule(
        "0.5 * {a} * (1.0 + " + _tanh(_gelu_tanh_inner("{a}")) + ")",
        (
            "{g} * (0.5 * (1.0 + "
            + _tanh(_gelu_tanh_inner("{a}"))
            + ") + 0.5 * {a} * (1.0 - "
            + _tanh(_gelu_tanh_inner("{a}"))
            + " * "
            + _tanh(_gelu_tanh_inner("{a}"))
            + f") * {_SQRT_2_OVER_PI!r} * (1.0 + 3.0 * 0.044715 * {{a}} * {{a}}))",
        ),
        lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        flops_per_element=10,
    ),
    "where": Rule(
        "tl.where({a}, {b}, {c})", (None, "tl.where({a}, {g}, 0.0)", "tl.where({a}, 0.0, {g})"), torch.where
    ),
    "gt": Rule("{a} > {b}", (None, None), operator.gt),
    "lt": Rule("{a} < {b}", (None, None), operator.lt),
    "ge": Rule("{a} >= {b}", (None, None), operator.ge),
    "le": Rule("{a} <= {b}", (None, None), operator.le),
    # Pass-through ops: codegen converts dtypes where they change, eager applies ``.to(dtype)``.
    "identity": Rule("{a}", ("{g}",), lambda a: a, flops_per_element=0),  # clone
    "dropout": Rule("{a}", ("{g}",), lambda a: a, flops_per_element=0),  # p=0 or eval: no randomness
    "cast": Rule("{a}", ("{g}",), lambda a: a, flops_per_element=0),
    # Row ops: the row mean's gradient spreads its adjoint (a per-row scalar) evenly over the row.
    "row_mean": Rule(
        _row_mean, ("tl.where(mask, {g}, 0.0) / n_cols",), lambda a: a.mean(-1, keepdim=True), row=True
    ),
    "softmax": Rule(
        _row_softmax,
        ("{out} * ({g} - {out}_gsum)",),
        lambda a: torch.softmax(a, -1),
        flops_per_element=5,
        row=True,
        grad_lines=_softmax_grad_lines,
    ),
    "layer_norm": Rule(
        _row_layer_norm,
        (
            "{out}_rstd * ({out}_gx - {out}_gmean - {out}_xhat * {out}_gxmean)",
            "{g} * {out}_xhat",
            "{g}",
            None,
        ),
        lambda a, w, b, eps: torch.nn.functional.layer_norm(a, a.shape[-1:], w, b, eps),
        flops_per_element=8,
        row=True,
        grad_lines=_layer_norm_grad_lines,
    ),
    "rms_norm": Rule(
        _row_rms_norm,
        ("{out}_rstd * ({out}_gx - {out}_xhat * {out}_gxmean)", "{g} * {out}_xhat", None),
        lambda a, w, eps: torch.nn.functional.rms_norm(a, a.shape[-1:], w, eps),
        flops_per_element=5,
        row=True,
        grad_lines=_rms_norm_grad_lines,
    ),
}


@dataclass(frozen=True)
class Lowered:
    """An fx node read as one canonical op: ``operands`` are fx Nodes, Python numbers or None."""

    op: str
    operands: tuple[Any, ...]


def _tensor_val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _binary(op: str) -> Callable[[torch.fx.Node], Lowered | None]:
    def read(node: torch.fx.Node) -> Lowered | None:
        if node.kwargs.get("alpha", 1) != 1:
            return None
        return Lowered(op, tuple(node.args[:2]))

    return read


def _unary(op: str) -> Callable[[torch.fx.Node], Lowered | None]:
    return lambda node: Lowered(op, (node.args[0],))


def _rsub(node: torch.fx.Node) -> Lowered | None:
    if node.kwargs.get("alpha", 1) != 1 or (len(node.args) > 2 and node.args[2] != 1):
        return None
    return Lowered("sub", (node.args[1], node.args[0]))


def _gelu(node: torch.fx.Node) -> Lowered | None:
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return Lowered("gelu_tanh" if approximate == "tanh" else "gelu_erf", (node.args[0],))


def _pow(node: torch.fx.Node) -> Lowered | None:
    exponent = node.args[1]
    ok = isinstance(exponent, int | float) and math.isfinite(exponent)
    ok = ok and (exponent != int(exponent) or 1 <= exponent <= 4 or -3 <= exponent <= -1)
    return Lowered(f"pow:{float(exponent)!r}", (node.args[0],)) if ok else None


def _dropout(node: torch.fx.Node) -> Lowered | None:
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return Lowered("dropout", (node.args[0],)) if (p == 0 or not train) else None


def _cast(dtype: torch.dtype | None, node: torch.fx.Node) -> Lowered | None:
    if dtype is None or not (dtype.is_floating_point or dtype == torch.bool):
        return None
    extra = {k: v for k, v in node.kwargs.items() if k not in ("dtype", "memory_format") and v is not None}
    source = _tensor_val(node.args[0])
    same_device = source is None or extra.get("device") in (None, source.device)
    if not same_device or extra.get("layout", torch.strided) != torch.strided or extra.get("pin_memory"):
        return None
    return Lowered("cast", (node.args[0],))


def _softmax(node: torch.fx.Node) -> Lowered | None:
    """softmax.int(x, dim, dtype=None) and _softmax(x, dim, half_to_float) over the last dim only."""
    val, dim = _tensor_val(node.args[0]), node.args[1]
    third = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype", node.kwargs.get("half_to_float"))
    last = val is not None and dim in (-1, val.dim() - 1)
    return Lowered("softmax", (node.args[0],)) if last and third in (None, False) else None


def _mean(node: torch.fx.Node) -> Lowered | None:
    """mean(x, [-1], keepdim=True): the reduction inside rms_norm written out (HF Llama's RMSNorm)."""
    val = _tensor_val(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    last = val is not None and list(dims or []) in ([-1], [val.dim() - 1])
    plain = keepdim and node.kwargs.get("dtype") is None
    return Lowered("row_mean", (node.args[0],)) if last and plain else None


def _layer_norm(node: torch.fx.Node) -> Lowered | None:
    args = [*node.args] + [None] * (5 - len(node.args))
    x, shape, weight, bias, eps = args[:5]
    eps = node.kwargs.get("eps", 1e-5 if eps is None else eps)
    return Lowered("layer_norm", (x, weight, bias, float(eps))) if len(shape) == 1 else None


def _rms_norm(node: torch.fx.Node) -> Lowered | None:
    args = [*node.args] + [None] * (4 - len(node.args))
    x, shape, weight, eps = args[:4]
    val = _tensor_val(x)
    if len(shape) != 1 or val is None:
        return None
    eps = torch.finfo(val.dtype).eps if eps is None else eps
    return Lowered("rms_norm", (x, weight, float(eps)))


ATEN: dict[Any, Callable[[torch.fx.Node], Lowered | None]] = {
    aten.add.Tensor: _binary("add"),
    aten.add.Scalar: _binary("add"),
    aten.sub.Tensor: _binary("sub"),
    aten.sub.Scalar: _binary("sub"),
    aten.rsub.Scalar: _rsub,
    aten.rsub.Tensor: _rsub,
    aten.mul.Tensor: _binary("mul"),
    aten.mul.Scalar: _binary("mul"),
    aten.div.Tensor: _binary("div"),
    aten.div.Scalar: _binary("div"),
    aten.neg.default: _unary("neg"),
    aten.abs.default: _unary("abs"),
    aten.exp.default: _unary("exp"),
    aten.log.default: _unary("log"),
    aten.sqrt.default: _unary("sqrt"),
    aten.rsqrt.default: _unary("rsqrt"),
    aten.tanh.default: _unary("tanh"),
    aten.sigmoid.default: _unary("sigmoid"),
    aten.relu.default: _unary("relu"),
    aten.silu.default: _unary("silu"),
    aten.gelu.default: _gelu,
    aten.pow.Tensor_Scalar: _pow,
    aten.where.self: lambda node: Lowered("where", tuple(node.args[:3])),
    aten.where.ScalarOther: lambda node: Lowered("where", tuple(node.args[:3])),
    aten.where.ScalarSelf: lambda node: Lowered("where", tuple(node.args[:3])),
    aten.gt.Tensor: _binary("gt"),
    aten.gt.Scalar: _binary("gt"),
    aten.lt.Tensor: _binary("lt"),
    aten.lt.Scalar: _binary("lt"),
    aten.ge.Tensor: _binary("ge"),
    aten.ge.Scalar: _binary("ge"),
    aten.le.Tensor: _binary("le"),
    aten.le.Scalar: _binary("le"),
    aten.dropout.default: _dropout,
    aten.clone.default: lambda node: Lowered("identity", (node.args[0],)) if not node.kwargs else None,
    aten.to.dtype: lambda node: _cast(node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype"), node),
    aten._to_copy.default: lambda node: _cast(node.kwargs.get("dtype"), node),
    aten.softmax.int: _softmax,
    aten._softmax.default: _softmax,
    aten.mean.dim: _mean,
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _rms_norm,
}

FUSIBLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool)
# Ops that may produce booleans; arithmetic on booleans (logical in torch) is left unfused.
BOOLEAN_OK = frozenset({"gt", "lt", "ge", "le", "where", "cast", "identity", "dropout"})
PASS_THROUGH = frozenset({"identity", "dropout", "cast"})
# Row ops that end a group (they write the whole row); ``row_mean`` feeds per-row scalars onward.
ROW_FINAL = frozenset({"softmax", "layer_norm", "rms_norm"})
MAX_ROW_ELEMENTS = 1 << 16  # one row program holds a whole row: longer rows stay unfused


@functools.cache
def rule(op: str) -> Rule:
    """The rule for a canonical op name; ``pow:<exponent>`` names a pow with that scalar exponent."""
    if op.startswith("pow:"):
        exponent = float(op[4:])
        grad_exponent = _pow_expr("{a}", exponent - 1) if exponent != 1 else "1.0"
        return Rule(
            _pow_expr("{a}", exponent),
            (f"{{g}} * {exponent!r} * {grad_exponent}",),
            lambda a: torch.pow(a, exponent),
            flops_per_element=2,
        )
    return RULES[op]


def lower(node: torch.fx.Node) -> Lowered | None:
    """Read a node as a canonical fusible op, or None where it cannot join a fusion group."""
    read = ATEN.get(node.target) if node.op == "call_function" else None
    val = _tensor_val(node)
    if read is None or val is None or val.dtype not in FUSIBLE_DTYPES:
        return None
    lowered = read(node)
    if lowered is None or (val.dtype == torch.bool and lowered.op not in BOOLEAN_OK):
        return None
    for operand in lowered.operands:
        if isinstance(operand, torch.fx.Node):
            operand_val = _tensor_val(operand)
            if operand_val is None or operand_val.dtype not in FUSIBLE_DTYPES:
                return None
        elif operand is not None and not (isinstance(operand, int | float) and math.isfinite(operand)):
            return None
    return lowered
