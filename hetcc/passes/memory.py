"""memory: parameter bytes and saved-activation bytes per node.

Saved activations are measured, not guessed: the graph runs once on FakeTensors with autograd on, and
``torch.autograd.graph.saved_tensors_hooks`` sees exactly which tensors each node's backward keeps.
A storage saved by several nodes (``x`` feeding q, k and v) is charged once, to the first; parameters
that backward saves are weights, already charged as ``param_bytes``, so they are not activations.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from hetcc.ir import annotate, to_number
from hetcc.passes.fake_run import FakeInterpreter


class _SavedTensorMeter(FakeInterpreter):
    def __init__(self, gm: torch.fx.GraphModule, training: bool):
        super().__init__(gm, requires_grad=training)
        self._seen_storages: set[StorageWeakRef] = set()
        self._param_storages: set[StorageWeakRef] = set()

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor):
            self._param_storages.add(StorageWeakRef(value.untyped_storage()))
        return value

    def run_node(self, node: torch.fx.Node):
        saved = []

        def pack(tensor: torch.Tensor):
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in self._seen_storages and ref not in self._param_storages:
                self._seen_storages.add(ref)
                saved.append(to_number(tensor.untyped_storage().nbytes()))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = super().run_node(node)
        if node.op != "get_attr":  # the get_attr node's own record is set in memory() below
            annotate(node, act_bytes=sum(saved, 0))
        return result


def memory(gm: torch.fx.GraphModule, *, training: bool = True) -> torch.fx.GraphModule:
    """Annotate parameter bytes (on get_attr / call_module nodes) and saved-activation bytes."""
    _SavedTensorMeter(gm, training).run_fake()
    seen: set[int] = set()
    for node in gm.graph.nodes:
        annotate(node, param_bytes=_param_bytes(gm, node, seen))
    return gm


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node, seen: set[int]) -> int:
    """Bytes of the parameters/buffers a node holds, each tensor counted once (tied weights too)."""
    if node.op == "get_attr":
        tensors = [operator.attrgetter(node.target)(gm)]
    elif node.op == "call_module":
        module = gm.get_submodule(node.target)
        tensors = [*module.parameters(), *module.buffers()]
    else:
        return 0
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
