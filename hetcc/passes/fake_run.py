"""Run an fx graph on FakeTensors, node by node: the engine under the flops and memory analyses.

The graph's own fake mode is reused (from the placeholders' ``meta["val"]``), so symbolic dims from
``torch.export`` dynamic shapes stay symbolic and every count comes out as a sympy expression.
Parameters are fakified once (meta-device models work: nothing real is allocated).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode


class FakeInterpreter(torch.fx.Interpreter):
    """An Interpreter whose inputs are the placeholders' fake values and whose weights are fake."""

    def __init__(self, gm: torch.fx.GraphModule, *, requires_grad: bool = False):
        super().__init__(gm, garbage_collect_values=True)
        vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
        self.requires_grad = requires_grad
        self._fake_attrs: dict[int, Any] = {}

    def placeholder(self, target, args, kwargs):
        node = self._current_node
        return node.meta.get("val")

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        if not isinstance(value, torch.Tensor):
            return value
        key = id(value)
        if key not in self._fake_attrs:
            fake = self.fake_mode.from_tensor(value, static_shapes=True)
            if self.requires_grad and value.requires_grad and fake.is_floating_point():
                fake = fake.detach().requires_grad_(True)
            self._fake_attrs[key] = fake
        return self._fake_attrs[key]

    def run_node(self, node: torch.fx.Node) -> Any:
        self._current_node = node
        return super().run_node(node)

    def run_fake(self) -> None:
        """Execute the whole graph once under the fake mode (inputs come from ``meta["val"]``)."""
        n_inputs = sum(1 for n in self.module.graph.nodes if n.op == "placeholder")
        grad_mode = torch.enable_grad() if self.requires_grad else torch.no_grad()
        with self.fake_mode, grad_mode:
            self.run(*([None] * n_inputs), enable_io_processing=False)


def has_traced_values(gm: torch.fx.GraphModule) -> bool:
    """A graph of aten calls whose every value carries its FakeTensor (``torch.export``'s): its calls can
    be analysed one at a time from those values, each distinct call once."""
    return all(
        n.op in ("placeholder", "get_attr", "output", "call_function") for n in gm.graph.nodes
    ) and all("val" in n.meta for n in gm.graph.nodes if n.op != "output")


def call_key(values: Any, grads: Any = None) -> object:
    """A call's arguments as a hashable key: tensors by shape, dtype and (``grads``, nested as
    ``values``) whether they require grad, constants as they are; an unhashable constant makes the call
    its own."""
    if isinstance(values, torch.Tensor):
        return ("tensor", tuple(str(d) for d in values.shape), values.dtype, grads is True)
    if isinstance(values, (list, tuple)):
        inner = grads if isinstance(grads, (list, tuple)) else [grads] * len(values)
        return (type(values).__name__, *(call_key(v, g) for v, g in zip(values, inner, strict=True)))
    if isinstance(values, dict):
        inner = grads if isinstance(grads, dict) else dict.fromkeys(values, grads)
        return ("dict", *((k, call_key(v, inner[k])) for k, v in values.items()))
    if isinstance(values, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(values))
    try:
        hash(values)
    except TypeError:
        return ("object", id(values))
    return values
