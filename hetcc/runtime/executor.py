"""Run one stage's part of a pipeline schedule on this rank.

The executor runs the stage's compute-only module (``hetcc.passes.codegen.compute_module``) and does the
stage's transfers itself, around each action of ``hetcc.solver.schedules.stage_actions``:

- ``F m``: receive the stage's inputs of microbatch ``m`` (blocking, with the timeout), compute, and
  start the sends (non-blocking, so a rank never waits for its consumer: with gloo a large send can
  block until the matching recv is posted, and 1F1B would otherwise deadlock).
- ``B m``: receive the gradients of what was sent, run autograd, start sending the gradients of what
  was received. The last stage starts from ``loss_m / M``, so gradients are the mean over
  microbatches: full-batch gradients when the loss is a mean over equal microbatches.

After the last action the sends are waited for, tied parameters' gradients are summed over the
stages that hold them (all-reduce on their group), and the optimizer steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from hetcc.errors import RuntimeFailure
from hetcc.passes.codegen import compute_module
from hetcc.passes.comm import CommEdge, StageGraph
from hetcc.passes.partition import optimizer
from hetcc.runtime.groups import Links
from hetcc.solver.schedules import Action

# Fault injection for tests of failure handling: "RANK:STEP" makes that rank exit at that step.
FAULT_ENV = "HETCC_FAULT_EXIT_AT"


def build_optimizer(spec: Mapping | None, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """An optimizer from a JSON-able spec such as ``{"name": "adam", "lr": 1e-3}`` (None: no step);
    the names are the planner's (``passes.partition.OPTIMIZERS``)."""
    if spec is None or not params:
        return None
    options = dict(spec)
    entry = optimizer(options.pop("name", "sgd"))
    if entry.torch_class is None:
        return None
    return getattr(torch.optim, entry.torch_class)(params, **{**entry.defaults, **options})


@dataclass
class StepResult:
    """What one training step produced on this rank (losses and outputs only on the last stage)."""

    losses: list[torch.Tensor] = field(default_factory=list)  # per microbatch
    outputs: list[tuple] = field(default_factory=list)  # per microbatch: the model's flat outputs


class StageExecutor:
    """One stage on one rank: runs F/B actions, exchanges tensors, reduces tied grads, steps."""

    def __init__(
        self,
        stage: StageGraph,
        links: Links,
        microbatches: int,
        loss_fn: Callable | None = None,
        optimizer: Mapping | None = None,
        device: torch.device | str = "cpu",
    ):
        self.stage, self.links, self.microbatches, self.loss_fn = stage, links, microbatches, loss_fn
        self.device = torch.device(device)
        self.compute = compute_module(stage, self.device).to(self.device)
        self.params = _unique_parameters(self.compute)
        self.optimizer = build_optimizer(optimizer, self.params)
        self.saved: dict[int, tuple[list[torch.Tensor], tuple]] = {}
        self.step_index = 0

    def step(self, inputs: list[dict], targets: list | None, actions: list[Action]) -> StepResult:
        """Run one optimizer step over all microbatches (``inputs[m]``: model input name -> value)."""
        _maybe_inject_fault(self.links.rank, self.step_index)
        for param in self.params:
            param.grad = None
        result = StepResult()
        for action in actions:
            if action.kind == "F":
                target = targets[action.microbatch] if targets is not None else None
                self._forward(action.microbatch, inputs[action.microbatch], target, result)
            else:
                self._backward(action.microbatch)
        self.links.wait_sends()
        self._reduce_tied_grads()
        if self.optimizer is not None:
            self.optimizer.step()
        self.step_index += 1
        return result

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Gradients keyed by the model's parameter names (a tied parameter once)."""
        grads = {}
        for local, name in self.stage.param_names.items():
            grad = self.compute.get_parameter(local).grad
            if grad is not None and name not in grads:
                grads[name] = grad.detach().cpu().clone()
        return grads

    def _forward(self, m: int, inputs: dict, target, result: StepResult) -> None:
        args = [_to(inputs[name], self.device) for name in self.stage.inputs]
        received = [self._recv(edge, m, grad=False) for edge in self.stage.recvs]
        outputs = self.compute(*args, *received)
        if self.stage.is_last:
            loss = self._loss(outputs, _to(target, self.device))
            result.losses.append(loss.detach())
            result.outputs.append(tuple(_detach(o) for o in outputs))
            self.saved[m] = (received, (loss,))
            return
        for edge, tensor in zip(self.stage.sends, outputs):
            self.links.isend(tensor, edge.dst, self._tag(edge, m, False), f"F{m} {edge.value}")
        self.saved[m] = (received, outputs)

    def _backward(self, m: int) -> None:
        received, outputs = self.saved.pop(m)
        if self.stage.is_last:
            (outputs[0] / self.microbatches).backward()
        else:
            grads = [self._recv(edge, m, grad=True) for edge in self.stage.sends if _differentiable(edge)]
            sent = [out for edge, out in zip(self.stage.sends, outputs) if _differentiable(edge)]
            pairs = [(out, grad) for out, grad in zip(sent, grads) if out.requires_grad]
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        for edge, tensor in zip(self.stage.recvs, received):
            if _differentiable(edge):
                grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                self.links.isend(grad, edge.src, self._tag(edge, m, True), f"B{m} grad of {edge.value}")

    def _recv(self, edge: CommEdge, m: int, *, grad: bool) -> torch.Tensor:
        peer = edge.dst if grad else edge.src
        what = f"{'B' if grad else 'F'}{m} {'grad of ' if grad else ''}{edge.value} (stage {peer})"
        tensor = self.links.recv(peer, self._tag(edge, m, grad), edge.shape, edge.dtype, what)
        if not grad and _differentiable(edge):
            tensor.requires_grad_()
        return tensor

    def _tag(self, edge: CommEdge, m: int, grad: bool) -> int:
        """Wire tag unique per (edge, direction, microbatch) within a step."""
        return (edge.tag * 2 + int(grad)) * self.microbatches + m

    def _loss(self, outputs: tuple, target) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, target)
        first = outputs[0] if outputs else None
        if isinstance(first, torch.Tensor) and first.dim() == 0 and first.is_floating_point():
            return first
        raise RuntimeFailure(
            "the model's first output is not a scalar loss and no loss_fn was given",
            hint="pass loss_fn= and targets= (e.g. torch.nn.functional.cross_entropy)",
        )

    def _reduce_tied_grads(self) -> None:
        for index, group in enumerate(self.stage.tied):
            if self.stage.index not in group.stages:
                continue
            local = next(name for stage, name in group.members if stage == self.stage.index)
            param = self.compute.get_parameter(local)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.links.all_reduce(param.grad, index, f"gradient sum of tied parameter {group.name}")


def _unique_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))


def _differentiable(edge: CommEdge) -> bool:
    return edge.requires_grad


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _detach(value):
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{rank}:{step}":
        os._exit(1)
