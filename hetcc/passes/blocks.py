"""blocks: group nodes into the chain of blocks the partitioner cuts between.

A block is one repeated layer (the child of a ModuleList/Sequential, e.g. ``transformer.h.3``,
``model.layers.0``) found from ``meta["nn_module_stack"]``; what runs before the first layer is the
``embed`` block, after the last the ``head`` block, and glue between layers joins the next layer. A model
without repeated layers is split by its top-level children. A block larger than ``max_block_bytes``
(parameters + saved activations) is split once more by its child modules.

The cut after block i is every tensor produced at or before i and used after it (skip connections and
inputs shared by all layers, like a mask or rotary cos/sin, included). A parameter used on both sides
of a cut (tied embeddings) is not an activation: it is reported once as a ``TiedParam``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import torch.fx

from hetcc.ir import Number, annotate, info, nbytes

_LAYER_PATH = re.compile(r"(^|\.)\d+$")


@dataclass(frozen=True)
class CutTensor:
    """A tensor alive across a cut: produced by ``node`` and last used in ``last_block``."""

    node: str
    bytes: Number
    last_block: str


@dataclass(frozen=True)
class TiedParam:
    """A parameter used by several blocks; held by every stage that runs one of them."""

    name: str
    bytes: int
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    name: str
    nodes: tuple[str, ...]
    fwd_flops: Number
    bwd_flops: Number
    bytes: Number  # read + written by the forward
    param_bytes: int
    act_bytes: Number  # saved for backward, per microbatch
    cut_bytes: Number  # activations crossing to the next block (0 for the last)
    cut_tensors: tuple[CutTensor, ...]


def blocks(gm: torch.fx.GraphModule, ctx=None, *, max_block_bytes: float = math.inf) -> torch.fx.GraphModule:
    """Annotate every node's ``block``; ``collect_blocks(gm)`` then summarises the chain."""
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    names = _run_names(compute)
    if math.isfinite(max_block_bytes):
        names = _split_large(compute, names, max_block_bytes)
    for node, name in zip(compute, names):
        annotate(node, block=name)
    _place_inputs_and_params(nodes, names[0] if names else "model", names[-1] if names else "model")
    return gm


def _stack_paths(node: torch.fx.Node) -> list[str]:
    return [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if path]


def _layer_path(node: torch.fx.Node) -> str | None:
    layers = [p for p in _stack_paths(node) if _LAYER_PATH.search(p)]
    return min(layers, key=len) if layers else None


def _run_names(compute: list[torch.fx.Node]) -> list[str]:
    """Name each compute node's block so that blocks are contiguous runs in topological order."""
    layer_paths = [_layer_path(n) for n in compute]
    if any(layer_paths):
        return _layered_names(layer_paths)
    keys = [(_stack_paths(n) or [None])[0] for n in compute]
    return _uniquify_runs(_fill_gaps(keys, default="model"))


def _layered_names(layer_paths: list[str | None]) -> list[str]:
    first = next(i for i, p in enumerate(layer_paths) if p)
    last = max(i for i, p in enumerate(layer_paths) if p)
    names: list[str] = []
    for i, path in enumerate(layer_paths):
        if i < first:
            names.append("embed")
        elif i > last:
            names.append("head")
        else:
            names.append(path or next(p for p in layer_paths[i:] if p))  # glue joins the next layer
    return _uniquify_runs(names)


def _fill_gaps(keys: list[str | None], default: str) -> list[str]:
    """Nodes without a module scope join the run they sit in (or the next one at the start)."""
    following = next((k for k in keys if k), default)
    filled, current = [], None
    for key in keys:
        current = key or current or following
        filled.append(current)
    return filled


def _uniquify_runs(names: list[str]) -> list[str]:
    """A name that comes back after another run becomes a new block (``name#2``) to stay contiguous."""
    result, counts, previous = [], defaultdict(int), None
    for name in names:
        if name != previous:
            counts[name] += 1
            previous = name
        result.append(name if counts[name] == 1 else f"{name}#{counts[name]}")
    return result


def _split_large(compute: list[torch.fx.Node], names: list[str], limit: float) -> list[str]:
    """Split blocks whose parameters + saved activations exceed ``limit`` by their child modules."""
    sizes: dict[str, float] = defaultdict(float)
    for node, name in zip(compute, names):
        record = info(node)
        sizes[name] += float(record.act_bytes) + sum(info(a).param_bytes for a in node.all_input_nodes)
    result = []
    for node, name in zip(compute, names):
        if sizes[name] <= limit:
            result.append(name)
            continue
        child = next((p for p in _stack_paths(node) if p.startswith(name + ".")), None)
        result.append(f"{name}/{child.removeprefix(name + '.')}" if child else None)
    return _uniquify_runs(_fill_gaps(result, default=names[0]))


def _place_inputs_and_params(nodes: list[torch.fx.Node], first: str, last: str) -> None:
    """Inputs and parameters belong to the block of their first user; the output to the last block."""
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            users = [info(u).block for u in node.users if info(u).block is not None]
            annotate(node, block=users[0] if users else first)
        elif node.op == "output":
            annotate(node, block=last)


# --------------------------------------------------------------------------------- the summary


def collect_blocks(gm: torch.fx.GraphModule) -> tuple[list[Block], list[TiedParam]]:
    """The block chain with per-block totals and cuts, and the parameters shared across blocks."""
    order: list[str] = []
    members: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        name = info(node).block
        if name is None:
            continue
        if name not in members:
            order.append(name)
        members[name].append(node)
    index = {name: i for i, name in enumerate(order)}
    crossing, tied = _crossings(gm, index, order)
    chain = [_summarize(name, members[name], crossing[i]) for i, name in enumerate(order)]
    return chain, tied


def _crossings(gm, index: dict[str, int], order: list[str]):
    crossing: list[list[CutTensor]] = [[] for _ in order]
    tied: list[TiedParam] = []
    for node in gm.graph.nodes:
        if node.op == "output" or info(node).block is None:
            continue
        produced = index[info(node).block]
        used = sorted({index[info(u).block] for u in node.users if info(u).block is not None})
        if not used or used[-1] <= produced:
            continue
        if node.op == "get_attr":
            blocks_using = tuple(order[i] for i in sorted(set(used) | {produced}))
            tied.append(TiedParam(str(node.target), int(info(node).param_bytes), blocks_using))
            continue
        cut = CutTensor(node.name, nbytes(node.meta.get("val")), order[used[-1]])
        for boundary in range(produced, used[-1]):
            crossing[boundary].append(cut)
    return crossing, tied


def _summarize(name: str, nodes: list[torch.fx.Node], cut: list[CutTensor]) -> Block:
    records = [info(n) for n in nodes]
    return Block(
        name=name,
        nodes=tuple(n.name for n in nodes),
        fwd_flops=sum((r.fwd_flops for r in records), 0),
        bwd_flops=sum((r.bwd_flops for r in records), 0),
        bytes=sum((r.bytes for r in records), 0),
        param_bytes=sum(r.param_bytes for r in records),
        act_bytes=sum((r.act_bytes for r in records), 0),
        cut_bytes=sum((c.bytes for c in cut), 0),
        cut_tensors=tuple(cut),
    )
