"""fuse: chains of pointwise ops (optionally ending in one row-wise softmax / layer_norm / rms_norm)
become one call of ``hetcc.kernels.launch.fused`` each (its cached launcher), costed as one memory pass.

Groups are grown greedily in topological order. A node joins its producers' groups (merged, so siblings
reading one value fuse too) when it is fusible (``hetcc.kernels.lowering``), its shape and the
group's broadcast one into the other, it shares their stage and block, and every value the group already computes
that is used outside it is used only *after* the node (so the fused node can stand where the group's
last member stood). Values used outside become extra outputs. Send/recv and any op without a lowering
are never members, so a group cannot cross them. A group holds at most one row reduction over its last
dim: softmax / layer_norm / rms_norm end it; a keepdim mean (rms_norm written out) lets pointwise ops
on the per-row result follow.

Which groups fuse is the cost pass's choice (``passes/cost.py``): ``fusion_candidates`` finds the groups
without changing the graph, the cost pass prices each as one kernel call and as its ops on every device
type, and once the partition has put every block on a device, ``fuse`` replaces the groups chosen for
their stage's device type.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from hetcc import config, ir
from hetcc.ir import info, number_at
from hetcc.kernels.cache import describe_backend
from hetcc.kernels.group import FusionGroup, build_group, group_shape
from hetcc.kernels.launch import fused as FUSED_CALL
from hetcc.kernels.lowering import MAX_ROW_ELEMENTS, ROW_FINAL, Lowered, lower, rule
from hetcc.kernels.op import FUSION_META_KEY, register_group
from hetcc.kernels.source import kernel_source

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


class _Group:
    """A group being grown: members in topological order, the iteration shape, and whether it holds
    its one row reduction (``reduced``) or ended with a row op that writes whole rows (``closed``)."""

    def __init__(self, node: torch.fx.Node, lowered: Lowered):
        self.members = [node]
        self.shape = _iteration_shape(node, lowered)
        self.stage, self.block = ir.info(node).stage, ir.info(node).block
        self.reduced = _is_row(lowered)
        self.closed = lowered.op in ROW_FINAL
        self.merged = False  # folded into another group


@dataclass(frozen=True)
class FusionCandidate:
    """A group ``fuse`` could replace: its members (topological order), the kernel it would be, and
    the fused node's record (one memory pass; what the cost pass prices it by)."""

    members: tuple[torch.fx.Node, ...]
    group: FusionGroup
    record: ir.NodeInfo


def fusion_candidates(gm: torch.fx.GraphModule) -> list[FusionCandidate]:
    """Every group of >= 2 fusible ops in ``gm`` (``find_groups``) whose values something reads, the graph
    left as it is (a group nothing reads, such as a cast a stage's split left unused, has no kernel to
    be). Sizes may be symbolic (a trace with a dynamic batch): the microbatch search prices the groups at
    each size."""
    lowered = {n: low for n in gm.graph.nodes if (low := lower(n)) is not None}
    found = []
    for members in find_groups(gm.graph, lowered):
        outputs = _outputs(members)
        if not outputs:
            continue
        group, input_nodes = build_group(members, lowered, outputs)
        found.append(FusionCandidate(tuple(members), group, _fused_record(group, members, input_nodes)))
    return found


def fuse(
    gm: torch.fx.GraphModule, candidates: Sequence[FusionCandidate] | None = None
) -> torch.fx.GraphModule:
    """Replace each of ``candidates`` (of ``fusion_candidates(gm)``; all of them by default) by one
    fused node standing where its last member stood; returns ``gm``."""
    for candidate in fusion_candidates(gm) if candidates is None else candidates:
        group = _replace(gm.graph, list(candidate.members))
        if config.debug >= 3:
            print(kernel_source(group))
    gm.graph.lint()
    install_code_comments(gm)  # recompiles
    return gm


