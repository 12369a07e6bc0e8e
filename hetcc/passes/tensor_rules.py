"""torch's sharding rules for one fx node, asked on specs alone (``torch.distributed.tensor``'s propagator:
no devices, no process group): which placement the op wants of each input, what its result is, and
its non-tensor arguments rewritten for the local shards (a view's shape, for one)."""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema


def propagate(node: fx.Node, placements: dict[fx.Node, object], mesh, degree: int):
    """(wanted placement per tensor input, result placement (a tuple for several results), local args,
    local kwargs) for ``node`` whose tensor inputs have ``placements``; None where torch has no rule, or
    its answer would split a dim unevenly or wants a partial sum of an input."""

    def spec(node_: fx.Node) -> DTensorSpec:
        value = node_.meta["val"]
        return DTensorSpec(mesh, (placements[node_],), TensorMeta(value.shape, value.stride(), value.dtype))

    def to_schema(arg):
        if isinstance(arg, fx.Node) and arg in placements:
            return spec(arg)
        if isinstance(arg, (list, tuple)):
            return type(arg)(to_schema(a) for a in arg)
        return arg

    if node.target in _HETCC_RULES:
        return _HETCC_RULES[node.target](node, placements)
    schema = OpSchema(
        node.target, tuple(to_schema(a) for a in node.args), {k: to_schema(v) for k, v in node.kwargs.items()}
    )
    sharding = _sharding(schema)
    if sharding is None:
        return None
    out = _placements(sharding.output_spec)
    if out is None or not _even(sharding.output_spec, degree):
        return None
    target = sharding.redistribute_schema or schema
    wants: dict[fx.Node, object] = {}

    def back(arg, local):
        if isinstance(arg, fx.Node) and arg in placements:
            placement = local.placements[0]
            if isinstance(placement, Partial) or not _even(local, degree):
                raise _Unusable
            wants[arg] = placement
            return arg
        if isinstance(arg, (list, tuple)):
            return type(arg)(back(a, b) for a, b in zip(arg, local))
        return local

    try:
        args = tuple(back(a, b) for a, b in zip(node.args, target.args_schema))
        kwargs = {k: back(v, target.kwargs_schema.get(k, v)) for k, v in node.kwargs.items()}
    except _Unusable:
        return None
    return wants, out, args, kwargs


_ANSWERS: dict[tuple, object] = {}  # the propagator's answers by question: repeated layers ask once
_MAX_ANSWERS = 1 << 16


def _sharding(schema: OpSchema):
    """torch's answer for ``schema`` (None: no rule), each question asked once. The key is the op and
    every argument, tensors by their full spec (mesh, placement, shape, stride, dtype): torch's own cache
    keys a schema built without its runtime info by less than that."""
    key = _frozen((schema.op, schema.args_schema, schema.kwargs_schema))
    if key is not None and key in _ANSWERS:
        return _ANSWERS[key]
    try:
        answer = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached(schema)
    except Exception:  # noqa: BLE001 - torch raises many kinds for "no rule"; every one means: gather
        answer = None
    if key is not None:
        if len(_ANSWERS) >= _MAX_ANSWERS:
            _ANSWERS.clear()
        _ANSWERS[key] = answer
    return answer


def _frozen(value):
    """``value`` as a hashable key (lists and dicts as tuples), or None where part of it is unhashable."""
    if isinstance(value, (list, tuple)):
        items = [_frozen(v) for v in value]
        return (
            None
            if any(i is None and v is not None for i, v in zip(items, value))
            else (type(value).__name__, *items)
        )
    if isinstance(value, dict):
        return _frozen([(k, v) for k, v in sorted(value.items())])
    try:
        hash(value)
    except TypeError:
        return None
    return value


def _attention(node: fx.Node, placements: dict[fx.Node, object]):
    """Attention with q, k and v split by heads (dim 1) stays split: each device attends its heads; a
    mask broadcast over heads is used whole, one per head split like them. torch's rule goes through
    the op's decomposition, which on CPU picks a fused kernel it has no rule for."""
    q, k, v, *rest = node.args
    if not all(placements.get(x) == Shard(1) for x in (q, k, v)):
        return None
    wants = {q: Shard(1), k: Shard(1), v: Shard(1)}
    mask = rest[0] if rest else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        shape = mask.meta["val"].shape
        wants[mask] = Shard(1) if len(shape) == 4 and shape[1] > 1 else Replicate()
    return wants, Shard(1), node.args, dict(node.kwargs)


_HETCC_RULES = {torch.ops.aten.scaled_dot_product_attention.default: _attention}


class _Unusable(Exception):
    pass


def _placements(spec):
    if spec is None:
        return None
    if isinstance(spec, DTensorSpec):
        placement = spec.placements[0]
        if isinstance(placement, Partial):  # a partial sum is all-reduced; an average or max is not one
            return placement if placement.reduce_op == "sum" else None
        return placement if isinstance(placement, (Replicate, Shard)) else None
    found = tuple(_placements(s) for s in spec)
    return None if any(p is None or isinstance(p, Partial) for p in found) else found


def _even(spec, degree: int) -> bool:
    """Whether every shard in ``spec`` splits its dim into ``degree`` equal parts."""
    if spec is None:
        return True
    if isinstance(spec, DTensorSpec):
        placement = spec.placements[0]
        if type(placement) is Shard:
            return spec.tensor_meta is not None and spec.tensor_meta.shape[placement.dim] % degree == 0
        return isinstance(placement, (Replicate, Partial))
    return all(_even(s, degree) for s in spec)
