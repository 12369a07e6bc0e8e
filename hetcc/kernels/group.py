"""FusionGroup: a chain of fused ops as a small, printable, hashable program.

A group iterates over one shape (every output has it); inputs are loaded once, with broadcasting,
and each ``Instr`` reads group inputs (``("in", i)``), earlier results (``("tmp", j)``) or constants
(``("const", x)``). The group is what the fuse pass records in ``node.meta["hetcc_fusion"]`` and what
code generation, the kernel cache and the custom op work from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from hetcc.errors import PlanFormatError
from hetcc.hardware.schema import finite
from hetcc.kernels.lowering import Lowered, rule

Arg = tuple[str, Any]  # ("in", i) | ("tmp", j) | ("const", float) | ("none", None)


@dataclass(frozen=True)
class TensorSpec:
    """A group input as traced: ``flat`` if it has the iteration shape and is contiguous."""

    name: str  # the fx node it came from
    shape: tuple[Any, ...]
    dtype: torch.dtype
    flat: bool
    broadcast: bool  # its shape differs from the iteration shape (gradients are summed back)
    param: bool  # read from a get_attr node (a parameter or buffer)

    @property
    def nbytes(self) -> Any:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Instr:
    """One replaced op: canonical ``op`` on ``args``, giving a value of ``dtype`` (its eager dtype)."""

    op: str
    args: tuple[Arg, ...]
    dtype: torch.dtype
    replaced: str  # the fx node it replaced, e.g. "mul_1 = aten.mul.Tensor(pow_1, 0.044715)"


@dataclass(frozen=True)
class FusionGroup:
    """A fused kernel's description: what it computes, reads and writes, and how it differentiates."""

    name: str  # kernel / op-argument name: structural, equal groups share it (and one compiled kernel)
    kind: str  # "pointwise" (masked 1-D blocks) or "row" (one program per row of the last dim)
    shape: tuple[Any, ...]  # iteration shape = shape of every output
    inputs: tuple[TensorSpec, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[int, ...]  # instr index stored as each output, in the node's output order
    output_names: tuple[str, ...]  # the fx nodes whose values the outputs carry
    backward: str  # "generated" (a Triton backward kernel) or "recompute" (torch autograd on the ops)
    device: str  # device type of the traced values: "cpu", "cuda", "meta" …

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(instr.op for instr in self.instrs)

    @property
    def output_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.instrs[j].dtype for j in self.outputs)

    @property
    def fwd_flops(self) -> Any:
        return _numel(self.shape) * sum(rule(op).flops_per_element for op in self.ops)

    @property
    def bytes(self) -> Any:
        """One memory pass: every input read once and every output written once."""
        read = sum(spec.nbytes for spec in self.inputs)
        return read + sum(_numel(self.shape) * dtype.itemsize for dtype in self.output_dtypes)

    def summary(self) -> str:
        """One line: name, kind, op chain and backward mode (used in printed code and dumps)."""
        chain = " -> ".join(_short(op) for op in self.ops)
        return f"{self.name}: {self.kind}, {len(self.instrs)} ops ({chain}), backward={self.backward}"


def _short(op: str) -> str:
    return op.replace(":", "")


def _numel(shape: tuple[Any, ...]) -> Any:
    return math.prod(_as_expr(dim) for dim in shape)


def _as_expr(dim: Any) -> Any:
    return dim.node.expr if isinstance(dim, torch.SymInt) else dim


# Bump when generated code changes meaning, so kernels cached under an old name are never reused.
CODEGEN_VERSION = 1


def structural_key(kind: str, inputs, instrs, outputs, backward: str) -> str:
    """Hash of everything the generated source depends on (shapes enter only via flat/broadcast/rank).
    hetcc.config knobs that change generated code belong in ``parts`` too."""
    parts = [f"v{CODEGEN_VERSION}", kind, backward, repr(outputs)]
    parts += [f"{s.dtype}|{s.flat}|{s.broadcast}|{len(s.shape)}" for s in inputs]
    parts += [f"{i.op}|{i.args}|{i.dtype}" for i in instrs]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def retyped(
    group: FusionGroup, input_dtypes: Sequence[torch.dtype], value_dtypes: Sequence[torch.dtype]
) -> FusionGroup:
    """The same computation for other dtypes (inputs, then every instruction's value), named by its
    structure as a group traced in those dtypes would be; ``group`` itself where nothing changes."""
    inputs = tuple(dataclasses.replace(s, dtype=d) for s, d in zip(group.inputs, input_dtypes, strict=True))
    instrs = tuple(dataclasses.replace(i, dtype=d) for i, d in zip(group.instrs, value_dtypes, strict=True))
    if inputs == group.inputs and instrs == group.instrs:
        return group
    key = structural_key(group.kind, inputs, instrs, group.outputs, group.backward)
    return dataclasses.replace(group, name=group_name(instrs, key), inputs=inputs, instrs=instrs)


