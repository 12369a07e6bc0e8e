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
