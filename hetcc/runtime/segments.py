"""Which runs of a stage's ops a CUDA graph can hold (``plan_segments``), and the stage rebuilt with each
run a call of its own submodule (``split_at_segments``), for ``runtime.cudagraphs`` to capture.

A segment is a maximal run of compute between a stage's communication (``hetcc.recv``/``hetcc.send``)
and the ops a graph cannot hold (``BARRIER_RULES``: host syncs, data-dependent shapes, other devices).
Pure fx: it runs, and is tested, on CPU graphs; ``SegmentPlan.format`` prints it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from hetcc.sendrecv import ANCHOR_NAME

MIN_SEGMENT_OPS = 2  # a graph of fewer kernel ops saves less host time than its replay and copies cost
_CALLS = ("call_function", "call_method", "call_module")
_aten = torch.ops.aten
_Device = torch.device | None


def _op(node: fx.Node) -> torch._ops.OpOverload | None:
    """The aten op a node runs: its target, or for a tensor method or torch function the default
    overload of the aten op of that name (``x.item()`` -> ``aten.item.default``)."""
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_module" or not isinstance(name, str):
        return None
    packet = getattr(_aten, name, None)
    return getattr(packet, "default", None) if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _arg(node: fx.Node, position: int, name: str, default: object = None) -> object:
    return node.args[position] if position < len(node.args) else node.kwargs.get(name, default)


def _is_mask(index: object) -> bool:
    """A boolean (or byte) index tensor; one of unknown dtype counts as one (the safe side)."""
    if not isinstance(index, fx.Node):
        return False
    value = index.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.dtype in (torch.bool, torch.uint8)


# Ops torch tags ``dynamic_output_shape`` whose output shape their arguments fix in these cases.
_STATIC_WHEN: dict[torch._ops.OpOverload, Callable[[fx.Node], bool]] = {
    _aten.index.Tensor: lambda node: not any(map(_is_mask, _arg(node, 1, "indices", ()))),
    _aten.repeat_interleave.Tensor: lambda node: node.kwargs.get("output_size") is not None,
    _aten.one_hot.default: lambda node: _arg(node, 1, "num_classes", -1) >= 0,
}
_INDEX_PUTS = (_aten.index_put.default, _aten.index_put_.default, _aten._unsafe_index_put.default)
# Ops torch 2.13 does not tag that still wait for the device (torch._inductor's FORBIDDEN_CUDAGRAPH_OPS,
# and is_nonzero's Python bool), and tensor methods that copy to the host.
HOST_OPS = frozenset({
    "aten::_assert_scalar", "aten::_fused_moving_avg_obs_fq_helper",
    "aten::_fused_moving_avg_obs_fq_helper_functional", "aten::is_nonzero",
})  # fmt: skip
HOST_METHODS = frozenset({"cpu", "tolist", "numpy"})
COMPUTE_HETCC_OPS = frozenset(
    {"hetcc::fusion_group", "hetcc::fusion_group_backward", "hetcc::encode"}
)  # the rest talk


def _is_comm(node: fx.Node, device: _Device) -> bool:
    op = node.target if isinstance(node.target, torch._ops.OpOverload) else None
    return op is not None and op.namespace == "hetcc" and op.name() not in COMPUTE_HETCC_OPS


def _tagged(tag: torch.Tag) -> Callable[[fx.Node, _Device], bool]:
    return lambda node, device: (op := _op(node)) is not None and tag in op.tags


def _shape_from_data(node: fx.Node, device: _Device) -> bool:
    op = _op(node)
    static = _STATIC_WHEN.get(op, lambda node: False)
    return op is not None and torch.Tag.dynamic_output_shape in op.tags and not static(node)


def _masked_put(node: fx.Node, device: _Device) -> bool:
    return node.target in _INDEX_PUTS and any(map(_is_mask, _arg(node, 1, "indices", ())))


def _host_op(node: fx.Node, device: _Device) -> bool:
    if node.op == "call_method":
        return node.target in HOST_METHODS
    return (op := _op(node)) is not None and op.name() in HOST_OPS


def _other_device(node: fx.Node, device: _Device) -> bool:
    named: list[torch.device] = []
    map_aggregate((node.args, node.kwargs), lambda v: named.append(v) if isinstance(v, torch.device) else v)
    return device is not None and any(d.type != device.type for d in named)


# Why a call node stays outside every graph: the first row that matches names the reason.
BARRIER_RULES: tuple[tuple[Callable[[fx.Node, _Device], bool], str], ...] = (
    (_is_comm, "communication with another stage"),
    (_tagged(torch.Tag.data_dependent_output), "reads a tensor's value on the host"),
    (_shape_from_data, "its output shape depends on the data"),
    (_masked_put, "a boolean index makes it call nonzero (a host sync)"),
    (_host_op, "waits for the device (a host sync or a Python value)"),
    (_tagged(torch.Tag.cudagraph_unsafe), "its library tags it cudagraph_unsafe"),
    (_other_device, "names a device other than the stage's (e.g. to(device=cpu) in a GPU stage)"),
)
_ANCHOR_REASON = "communication: the anchor hetcc.recv ties received tensors to"


def barrier_reason(node: fx.Node, device: _Device = None) -> str | None:
    """Why ``node`` cannot be inside a CUDA graph of a stage on ``device`` (None: it can; ``device``
    None: any device it names is fine)."""
    if node.op == "get_attr":
        return _ANCHOR_REASON if node.target == ANCHOR_NAME else None
    if node.op not in _CALLS:
        return None
    return next((why for matches, why in BARRIER_RULES if matches(node, device)), None)


def _written(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` writes into (in-place ops, ``out=``)."""
    if node.op == "call_method":
        return [node.args[0]] if str(node.target).endswith("_") and node.args else []
    written: list[fx.Node] = []
    keep = lambda v: written.append(v) if isinstance(v, fx.Node) else v  # noqa: E731
    schema = node.target._schema if isinstance(node.target, torch._ops.OpOverload) else None
    for position, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.alias_info is not None and argument.alias_info.is_write:
            map_aggregate(_arg(node, position, argument.name), keep)
    return written