def group_name(instrs: tuple[Instr, ...], key: str) -> str:
    """A readable, identifier-safe name: the distinct ops in order and a short hash."""
    distinct = list(dict.fromkeys(re.sub(r"\W", "", _short(i.op.split(":")[0])) for i in instrs))
    return f"fused_{'_'.join(distinct)[:48]}_{key[:10]}"


def describe_node(node: torch.fx.Node) -> str:
    """``name = aten.op(args)`` for the comment that lists replaced ops."""
    target = node.target
    op_name = (
        f"aten.{target._overloadpacket.__name__}.{target._overloadname}"
        if isinstance(target, torch._ops.OpOverload)
        else getattr(target, "__name__", str(target))
    )
    args = ", ".join(_describe_arg(a) for a in node.args)
    kwargs = "".join(f", {k}={_describe_arg(v)}" for k, v in node.kwargs.items())
    return f"{node.name} = {op_name}({args}{kwargs})"


def _describe_arg(arg: Any) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, list | tuple):
        return "[" + ", ".join(_describe_arg(a) for a in arg) + "]"
    return repr(arg)


def build_group(
    members: list[torch.fx.Node], lowered: dict[torch.fx.Node, Lowered], outputs: list[torch.fx.Node]
) -> tuple[FusionGroup, list[torch.fx.Node]]:
    """Turn fused fx nodes (topological order) into a FusionGroup; returns (group, input nodes)."""
    index = {node: j for j, node in enumerate(members)}
    input_nodes: list[torch.fx.Node] = []
    instrs = tuple(
        Instr(lowered[n].op, _args(lowered[n], index, input_nodes), n.meta["val"].dtype, describe_node(n))
        for n in members
    )
    shape = group_shape(members)
    specs = tuple(_spec(node, shape) for node in input_nodes)
    kind = "row" if any(rule(i.op).row for i in instrs) else "pointwise"
    # Every group fuse forms differentiates in a generated kernel: a row group's row program holds the
    # whole row, so its reductions' gradients (row sums of the adjoint) are computed there too. A saved
    # group may still say "recompute" (row groups saved before they had a backward kernel): still valid.
    backward = "generated"
    out_index = tuple(index[n] for n in outputs)
    name = group_name(instrs, structural_key(kind, specs, instrs, out_index, backward))
    device = members[-1].meta["val"].device.type
    names = tuple(n.name for n in outputs)
    return FusionGroup(name, kind, shape, specs, instrs, out_index, names, backward, device), input_nodes


def _args(
    lowered: Lowered, index: dict[torch.fx.Node, int], input_nodes: list[torch.fx.Node]
) -> tuple[Arg, ...]:
    """Operands as group references; nodes outside the group are appended to ``input_nodes`` once."""
    args = []
    for operand in lowered.operands:
        if operand is None:
            args.append(("none", None))
        elif not isinstance(operand, torch.fx.Node):
            args.append(("const", float(operand)))
        elif operand in index:
            args.append(("tmp", index[operand]))
        else:
            input_nodes.extend([] if operand in input_nodes else [operand])
            args.append(("in", input_nodes.index(operand)))
    return tuple(args)


def group_shape(members: list[torch.fx.Node]) -> tuple[Any, ...]:
    """The iteration shape: the broadcast of every member's input and output shapes."""
    shapes = [n.meta["val"].shape for m in members for n in (m, *m.all_input_nodes)]
    return tuple(torch.broadcast_shapes(*shapes))


def _spec(node: torch.fx.Node, shape: tuple[Any, ...]) -> TensorSpec:
    val = node.meta["val"]
    full = tuple(val.shape) == shape
    flat = full and val.is_contiguous()
    return TensorSpec(node.name, tuple(val.shape), val.dtype, flat, not full, node.op == "get_attr")


