"""shapes: every node's output shape and dtype, from the FakeTensor in ``meta["val"]``."""

from __future__ import annotations

import operator

import torch
import torch.fx

from hetcc.errors import AnalysisError
from hetcc.ir import annotate, to_number


def shapes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Record shape/dtype of the first tensor each node produces (tracing filled ``meta["val"]``)."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
        elif node.op == "output":
            continue
        else:
            if "val" not in node.meta and node.op != "placeholder":
                raise AnalysisError(
                    f"node %{node.name} ({node.target}) has no meta['val']: the graph was not shape-propagated",
                    hint="capture the model with hetcc.trace(), which fills it",
                )
            value = node.meta.get("val")
        tensor = _first_tensor(value)
        if tensor is not None:
            annotate(node, shape=tuple(to_number(s) for s in tensor.shape), dtype=tensor.dtype)
        else:  # every node gets a record, a tensor-less one (an assert, a size) too
            annotate(node)
    return gm


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None