def _launches_kernels(node: fx.Node) -> bool:
    """Whether ``node`` does device work a graph saves the launch of (not tuple indexing, an op that
    may return a view, a metadata check): what ``MIN_SEGMENT_OPS`` counts."""
    op = _op(node)
    if node.target is operator.getitem or op is _aten._assert_tensor_metadata.default:
        return False
    return op is None or not op.is_view


def _name_of(target: object) -> str:
    if isinstance(target, (str, torch._ops.OpOverload)):
        return str(target)  # hetcc.send.default
    return getattr(target, "__name__", repr(target))


def _names(nodes: Sequence[fx.Node]) -> str:
    return ", ".join(node.name for node in nodes) or "-"


@dataclass(frozen=True)
class Segment:
    """One run of a stage's compute that becomes a CUDA graph."""

    index: int
    nodes: tuple[fx.Node, ...]  # its call nodes, in graph order
    inputs: tuple[fx.Node, ...]  # values from before it: placeholders, received tensors, earlier ops
    outputs: tuple[fx.Node, ...]  # its values used after it (sent, returned, read by later nodes)
    attributes: tuple[str, ...]  # parameters and buffers it reads (get_attr targets)

    @property
    def ops(self) -> int:
        return sum(map(_launches_kernels, self.nodes))

    def describe(self) -> str:
        where = f"<- {_names(self.inputs)}  -> {_names(self.outputs)}"
        return f"segment {self.index} ({self.ops} ops): {_names(self.nodes)}  {where}"


@dataclass(frozen=True)
class SegmentPlan:
    """A stage graph's segments, the nodes between them with why each stays outside, and the runs too
    short to be worth a graph."""

    graph: fx.Graph
    segments: tuple[Segment, ...]
    outside: dict[fx.Node, str]  # node -> why no graph holds it
    short: tuple[tuple[fx.Node, ...], ...]  # runs of fewer than ``min_ops`` kernel ops, left as they are
    min_ops: int = MIN_SEGMENT_OPS

    def format(self) -> str:
        """One line per segment, per node outside them and per short run, in graph order."""
        segment_at = {segment.nodes[0]: segment for segment in self.segments}
        short_at = {run[0]: run for run in self.short}
        ops = sum(segment.ops for segment in self.segments)
        lines = [f"# CUDA graph segments: {len(self.segments)} ({ops} ops), {len(self.outside)} nodes "
                 f"outside, {len(self.short)} runs under {self.min_ops} ops"]  # fmt: skip
        for node in self.graph.nodes:
            if node in segment_at:
                lines.append(segment_at[node].describe())
            elif node in self.outside:
                lines.append(f"outside {node.name} = {_name_of(node.target)}: {self.outside[node]}")
            elif node in short_at:
                ops = sum(map(_launches_kernels, short_at[node]))
                lines.append(f"uncaptured {_names(short_at[node])}: {ops} op(s), too few for a graph")
        return "\n".join(lines)