def group_to_json(group: FusionGroup) -> str:
    """The group as JSON (saved beside its kernel so another process can register it again)."""
    data = dataclasses.asdict(group)
    return json.dumps(data, default=_encode, indent=1)


def group_from_json(text: str) -> FusionGroup:
    """Inverse of ``group_to_json``."""
    data = json.loads(text)
    inputs = tuple(
        TensorSpec(**(spec | {"shape": tuple(spec["shape"]), "dtype": _dtype(spec["dtype"])}))
        for spec in data["inputs"]
    )
    instrs = tuple(
        Instr(i["op"], tuple(tuple(a) for a in i["args"]), _dtype(i["dtype"]), i["replaced"])
        for i in data["instrs"]
    )
    tuples = {k: tuple(data[k]) for k in ("shape", "outputs", "output_names")}
    return FusionGroup(**(data | tuples | {"inputs": inputs, "instrs": instrs}))


_NAME = re.compile(r"[A-Za-z_]\w*")
_SYMBOLIC_DIM = re.compile(r"[\w*+ ()-]+")  # str(SymInt), e.g. "32*s27"


def check_group(group: FusionGroup, where: str) -> FusionGroup:
    """``group`` if every value that reaches its generated Triton source is a plain name, a number or a
    known op (the source is compiled and run), else PlanFormatError naming ``where`` and the field."""
    problem = _group_problem(group)
    if problem:
        raise PlanFormatError(
            f"{where}: not a fusion group hetcc wrote: {problem[:200]}", hint="re-save the plan"
        )
    return group


def _group_problem(group: FusionGroup) -> str | None:
    """The first thing wrong with a group read from a file, or None."""
    if not isinstance(group.name, str) or not _NAME.fullmatch(group.name):
        return f"name {group.name!r} is not a Python name"
    if group.kind not in ("pointwise", "row") or group.backward not in ("generated", "recompute"):
        return f"kind {group.kind!r} / backward {group.backward!r} unknown"
    if not isinstance(group.device, str) or not all(isinstance(n, str) for n in group.output_names):
        return "device and output names must be strings"
    for spec in group.inputs:
        if not isinstance(spec.name, str) or not all(
            isinstance(f, bool) for f in (spec.flat, spec.broadcast, spec.param)
        ):
            return f"input {spec.name!r} has a field of the wrong type"
    dims = [*group.shape, *(d for spec in group.inputs for d in spec.shape)]
    if not all(_is_index(d, math.inf) or (isinstance(d, str) and _SYMBOLIC_DIM.fullmatch(d)) for d in dims):
        return "a dimension is neither a size nor a symbol"
    for j, instr in enumerate(group.instrs):
        if not isinstance(instr.op, str) or _known_op(instr.op) is None:
            return f"instrs[{j}]: unknown op {instr.op!r}"
        if not isinstance(instr.replaced, str) or not instr.replaced.isprintable():
            return f"instrs[{j}]: replaced is not one printable line"
        if not all(_arg_ok(arg, len(group.inputs), j) for arg in instr.args):
            return f"instrs[{j}]: an argument is not an input, an earlier result or a number"
    if not group.instrs or not all(_is_index(k, len(group.instrs)) for k in group.outputs):
        return f"outputs {group.outputs!r} are not instruction indices"
    return None


def _known_op(op: str) -> object | None:
    try:
        if op.startswith("pow:") and not math.isfinite(float(op[4:])):
            return None  # its source would name inf or nan
        return rule(op)
    except (KeyError, ValueError):
        return None


def _is_index(value: object, limit: float) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def _arg_ok(arg: object, inputs: int, j: int) -> bool:
    """``("in", i)`` of an input, ``("tmp", k)`` of an earlier result, ``("const", x)`` of a finite number,
    or ``("none", None)``."""
    if not isinstance(arg, tuple) or len(arg) != 2 or not isinstance(arg[0], str):
        return False
    kind, value = arg
    if kind in ("in", "tmp"):
        return _is_index(value, inputs if kind == "in" else j)
    if kind == "const":
        return finite(value)
    return kind == "none" and value is None


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.SymInt):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__} in a fusion group")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanFormatError(
            f"fusion group names unknown dtype {name!r}", hint="re-save the plan with this hetcc"
        )
    return dtype
