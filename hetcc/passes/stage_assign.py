"""Which stage runs each node of a traced graph, from the planner's mapping of some of them (the rules
are ``passes.comm``'s module docstring, first list), checked: every value flows forward, no stage is empty."""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping

import torch
import torch.fx as fx

from hetcc.errors import PlanFormatError

log = logging.getLogger(__name__)

# torch.export's input check (a call_module with no users): it cannot be saved, and the executor
# checks microbatch shapes itself.
EXPORT_GUARDS = "_guards_fn"


def assign_stages(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int) -> dict[fx.Node, int]:
    """Stage of every node that computes something (see the module docstring for the rules)."""
    _check_mapping(gm, stage_of, num_stages)
    stage: dict[fx.Node, int] = {}
    pending: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or node.target == EXPORT_GUARDS:
            continue
        producer = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(producer, fx.Node) and producer in stage and not is_tensor(producer):
            stage[node] = stage[producer]
        elif node.name in stage_of:
            stage[node] = stage_of[node.name]
        else:
            staged = [stage[a] for a in node.all_input_nodes if a in stage]
            if staged:
                stage[node] = max(staged)
            else:
                pending.append(node)
    for node in reversed(pending):
        users = [stage[u] for u in node.users if u in stage]
        if users:
            stage[node] = min(users)
        elif node.users and all(u.op == "output" for u in node.users):
            stage[node] = num_stages - 1
        else:
            log.info("split_stages: dropping %s (no stage, no users)", node.name)
    _check_order(stage, num_stages)
    return stage


def _check_mapping(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PlanFormatError(f"num_stages must be a positive integer, got {num_stages!r}")
    names = {node.name for node in gm.graph.nodes}
    unknown = sorted(set(stage_of) - names)
    if unknown:
        raise PlanFormatError(
            f"stage mapping names nodes that are not in the graph: {unknown[:5]}",
            hint="map the names of the traced graph's nodes (node.name)",
        )
    for name, stage in stage_of.items():
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise PlanFormatError(f"node {name!r} is mapped to stage {stage!r}, not in 0..{num_stages - 1}")


def _check_order(stage: dict[fx.Node, int], num_stages: int) -> None:
    """Every value must flow forward (producer stage <= consumer stage); no stage may be empty."""
    for node, k in stage.items():
        for arg in node.all_input_nodes:
            if arg in stage and stage[arg] > k:
                raise PlanFormatError(
                    f"node {node.name!r} (stage {k}) uses {arg.name!r} from the later stage {stage[arg]}",
                    hint="stages must be contiguous in topological order; move one of them",
                )
    empty = sorted(set(range(num_stages)) - set(stage.values()))
    if empty:
        raise PlanFormatError(f"stage(s) {empty} have no nodes", hint="use fewer stages or remap nodes")


def is_tensor(node: fx.Node) -> bool:
    """From ``meta["val"]`` (export, FakeTensorProp) or ShapeProp's ``tensor_meta``/``type``."""
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    if val is None and isinstance(node.meta.get("type"), type):
        return issubclass(node.meta["type"], torch.Tensor)
    if val is None and node.op not in ("get_attr", "placeholder"):
        raise PlanFormatError(
            f"node {node.name!r} has no shape metadata (meta['val'])",
            hint="trace with torch.export or hetcc.trace, or run FakeTensorProp/ShapeProp on the graph first",
        )
    return isinstance(val, torch.Tensor) or (hasattr(val, "stride") and hasattr(val, "dtype"))