def find_groups(graph: torch.fx.Graph, lowered: dict[torch.fx.Node, Lowered]) -> list[list[torch.fx.Node]]:
    """Maximal fusible groups (lists of nodes in topological order) of two or more ops."""
    position = {node: k for k, node in enumerate(graph.nodes)}
    group_of: dict[torch.fx.Node, _Group] = {}
    groups: list[_Group] = []
    for node in graph.nodes:
        if node not in lowered or (_is_row(lowered[node]) and not _row_fits(node)):
            continue
        candidates = list(
            {id(g): g for a in lowered[node].operands if (g := group_of.get(a)) is not None}.values()
        )
        options = _join_options(candidates, node, lowered[node])
        chosen = next((o for o in options if _can_join(o, node, lowered[node], position)), None)
        if chosen is None:
            group = _Group(node, lowered[node])
            groups.append(group)
        else:
            group = _merge(chosen, position)
            group.members.append(node)
            group.reduced = group.reduced or _is_row(lowered[node])
            group.closed = lowered[node].op in ROW_FINAL
            group.shape = tuple(torch.broadcast_shapes(group.shape, _iteration_shape(node, lowered[node])))
            for member in group.members:
                group_of[member] = group
        group_of[node] = group
    kept = [_without_narrow_outputs(g.members) for g in groups if not g.merged]
    return [members for members in kept if len(members) >= 2]


def _without_narrow_outputs(members: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Drop members narrower than the group's shape that are used outside it (a kernel writes outputs
    of the iteration shape only), with their in-group ancestors so nothing dropped needs the kernel."""
    shape, inside = group_shape(members), set(members)
    narrow_outputs = [m for m in _outputs(members) if tuple(m.meta["val"].shape) != shape]
    dropped: set[torch.fx.Node] = set()
    while narrow_outputs:
        node = narrow_outputs.pop()
        if node not in dropped:
            dropped.add(node)
            narrow_outputs += [a for a in node.all_input_nodes if a in inside]
    return [m for m in members if m not in dropped]


def _join_options(candidates: list[_Group], node: torch.fx.Node, lowered: Lowered) -> list[list[_Group]]:
    """Groups ``node`` may join: all open, compatible producer groups merged (siblings reading one
    value fuse too), then each producer group alone, largest first."""
    open_groups = [g for g in candidates if _compatible(g, node, lowered)]
    merged = [open_groups] if len(open_groups) > 1 else []
    return merged + [[g] for g in sorted(open_groups, key=lambda g: -len(g.members))]


def _compatible(group: _Group, node: torch.fx.Node, lowered: Lowered) -> bool:
    record = ir.info(node)
    if group.closed or (record.stage, record.block) != (group.stage, group.block):
        return False
    if _is_row(lowered):  # one reduction per group, over rows of the group's own shape
        return not group.reduced and _iteration_shape(node, lowered) == group.shape
    shape = tuple(node.meta["val"].shape)
    # The node widens the group, or is narrower (e.g. per-row statistics after a reduction).
    return _covers(shape, group.shape) or _covers(group.shape, shape)


def _iteration_shape(node: torch.fx.Node, lowered: Lowered) -> tuple:
    """The shape a node iterates over: its input's for a reduction, else its own."""
    source = lowered.operands[0] if _is_row(lowered) else node
    return tuple(source.meta["val"].shape)


def _covers(shape: tuple, smaller: tuple) -> bool:
    """Whether ``smaller`` broadcasts to ``shape`` (a group's values may be narrower than its outputs)."""
    try:
        return tuple(torch.broadcast_shapes(shape, smaller)) == shape
    except RuntimeError:
        return False


def _merge(groups: list[_Group], position: dict) -> _Group:
    """Fold ``groups`` into the first one (members kept in topological order)."""
    head = groups[0]
    for other in groups[1:]:
        head.members = sorted(head.members + other.members, key=position.__getitem__)
        other.merged = True
    return head


def _is_row(lowered: Lowered) -> bool:
    return rule(lowered.op).row


def _row_fits(node: torch.fx.Node) -> bool:
    shape = node.meta["val"].shape
    return len(shape) >= 1 and isinstance(shape[-1], int) and shape[-1] <= MAX_ROW_ELEMENTS


