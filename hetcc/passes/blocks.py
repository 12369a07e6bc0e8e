"""blocks: group nodes into the chain of blocks the partitioner cuts between.

A block is one repeated layer (the child of a ModuleList/Sequential, e.g. ``transformer.h.3``,
``model.layers.0``) found from ``meta["nn_module_stack"]``; what runs before the first layer is the
``embed`` block, after the last the ``head`` block, and glue between layers joins the next layer. A model
without repeated layers is split by its top-level children. A block larger than ``max_block_bytes``
(parameters + saved activations) is split once more by its child modules. A block that holds no
parameters (an activation, dropout or pooling module of an ``nn.Sequential``) joins the block before it,
so a cut never separates a layer from its activation.

The chain follows the computation: blocks are contiguous runs of compute nodes in topological order,
ordered by their first compute node, and parameters and inputs belong to the block of their first user
(an exported graph lists parameters first, in ``named_parameters()`` order, which is not compute order).
So data only flows forward along the chain and every contiguous split is a valid pipeline;
``collect_blocks`` checks that invariant.

The cut after block i is every tensor produced at or before i and used after it (skip connections
included; an encoder's output crosses every decoder cut), except model inputs (every stage reads its
own) and tensors computed cheaply from inputs and constants alone, like a mask or rotary cos/sin, which
every stage that uses them recomputes (``passes.remat``). A parameter used on both sides of a cut (tied
embeddings) is not an activation: it is reported once as a ``TiedParam``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx

from hetcc.errors import AnalysisError
from hetcc.ir import Number, annotate, human, info, is_concrete, nbytes
from hetcc.passes.remat import rematerialisable, trainable_values

_LAYER_PATH = re.compile(r"(^|\.)\d+$")
_COMPUTE = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class CutTensor:
    """A tensor alive across a cut: produced by ``node`` in block ``producer``, used by the later blocks
    ``consumers`` (the last is ``last_block``); ``grad``: its gradient crosses back in training (it
    depends on a trainable parameter). The runtime sends it once from the producer's stage to each
    stage holding a consumer."""

    node: str
    bytes: Number
    last_block: str
    grad: bool = True
    producer: str = ""
    consumers: tuple[str, ...] = ()


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

    @property
    def cut_grad_bytes(self) -> Number:
        """Gradient bytes crossing back over the cut after this block (training)."""
        return sum((c.bytes for c in self.cut_tensors if c.grad), 0)


def crossing_once(chain: Sequence[Block]) -> list[CutTensor]:
    """Every tensor that crosses a cut, once (its first record with consumers), in chain order: what the
    runtime sends, from its producer's stage to each stage holding a consumer."""
    seen: dict[str, CutTensor] = {}
    for block in chain:
        for c in block.cut_tensors:
            if c.consumers:
                seen.setdefault(c.node, c)
    return list(seen.values())


def blocks(gm: torch.fx.GraphModule, *, max_block_bytes: float = math.inf) -> torch.fx.GraphModule:
    """Annotate every node's ``block``; ``collect_blocks(gm)`` then summarises the chain."""
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    names = _run_names(compute)
    if math.isfinite(max_block_bytes):
        names = _split_large(compute, names, max_block_bytes)
    names = _join_parameter_free(compute, names)
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
    """Split blocks whose parameters + saved activations exceed ``limit`` by their child modules. Under a
    symbolic batch the sizes are judged at the traced example's (the symbols' hints)."""
    sizes: dict[str, float] = defaultdict(float)
    hint = _hints(compute)
    for node, name in zip(compute, names):
        record = info(node)
        sizes[name] += hint(record.act_bytes) + sum(hint(info(a).param_bytes) for a in node.all_input_nodes)
    result = []
    for node, name in zip(compute, names):
        if sizes[name] <= limit:
            result.append(name)
            continue
        child = next((p for p in _stack_paths(node) if p.startswith(name + ".")), None)
        result.append(f"{name}/{child.removeprefix(name + '.')}" if child else None)
    return _uniquify_runs(_fill_gaps(result, default=names[0]))


def _hints(nodes: list[torch.fx.Node]):
    """A size as a float: a symbolic one at the value its symbols had in the traced example."""
    env = next(
        (d.node.shape_env for n in nodes if isinstance(v := n.meta.get("val"), torch.Tensor)
         for d in v.shape if isinstance(d, torch.SymInt)),
        None,
    )  # fmt: skip
    return lambda size: float(
        size if env is None or is_concrete(size) else env.optimization_hint(sympy.sympify(size))
    )


