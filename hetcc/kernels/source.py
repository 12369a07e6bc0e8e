"""Readable Triton source for a FusionGroup: one ``@triton.jit`` forward kernel, plus a generated
backward kernel where ``group.backward == "generated"``.

Pointwise groups run masked 1-D blocks over the flattened iteration space; row groups run one program
per row of the last dimension (BLOCK >= row length). Inputs with the iteration shape and contiguous
layout are loaded at the flat offset; every other input (bias, scalar tensor, transposed view) is
loaded through per-dimension strides passed as kernel arguments (stride 0 on broadcast dims). Math is
fp32 inside; stores cast back to each output's dtype.

In a row program most values are vectors over the row's lanes, but a row mean, and what is computed
from per-row values and constants alone, is one number per row (a *per-row scalar*) that later ops
broadcast. The backward sums the vector adjoint terms reaching such a value over the valid lanes.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from hetcc.kernels.group import FusionGroup, Instr, group_to_json
from hetcc.kernels.lowering import PASS_THROUGH, ROW_FINAL, rule

_TL_DTYPE = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}


def kernel_source(group: FusionGroup) -> str:
    """The module text: header comment listing replaced ops, forward kernel, backward kernel if any."""
    header = [f"# {group.summary()}", "# replaces:"] + [f"#   {i.replaced}" for i in group.instrs]
    parts = ["\n".join(header), "import triton\nimport triton.language as tl", _forward_kernel(group)]
    if group.backward == "generated":
        parts.append(_backward_kernel(group))
    return "\n\n\n".join(parts) + "\n"


def write_kernel(group: FusionGroup, folder: str | Path) -> Path:
    """Write ``<folder>/kernels/<name>.py`` (the dump/save layout) and, beside it, ``<name>.json``
    (the group, for ``hetcc.kernels.op.load_groups``); returns the ``.py`` path."""
    path = Path(folder) / "kernels" / f"{group.name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kernel_source(group))
    path.with_suffix(".json").write_text(group_to_json(group))
    return path


def strided_inputs(group: FusionGroup) -> list[int]:
    """Inputs loaded through strides (kernel arguments ``in<i>_s<d>``), in argument order."""
    return [i for i, spec in enumerate(group.inputs) if not spec.flat]


def differentiable_inputs(group: FusionGroup) -> list[int]:
    """Floating inputs a gradient reaches from some output: the generated backward writes these."""
    reached = {("tmp", j) for j in group.outputs if group.instrs[j].dtype.is_floating_point}
    for j in reversed(range(len(group.instrs))):
        instr = group.instrs[j]
        if ("tmp", j) in reached and instr.dtype.is_floating_point:
            reached |= {tuple(a) for a, t in zip(instr.args, rule(instr.op).grads) if t is not None}
    return [i for i, spec in enumerate(group.inputs) if spec.dtype.is_floating_point and ("in", i) in reached]


def _signature(group: FusionGroup, pointers: list[str]) -> str:
    rank = len(group.shape)
    scalars = ["n_cols"] if group.kind == "row" else ["numel"]
    if strided_inputs(group):
        scalars += [f"size{d}" for d in range(rank)]
        scalars += [f"in{i}_s{d}" for i in strided_inputs(group) for d in range(rank)]
    return ", ".join([*pointers, *scalars, "BLOCK: tl.constexpr"])


def _prologue(group: FusionGroup) -> list[str]:
    if group.kind == "row":
        lines = ["row = tl.program_id(0).to(tl.int64)", "cols = tl.arange(0, BLOCK)", "mask = cols < n_cols"]
        lines.append("offs = row * n_cols + cols")
    else:
        lines = ["offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)", "mask = offs < numel"]
    if strided_inputs(group):
        rank = len(group.shape)
        lines.append("rest = offs")
        for d in reversed(range(1, rank)):
            lines += [f"idx{d} = rest % size{d}", f"rest = rest // size{d}"]
        lines.append("idx0 = rest")
    return lines


def _loads(group: FusionGroup) -> list[str]:
    lines = []
    for i, spec in enumerate(group.inputs):
        address = "offs" if spec.flat else " + ".join(f"idx{d} * in{i}_s{d}" for d in range(len(group.shape)))
        address = address or "0"
        if spec.dtype == torch.bool:
            lines.append(f"in{i} = tl.load(in{i}_ptr + {address}, mask=mask, other=0) != 0")
        else:
            lines.append(f"in{i} = tl.load(in{i}_ptr + {address}, mask=mask, other=0.0).to(tl.float32)")
    return lines


def _operand(arg: tuple) -> str:
    kind, value = arg
    return {"in": f"in{value}", "tmp": f"t{value}", "const": repr(value), "none": "None"}[kind]


def _compute(group: FusionGroup) -> list[str]:
    lines = []
    for j, instr in enumerate(group.instrs):
        names = [_operand(a) for a in instr.args]
        lines.append(f"# {instr.replaced}")
        lines += _emit(f"t{j}", instr, names, group)
    return lines


def _emit(out: str, instr: Instr, names: list[str], group: FusionGroup) -> list[str]:
    template = rule(instr.op).triton
    if callable(template):
        return template(out, *names)
    if instr.op in PASS_THROUGH:
        return [f"{out} = {_cast(names[0], _source_dtype(instr, group), instr.dtype)}"]
    return [f"{out} = " + template.format(**dict(zip("abc", names)))]


def _source_dtype(instr: Instr, group: FusionGroup) -> torch.dtype:
    kind, value = instr.args[0]
    return group.inputs[value].dtype if kind == "in" else group.instrs[value].dtype


def _cast(name: str, source: torch.dtype, target: torch.dtype) -> str:
    """A dtype conversion in fp32-inside terms: booleans stay int1, narrow floats round-trip."""
    if target == torch.bool:
        return name if source == torch.bool else f"{name} != 0.0"
    if source == torch.bool:
        return f"{name}.to(tl.float32)"
    if target.itemsize < source.itemsize or (target != source and target != torch.float32):
        return f"{_narrow(name, target)}.to(tl.float32)"
    return name


def _narrow(name: str, dtype: torch.dtype) -> str:
    # GPUs round to nearest even, as torch does; Triton 3.9's interpreter truncates fp32 -> bf16.
    return f"{name}.to({_TL_DTYPE[dtype]})"


def _store(pointer: str, value: str, dtype: torch.dtype) -> str:
    converted = value if dtype in (torch.bool, torch.float32) else _narrow(value, dtype)
    return f"tl.store({pointer} + offs, {converted}, mask=mask)"


def _function(name: str, signature: str, body: list[str]) -> str:
    return f"@triton.jit\ndef {name}({signature}):\n" + "\n".join(f"    {line}" for line in body)


def _forward_kernel(group: FusionGroup) -> str:
    pointers = [f"in{i}_ptr" for i in range(len(group.inputs))]
    pointers += [f"out{k}_ptr" for k in range(len(group.outputs))]
    body = _prologue(group) + _loads(group) + _compute(group)
    body += [_store(f"out{k}_ptr", f"t{j}", group.instrs[j].dtype) for k, j in enumerate(group.outputs)]
    return _function(f"{group.name}_fwd", _signature(group, pointers), body)


class _Term(NamedTuple):
    """One contribution to a value's adjoint: a vector over the row's lanes, or one per-row number."""

    expr: str
    per_row: bool


def per_row_scalars(group: FusionGroup) -> set[int]:
    """Instructions whose value is one number per row in a row program: a row mean (``rule.row`` but
    not ``ROW_FINAL``) and ops whose operands are all per-row scalars or constants."""
    found: set[int] = set()
    for j, instr in enumerate(group.instrs if group.kind == "row" else ()):
        if rule(instr.op).row:
            scalar = instr.op not in ROW_FINAL
        else:  # group inputs are loaded as vectors, even a per-row one ([rows, 1]: stride 0 over the row)
            scalar = all(kind == "tmp" and k in found for kind, k in instr.args if kind in ("in", "tmp"))
        found |= {j} if scalar else set()
    return found


def _backward_kernel(group: FusionGroup) -> str:
    """Recompute the chain in registers, then walk it in reverse accumulating adjoints."""
    grads = differentiable_inputs(group)
    pointers = [f"in{i}_ptr" for i in range(len(group.inputs))]
    pointers += [f"gout{k}_ptr" for k in range(len(group.outputs))] + [f"gin{i}_ptr" for i in grads]
    body = _prologue(group) + _loads(group) + _compute(group)
    body += [
        f"gout{k} = tl.load(gout{k}_ptr + offs, mask=mask, other=0.0).to(tl.float32)"
        for k in range(len(group.outputs))
    ]
    terms: dict[str, list[_Term]] = {}
    for k, j in enumerate(group.outputs):
        terms.setdefault(f"t{j}", []).append(_Term(f"gout{k}", per_row=False))
    per_row = per_row_scalars(group)
    for j in reversed(range(len(group.instrs))):
        body += _adjoint(group, j, terms, per_row)
    for i in grads:
        spec = group.inputs[i]
        value = " + ".join(_summands(terms.get(f"in{i}", []), False)) or "tl.zeros([BLOCK], dtype=tl.float32)"
        body.append(f"g_in{i} = {value}")
        body.append(_store(f"gin{i}_ptr", f"g_in{i}", torch.float32 if spec.broadcast else spec.dtype))
    return _function(f"{group.name}_bwd", _signature(group, pointers), body)


def _adjoint(group: FusionGroup, j: int, terms: dict[str, list[_Term]], per_row: set[int]) -> list[str]:
    """Lines computing ``g_t<j>`` (and a row op's row sums of it), and the contributions it sends to
    ``t<j>``'s operands."""
    instr = group.instrs[j]
    if not terms.get(f"t{j}") or not instr.dtype.is_floating_point:
        return []
    op_rule = rule(instr.op)
    names = [_operand(a) for a in instr.args]
    fields = dict(zip("abc", names), g=f"g_t{j}", out=f"t{j}")
    # A row op's gradient is a vector over the row even where its adjoint is per-row (a row mean's).
    sends_per_row = j in per_row and not op_rule.row
    for arg, template in zip(instr.args, op_rule.grads):
        if template is not None and arg[0] in ("in", "tmp"):
            term = _Term(f"({template.format(**fields)})", sends_per_row)
            terms.setdefault(_operand(arg), []).append(term)
    # Eager keeps a value's gradient in the value's dtype; round narrow ones the same way.
    parts = _summands(terms[f"t{j}"], j in per_row)
    total = " + ".join(parts)
    total = _cast(f"({total})" if len(parts) > 1 else total, torch.float32, instr.dtype)
    lines = [f"# d/d {instr.replaced}" + ("  (one per row)" if j in per_row else ""), f"g_t{j} = {total}"]
    return lines + (op_rule.grad_lines(f"t{j}", f"g_t{j}", *names) if op_rule.grad_lines else [])


def _summands(terms: list[_Term], per_row: bool) -> list[str]:
    """What a value's adjoint adds up: its ``terms``, but for a per-row scalar the vector ones summed
    over the row's valid lanes into one (masked-off lanes may hold inf or nan)."""
    vectors = [t.expr for t in terms if not t.per_row]
    if per_row and vectors:
        vectors = [f"tl.sum(tl.where(mask, {' + '.join(vectors)}, 0.0), 0)"]
    return vectors + [t.expr for t in terms if t.per_row]
