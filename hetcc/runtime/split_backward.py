"""A stage's backward in two passes, for zero-bubble schedules: ``B`` the gradient of the stage's inputs
(what the previous stage waits for), ``W`` the gradient of its weights (deferred into the bubbles).

``input_gradients`` runs autograd from the stage's roots to its anchor only (the 0-d tensor every
``hetcc.recv`` takes, so the gradient of every received tensor, which the recv ops' backward sends):
autograd then computes only the gradients on that path (a matmul's backward skips dW). On the way it
records, at each node of that path where a parameter's subgraph joins it (the *intermediates*), the
gradient flowing in. ``weight_gradients`` later starts autograd at those nodes with those gradients and
runs only the parameters' side: no forward and no input gradient runs twice. Parameters whose
subgraphs share intermediates are differentiated together (a group), so one group's autograd never
walks another's path. This is torch.distributed.pipelining's ``stage_backward_input`` /
``stage_backward_weight`` (torch 2.13, private there), rewritten for hetcc's stages: the inputs are
one anchor, and a root that does not reach the anchor (a tensor sent on that depends on weights
alone) still runs its own node in ``B`` (a send's backward receives its gradient: the transport
settles every gradient of a microbatch after its ``B``) and hands what flows below it to ``W``, where
torch's would drop its gradient.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    """Parameters whose gradients start from the same intermediates."""

    params: set[Node] = field(default_factory=set)  # their AccumulateGrad nodes
    intermediates: list[Node] = field(default_factory=list)
    grads: dict[Node, tuple] = field(default_factory=dict)  # what flowed into each, recorded in B


@dataclass
class DeferredWeights:
    """What ``weight_gradients`` needs: the groups with their recorded gradients, and the roots (with
    their gradients) that do not reach the stage's inputs."""

    groups: list[_Group]
    params: dict[Node, torch.nn.Parameter]
    lone: list[tuple[GradientEdge, torch.Tensor]]  # below roots that do not reach the anchor


def input_gradients(
    roots: Sequence[torch.Tensor], anchor: torch.Tensor, params: Sequence[torch.nn.Parameter]
) -> DeferredWeights | None:
    """B: backward from ``roots`` (each with gradient 1) to ``anchor`` alone, recording what ``W`` needs.
    None where no root reaches the anchor: then nothing of the backward could be split off, and the
    whole of it ran here (the caller's parameters hold their gradients)."""
    ones = [torch.ones_like(root) for root in roots]
    root_nodes = [_node(root) for root in roots]
    anchor_node = _node(anchor)
    parents = _parents(root_nodes)
    reaching = _closure([anchor_node], parents, stop=set())  # nodes with a path to the anchor
    if not any(node in reaching for node in root_nodes):
        torch.autograd.backward(list(roots), ones)
        return None
    by_node = {_node(p): p for p in params if p.requires_grad}
    groups = _groups([n for n in by_node if n in parents], reaching, parents)
    handles = [
        node.register_prehook(_recorder(group, node)) for group in groups for node in group.intermediates
    ]
    lone_nodes = [node for node in dict.fromkeys(root_nodes) if node not in reaching]
    lone: list[tuple[GradientEdge, torch.Tensor]] = []
    handles += [node.register_hook(_lone_recorder(node, lone)) for node in lone_nodes]
    # asked for only so that autograd runs the lone roots' nodes (a send's backward receives there)
    below = list(dict.fromkeys(GradientEdge(child, i) for node in lone_nodes for child, i in node.next_functions
                               if child is not None and child not in reaching))  # fmt: skip
    try:
        torch.autograd.grad(list(roots), [anchor, *below], ones, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return DeferredWeights(groups, by_node, lone)


def weight_gradients(deferred: DeferredWeights) -> None:
    """W: each parameter's gradient from what ``input_gradients`` recorded, added to ``param.grad``."""
    for group in deferred.groups:
        edges, grads = [], []
        for node in group.intermediates:
            for i, grad in enumerate(group.grads.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            continue
        # Where one intermediate lies below another, the recorded gradient already holds what flows
        # in from above: replace the inflow with it, so nothing counts twice.
        clamps = [node.register_prehook(_replacing(group.grads[node])) for node in group.intermediates
                  if node in group.grads] if len(group.intermediates) > 1 else []  # fmt: skip
        try:
            _accumulate(deferred.params, group.params, edges, grads)
        finally:
            for handle in clamps:
                handle.remove()
    if deferred.lone:
        edges, grads = zip(*deferred.lone)
        _accumulate(deferred.params, set(deferred.params), list(edges), list(grads))


def _accumulate(params: dict[Node, torch.nn.Parameter], nodes: set[Node], edges, grads) -> None:
    ordered = list(nodes)
    found = torch.autograd.grad(
        edges, [GradientEdge(n, 0) for n in ordered], grads, retain_graph=True, allow_unused=True
    )
    for node, grad in zip(ordered, found):
        if grad is not None:
            param = params[node]
            param.grad = grad if param.grad is None else param.grad + grad


def _lone_recorder(node: Node, lone: list):
    """Records what a lone root's own node hands each input below it: that root's part of the gradient
    alone (a value sent on and also used on this stage's path to its inputs takes the rest from a
    group's intermediates, so W counts each part once). A root is a send's token or the loss, which
    nothing else reads: its node runs once, on its own gradient."""

    def record(grad_inputs, grad_outputs):
        for (child, i), grad in zip(node.next_functions, grad_inputs):
            if child is not None and grad is not None:
                lone.append((GradientEdge(child, i), grad))

    return record


def _replacing(recorded: tuple):
    return lambda grad_outputs: recorded


def _recorder(group: _Group, node: Node):
    def record(grad_outputs):
        group.grads[node] = tuple(grad_outputs)

    return record


def _groups(param_nodes: list[Node], reaching: set[Node], parents: dict[Node, list[Node]]) -> list[_Group]:
    """Each parameter's intermediates: the first nodes with a path to the anchor met going up from the
    parameter toward the roots; parameters sharing one are one group."""
    by_intermediate: dict[Node, _Group] = {}
    for param in param_nodes:
        group = _Group({param}, [])
        for node in _meeting(param, reaching, parents):
            found = by_intermediate.get(node)
            if found is not None and found is not group:
                found.params |= group.params
                found.intermediates += [n for n in group.intermediates if n not in found.intermediates]
                for moved in group.intermediates:
                    by_intermediate[moved] = found
                group = found
            if node not in group.intermediates:
                group.intermediates.append(node)
            by_intermediate[node] = group
    return list({id(g): g for g in by_intermediate.values()}.values())


def _meeting(start: Node, reaching: set[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    met: set[Node] = set()
    _closure([start], parents, stop=reaching, met=met)
    return met


def _closure(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node], met=None) -> set[Node]:
    """Nodes reached from ``starts`` going up (toward the roots); nodes in ``stop`` are not passed
    (collected in ``met``)."""
    seen = set(starts)
    queue = collections.deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in seen:
                continue
            if parent in stop:
                if met is not None:
                    met.add(parent)
                continue
            seen.add(parent)
            queue.append(parent)
    return seen


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """For every node below ``roots``, the nodes whose gradient flows into it."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    for root in roots:
        parents.setdefault(root, [])
    return parents


def _node(tensor: torch.Tensor) -> Node:
    """A tensor's grad_fn, or for a leaf its AccumulateGrad node (made on first use, hence the view)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]