def _holds_parameters(node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return info(node).param_bytes > 0
    return any(a.op == "get_attr" and info(a).param_bytes > 0 for a in node.all_input_nodes)


def _join_parameter_free(compute: list[torch.fx.Node], names: list[str]) -> list[str]:
    """A run of nodes that reads no parameter joins the run before it (the first run, the one after)."""
    runs = [list(run) for _, run in itertools.groupby(range(len(names)), key=names.__getitem__)]
    holds = [any(_holds_parameters(compute[i]) for i in run) for run in runs]
    if not any(holds):
        return names
    first_holding = holds.index(True)
    result = list(names)
    for k, run in enumerate(runs):
        if holds[k]:
            owner = names[run[0]]
        elif k < first_holding:
            owner = names[runs[first_holding][0]]
        for i in run:
            result[i] = owner
    return result


def _place_inputs_and_params(nodes: list[torch.fx.Node], first: str, last: str) -> None:
    """Inputs and parameters belong to the block of their first user in graph order (never to their
    placeholder position); the output to the last block."""
    position = {node: i for i, node in enumerate(nodes)}
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            users = sorted((u for u in node.users if info(u).block is not None), key=position.__getitem__)
            annotate(node, block=info(users[0]).block if users else first)
        elif node.op == "output":
            annotate(node, block=last)


# --------------------------------------------------------------------------------- the summary


def collect_blocks(gm: torch.fx.GraphModule) -> tuple[list[Block], list[TiedParam]]:
    """The block chain in compute order with per-block totals and cuts, and the parameters shared
    across blocks. Raises ``AnalysisError`` if data would flow backwards along the chain."""
    members: dict[str, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if info(node).block is not None:
            members[info(node).block].append(node)
    order = _compute_order(gm, members)
    index = {name: i for i, name in enumerate(order)}
    _check_forward_only(gm, index)
    crossing, tied = _crossings(gm, index, order)
    chain = [_summarize(name, members[name], crossing[i]) for i, name in enumerate(order)]
    return chain, tied


def _compute_order(gm: torch.fx.GraphModule, members: dict[str, list[torch.fx.Node]]) -> list[str]:
    """Block names ordered by their first compute node; blocks of inputs alone keep graph order."""
    first: dict[str, int] = {}
    for position, node in enumerate(gm.graph.nodes):
        name = info(node).block
        if name is not None and node.op in _COMPUTE and name not in first:
            first[name] = position
    order = sorted(first, key=first.__getitem__)
    return order + [name for name in members if name not in first]


def _check_forward_only(gm: torch.fx.GraphModule, index: dict[str, int]) -> None:
    """Every compute node reads only tensors of its own or an earlier block: any contiguous split of
    the chain is then a pipeline whose stages send only forward."""
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE or info(node).block is None:
            continue
        for arg in node.all_input_nodes:
            if arg.op in _COMPUTE and index[info(arg).block] > index[info(node).block]:
                raise AnalysisError(
                    f"block chain: %{node.name} (block {info(node).block}) reads %{arg.name} from the later "
                    f"block {info(arg).block}",
                    hint="this is a hetcc bug; please report it with the model's dump folder",
                )


def _crossings(gm, index: dict[str, int], order: list[str]):
    crossing: list[list[CutTensor]] = [[] for _ in order]
    tied: list[TiedParam] = []
    trainable = trainable_values(gm)
    free = rematerialisable(gm, trainable)  # recomputed by each stage that needs it: never sent
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
        if node in free:
            continue
        val = node.meta.get("val")
        grad = node in trainable and bool(getattr(val, "dtype", torch.int64).is_floating_point)
        later = tuple(order[i] for i in used if i > produced)
        cut = CutTensor(node.name, nbytes(val), order[used[-1]], grad, order[produced], later)
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


def format_blocks(
    chain: list[Block], tied: list[TiedParam], dim_symbols: Mapping[str, Any] | None = None
) -> str:
    """The block chain as a table, then every cut's crossing tensors by name, then tied parameters.
    ``dim_symbols`` (``torch.export.Dim`` name -> torch's symbol) prints ``batch`` where torch has ``s70``."""
    names = {
        symbol: sympy.Symbol(name, integer=True, positive=True)
        for name, symbol in (dim_symbols or {}).items()
    }

    def h(value, unit: str = ""):
        return human(value.subs(names) if names and isinstance(value, sympy.Basic) else value, unit)

    lines = [
        f"{'block':<24} {'nodes':>6} {'fwd flop':>10} {'bwd flop':>10} {'params':>9} {'saved act':>10} {'cut':>9}"
    ]
    for b in chain:
        lines.append(
            f"{b.name:<24} {len(b.nodes):>6} {h(b.fwd_flops):>10} {h(b.bwd_flops):>10} "
            f"{h(b.param_bytes, 'B'):>9} {h(b.act_bytes, 'B'):>10} {h(b.cut_bytes, 'B'):>9}"
        )
    lines.append(
        f"total: {len(chain)} blocks, {h(sum((b.fwd_flops for b in chain), 0))} fwd flop, "
        f"{h(sum((b.bwd_flops for b in chain), 0))} bwd flop, {h(sum(b.param_bytes for b in chain), 'B')} params"
    )
    lines.append("\ncuts (tensors alive across each boundary, per microbatch):")
    for left, right in zip(chain, chain[1:]):
        crossing = ", ".join(
            f"%{c.node} {h(c.bytes, 'B')} (to {c.last_block}{'' if c.grad else ', no gradient'})"
            for c in left.cut_tensors
        )
        lines.append(f"  {left.name} | {right.name}: {h(left.cut_bytes, 'B')} = {crossing or 'nothing'}")
    if tied:
        lines.append("\ntied parameters (held by every stage that uses them, counted once above):")
        lines.extend(f"  {t.name} {h(t.bytes, 'B')} used by {', '.join(t.blocks)}" for t in tied)
    return "\n".join(lines)
