"""Rematerialised constants: cut tensors a consuming stage recomputes instead of receiving.

A tensor is *rematerialised* when it depends only on model inputs, buffers and constants (never on a
trainable parameter, never on a random op) and every op computing it is elementwise-cheap: at most
``CHEAP_FLOPS_PER_ELEMENT`` floating-point operations per output element (masks, position ids, the
rotary cos/sin tables, an outer product of positions and frequencies). Recomputing such a tensor costs
a few memory passes over tensors of its size on the consuming device, where sending it costs a link
transfer on the critical path, and every stage reads the model inputs it needs itself (see
``passes.comm``). So the comm pass recomputes these in every stage that uses them and the block chain
does not charge them to any cut: the execution and the price agree.

The rule is structural (op kinds, which values feed which), so it gives the same answer on the graph
the blocks pass prices (before fusion) and the one the comm pass cuts (after it; a fused node is
judged by the records of the ops it replaced).
"""

from __future__ import annotations

import math
import operator

import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from hetcc.ir import NodeInfo, info, is_concrete

CHEAP_FLOPS_PER_ELEMENT = 8
_HEAVY_WORDS = ("mm", "matmul", "linear", "conv", "einsum", "tensordot", "bilinear", "attention")
_COMPUTE = ("call_function", "call_method")


def trainable_values(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter: only these carry gradients over a cut."""
    trainable: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = operator.attrgetter(node.target)(gm)
            if isinstance(attr, torch.nn.Parameter) and attr.requires_grad:
                trainable.add(node)
        elif any(arg in trainable for arg in node.all_input_nodes) or (
            node.op == "call_module"
            and any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
        ):
            trainable.add(node)
    return trainable


def rematerialisable(gm: fx.GraphModule, trainable: set[fx.Node] | None = None) -> set[fx.Node]:
    """Every node a later stage may recompute from model inputs, buffers and constants (module docstring).

    Placeholders and non-trainable attributes are included (they are read, not computed)."""
    trainable = trainable_values(gm) if trainable is None else trainable
    free: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in trainable:
            continue
        if node.op in ("placeholder", "get_attr"):
            free.add(node)
        elif (
            node.op in _COMPUTE
            and all(arg in free for arg in node.all_input_nodes)
            and not _random(node)
            and _cheap(node)
        ):
            free.add(node)
    return free


def _random(node: fx.Node) -> bool:
    """An op whose result depends on the random state (recomputing it would give another value)."""
    tags = getattr(node.target, "tags", ())
    name = str(getattr(node.target, "__name__", node.target))
    return torch.Tag.nondeterministic_seeded in tags or "rand" in name or "dropout" in name


def _cheap(node: fx.Node) -> bool:
    record = info(node)
    if not record.fwd_flops and not record.members:  # not analysed: judge by the op's kind
        return not _counted(node.target)
    return all(_cheap_record(member) for member in record.members or (record,))


def _counted(target) -> bool:
    """A matmul, convolution or attention: an op torch's FLOP counter has a formula for, or a composite
    of those (``aten.matmul``, ``aten.linear``, ``aten.einsum`` as export leaves them)."""
    packet = getattr(target, "overloadpacket", target)
    name = str(getattr(packet, "__name__", target)).lower()
    return packet in flop_registry or any(word in name for word in _HEAVY_WORDS)


def _cheap_record(record: NodeInfo) -> bool:
    """At most CHEAP_FLOPS_PER_ELEMENT flops per output element (decided symbolically if sizes are)."""
    if not record.fwd_flops:
        return True
    if record.shape is None:
        return False
    if is_concrete(record.fwd_flops) and all(is_concrete(d) for d in record.shape):
        return record.fwd_flops <= CHEAP_FLOPS_PER_ELEMENT * math.prod(record.shape)
    elements = sympy.Mul(*record.shape)
    ratio = sympy.simplify(sympy.sympify(record.fwd_flops) / elements)
    return bool(ratio.is_number and ratio <= CHEAP_FLOPS_PER_ELEMENT)