def plan_segments(graph: fx.Graph, device: _Device = None, min_ops: int = MIN_SEGMENT_OPS) -> SegmentPlan:
    """The maximal runs of call nodes with no barrier (``barrier_reason``) between them; those of at
    least ``min_ops`` kernel ops are segments. An op that writes into a value from before its run stays
    outside too: its graph would write into its own copy of that value."""
    outside: dict[fx.Node, str] = {}
    runs: list[list[fx.Node]] = [[]]
    for node in graph.nodes:
        reason = barrier_reason(node, device)
        if reason is None and any(v.op != "get_attr" and v not in runs[-1] for v in _written(node)):
            reason = "writes into a value from before its run (a graph would write into its copy)"
        if reason is not None:
            outside[node] = reason
            runs.append([])
        elif node.op in _CALLS:
            runs[-1].append(node)
    long = [run for run in runs if sum(map(_launches_kernels, run)) >= min_ops]
    short = tuple(tuple(run) for run in runs if run and sum(map(_launches_kernels, run)) < min_ops)
    return SegmentPlan(graph, tuple(map(_segment, range(len(long)), long)), outside, short, min_ops)


def _segment(index: int, run: list[fx.Node]) -> Segment:
    members = set(run)
    read = [value for node in run for value in node.all_input_nodes if value not in members]
    inputs = tuple(dict.fromkeys(v for v in read if v.op != "get_attr"))
    attributes = tuple(dict.fromkeys(v.target for v in read if v.op == "get_attr"))
    outputs = tuple(node for node in run if any(user not in members for user in node.users))
    return Segment(index, tuple(run), inputs, outputs, attributes)


def segment_module(module: fx.GraphModule, segment: Segment) -> fx.GraphModule:
    """``segment`` as a module: ``forward(*segment.inputs)`` returns ``segment.outputs`` as a tuple; it
    holds the very parameters and buffers of ``module`` that it reads (shared, not copied)."""
    graph, env = fx.Graph(), {}
    for value in segment.inputs:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)

    def local(value: fx.Node) -> fx.Node:
        if value not in env:  # a get_attr: read inside the segment
            env[value] = graph.get_attr(value.target)
            env[value].meta = dict(value.meta)
        return env[value]

    for node in segment.nodes:
        env[node] = graph.node_copy(node, local)
    graph.output(tuple(env[value] for value in segment.outputs))
    return fx.GraphModule(module, graph, class_name=f"Segment{segment.index}")


def split_at_segments(
    module: fx.GraphModule,
    plan: SegmentPlan,
    call: Callable[[fx.GraphModule], torch.nn.Module] = lambda segment: segment,
) -> fx.GraphModule:
    """``module``'s program with each segment replaced by a call of submodule ``segment_<i>``
    (``call`` of its ``segment_module``) where its last node was: everything it reads comes before
    its first."""
    graph, env = fx.Graph(), {}
    ending = {segment.nodes[-1]: segment for segment in plan.segments}
    inside = {node for segment in plan.segments for node in segment.nodes}
    for node in module.graph.nodes:
        if node in ending:
            _call_segment(graph, env, ending[node])
        elif node not in inside and not (node.op == "get_attr" and node.users and set(node.users) <= inside):
            env[node] = graph.node_copy(node, env.__getitem__)
    calls = {f"segment_{s.index}": call(segment_module(module, s)) for s in plan.segments}
    owned = {n.target: operator.attrgetter(n.target)(module) for n in graph.nodes
             if n.op in ("get_attr", "call_module") and n.target not in calls}  # fmt: skip
    split = fx.GraphModule({**owned, **calls}, graph, class_name=f"{type(module).__name__}Graphed")
    return split.train(module.training)


def _call_segment(graph: fx.Graph, env: dict[fx.Node, fx.Node], segment: Segment) -> None:
    call = graph.call_module(f"segment_{segment.index}", tuple(env[value] for value in segment.inputs))
    for position, value in enumerate(segment.outputs):
        env[value] = graph.create_node("call_function", operator.getitem, (call, position), name=value.name)
        env[value].meta = dict(value.meta)