def _can_join(groups: list[_Group], node: torch.fx.Node, lowered: Lowered, position: dict) -> bool:
    members = {m for g in groups for m in g.members}
    if _is_row(lowered) and lowered.operands[0] not in members:
        return False  # the row op's main input must be the chain's value
    # Everything the group hands to other nodes must be consumed after the fused node's position.
    return all(
        position[user] > position[node]
        for member in members
        for user in member.users
        if user is not node and user not in members and user.target is not _ASSERT_METADATA
    )


def _outputs(members: list[torch.fx.Node]) -> list[torch.fx.Node]:
    inside = set(members)
    return [n for n in members if any(u not in inside and u.target is not _ASSERT_METADATA for u in n.users)]


def _replace(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> FusionGroup:
    """Put one fused node (and a getitem per output) where the group's last member stood."""
    outputs = _outputs(members)
    # Lowered afresh: an earlier replacement may have rewired this group's inputs to getitem nodes.
    group, input_nodes = build_group(members, {n: lower(n) for n in members}, outputs)
    register_group(group)
    last, inside = members[-1], set(members)
    with graph.inserting_before(last):
        fused = graph.create_node(
            "call_function", FUSED_CALL, (list(input_nodes), group.name), name="fusion_group"
        )
        fused.meta.update(_fused_meta(group, members, input_nodes, outputs))
        for k, out in enumerate(outputs):
            item = graph.call_function(operator.getitem, (fused, k))
            item.meta.update(
                {key: out.meta[key] for key in ("val", "nn_module_stack", ir.META_KEY) if key in out.meta}
            )
            out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for node in reversed(members):
        for user in list(node.users):
            if user.target is _ASSERT_METADATA:
                graph.erase_node(user)
        graph.erase_node(node)
    return group


def _fused_meta(group: FusionGroup, members, input_nodes, outputs) -> dict[str, Any]:
    last = members[-1]
    meta = {key: last.meta[key] for key in ("nn_module_stack", "stack_trace") if key in last.meta}
    meta["val"] = [out.meta["val"] for out in outputs]
    meta[FUSION_META_KEY] = group
    meta[ir.META_KEY] = _fused_record(group, members, input_nodes)
    return meta


def _fused_record(group: FusionGroup, members, input_nodes) -> ir.NodeInfo:
    """One memory pass: bytes = inputs read once + outputs written once; flops summed over members."""
    records = [ir.info(n) for n in members]
    saved = sum(s.nbytes for s in group.inputs if not s.param)  # what the backward keeps
    training = any(r.act_bytes for r in records)
    return ir.NodeInfo(
        shape=group.shape,
        dtype=group.output_dtypes[0],
        fwd_flops=sum(r.fwd_flops for r in records) or group.fwd_flops,
        bwd_flops=sum(r.bwd_flops for r in records),
        bytes=group.bytes,
        param_bytes=sum(s.nbytes for s in group.inputs if s.param),
        act_bytes=saved if training else 0,
        block=records[-1].block,
        stage=records[-1].stage,
        fwd_s=_summed(r.fwd_s for r in records),
        bwd_s=_summed(r.bwd_s for r in records),
        notes=(f"fused {len(members)} ops, backward={group.backward}",),
        members=tuple(records),
    )


def _summed(times) -> tuple[tuple[str, float], ...]:
    """Per device type, the members' seconds summed: a costed graph's fused node takes its members'
    time (the cost pass gave the kernel's to the last member where the group fuses)."""
    total: dict[str, float] = {}
    for pairs in times:
        for device_type, seconds in pairs:
            total[device_type] = total.get(device_type, 0.0) + seconds
    return tuple(total.items())


def install_code_comments(gm: torch.fx.GraphModule) -> None:
    """Make ``gm.code`` print, above each fused node, its group summary, backend and replaced ops.

    Uses fx's public ``Graph.on_generate_code`` hook. Idempotent; recompiles ``gm``. A copied or split
    graph shares the hook of the one it came from: calling this on the copy replaces the inherited hook
    with one that reads the copy's own nodes.
    """
    graph_ref = weakref.ref(gm.graph)

    def wrap(current):
        own = getattr(current, "hetcc_graph", None)
        if own is not None and own() is gm.graph:
            return current
        previous = current.hetcc_previous if own is not None else current

        def transform(body: list[str]) -> list[str]:
            body = previous(body) if previous else body
            graph = graph_ref()
            return body if graph is None else _with_comments(body, graph)

        transform.hetcc_graph, transform.hetcc_previous = graph_ref, previous
        return transform

    gm.graph.on_generate_code(wrap)
    gm.recompile()


def _with_comments(body: list[str], graph: torch.fx.Graph) -> list[str]:
    fused = {n.name: n.meta[FUSION_META_KEY] for n in graph.nodes if FUSION_META_KEY in n.meta}
    result = []
    for line in body:
        name = line.split(" = ", 1)[0].strip()
        if name in fused and " = " in line:
            result += [f"# {comment}\n" for comment in fusion_comment(fused[name])]
        result.append(line)
    return result


def fusion_comment(group: FusionGroup) -> list[str]:
    """The comment lines printed above a fused node (also usable in dumps)."""
    return [f"{group.summary()}, {describe_backend(group.device)}"] + [
        f"  {i.replaced}" for i in group.instrs
    ]


@dataclass
class FusionChoice:
    """Which fusion candidates fuse on each device type, and why.

    A group fuses on a type where its block's forward and backward, priced in the host/GPU queue
    with the group as one kernel call, are faster than with its ops (groups decided in graph order,
    each with the earlier ones of its block as decided). On a ``cpu`` type a fused group runs its
    ops and replays them in backward: it never fuses there unless ``fuse="all"``.
    """

    candidates: Sequence[FusionCandidate]
    fused: dict[str, frozenset[int]]  # device type -> indices of the candidates fused on it
    # device type -> per candidate: its block's seconds with it fused, and with it as ops
    compared: dict[str, list[tuple[float, float]]]

    def act_bytes_change(self, block_names: Sequence[str], subs: dict | None = None) -> list[float]:
        """Per block, the most any device type's fusion changes the bytes it saves for backward (a
        fused group saves its inputs, its ops what each needs): the partition's memory then holds on
        every type a block may run on. ``subs``: the dims of a symbolic analysis."""
        index = {name: i for i, name in enumerate(block_names)}
        value = functools.partial(number_at, subs=subs or {})
        change = {t: [0.0] * len(block_names) for t in self.fused}
        for t, chosen in self.fused.items():
            for k in chosen:
                candidate = self.candidates[k]
                block = index.get(info(candidate.members[-1]).block)
                if block is not None:
                    ops = sum(value(info(m).act_bytes) for m in candidate.members)
                    change[t][block] += value(candidate.record.act_bytes) - ops
        return [max((change[t][i] for t in change), default=0.0) for i in range(len(block_names))]

    def note(self, stage_types: Sequence[str]) -> str | None:
        """One line for the plan: how many groups fused on the stages' device types, and where the
        others stayed ops and why."""
        if not self.candidates:
            return None
        counts = {t: len(self.fused.get(t, ())) for t in dict.fromkeys(stage_types)}
        unfused = {t: len(self.candidates) - n for t, n in counts.items() if n < len(self.candidates)}
        if not unfused:
            return None
        where = ", ".join(f"{t}: {n} of {len(self.candidates)} fused" for t, n in counts.items())
        return (
            f"fusion: {len(self.candidates)} fusible groups; {where}. A group stays as its ops where one "
            "kernel call, its host time included, is not faster than them on the stage's device type "
            "(small tensors, where each call's host time outweighs the memory passes it saves; on a CPU "
            "always). HETCC_FUSE=all fuses every group, HETCC_FUSE=off none"
        )

    def lines(self) -> list[str]:
        """For the cost dump: each candidate's block priced fused and as ops on every device type."""
        out = []
        for k, candidate in enumerate(self.candidates):
            prices = ", ".join(
                f"{t} {'fused' if k in chosen else 'ops'} "
                f"({self.compared[t][k][0] * 1e6:.1f} vs {self.compared[t][k][1] * 1e6:.1f} us)"
                for t, chosen in self.fused.items()
            )
            out.append(f"%{candidate.members[-1].name} {candidate.group.summary()}: {prices}")
        return out
