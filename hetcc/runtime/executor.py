"""Run one stage's part of a pipeline schedule on this rank.

The executor runs the stage's own module (``stage.module``, the program ``stage<k>.py`` prints), whose
``hetcc::send``/``hetcc::recv`` ops move tensors through this rank's ``LinkTransport``; it only
interprets the actions of ``hetcc.solver.schedules.stage_actions``:

- ``F m``: run the module on microbatch ``m``: its recvs block (with the timeout) and its sends start
  non-blocking. A non-last stage keeps the send tokens; the last stage computes the loss.
- ``B m``: autograd backward from the tokens (each with gradient 1), whose ops receive the gradients of
  what was sent and send back the gradients of what was received; the last stage starts from
  ``loss_m / M``, so gradients are the mean over microbatches: full-batch gradients when the loss is a
  mean over equal microbatches. Then the transport settles the gradients autograd did not move.

After the last action the sends are waited for, tied parameters' gradients are summed over the
stages that hold them (all-reduce on their group), and the optimizer steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from hetcc.errors import RuntimeFailure
from hetcc.passes.codegen import module_for_device
from hetcc.passes.comm import StageGraph
from hetcc.passes.partition import optimizer
from hetcc.runtime.groups import Links
from hetcc.runtime.ops import use_transport
from hetcc.runtime.transport import LinkTransport
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
    """One stage on one rank: runs F/B actions through the stage module, reduces tied grads, steps."""

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
        self.module = module_for_device(stage, self.device).to(self.device)
        self.transport = LinkTransport(links, stage, microbatches)
        self.params = _unique_parameters(self.module)
        self.optimizer = build_optimizer(optimizer, self.params)
        self.roots: dict[int, list[torch.Tensor]] = {}  # microbatch -> where its backward starts
        self.step_index = 0

    def step(self, inputs: list[dict], targets: list | None, actions: list[Action]) -> StepResult:
        """Run one optimizer step over all microbatches (``inputs[m]``: model input name -> value)."""
        _maybe_inject_fault(self.links.rank, self.step_index)
        for param in self.params:
            param.grad = None
        result = StepResult()
        with use_transport(self.transport):
            for action in actions:
                m = self.transport.microbatch = action.microbatch
                if action.kind == "F":
                    self._forward(m, inputs[m], targets[m] if targets is not None else None, result)
                else:
                    self._backward(m)
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
            grad = self.module.get_parameter(local).grad
            if grad is not None and name not in grads:
                grads[name] = grad.detach().cpu().clone()
        return grads

    def _forward(self, m: int, inputs: dict, target, result: StepResult) -> None:
        outputs = self.module(*(_to(inputs[name], self.device) for name in self.stage.inputs))
        roots = outputs  # the send tokens of a non-last stage
        if self.stage.is_last:
            loss = self._loss(outputs, _to(target, self.device))
            result.losses.append(loss.detach())
            result.outputs.append(tuple(_detach(o) for o in outputs))
            roots = (loss / self.microbatches,)
        self.roots[m] = [root for root in roots if root.requires_grad]

    def _backward(self, m: int) -> None:
        roots = self.roots.pop(m)
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(root) for root in roots])
        self.transport.settle_gradients()

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
            param = self.module.get_parameter(local)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.links.all_reduce(param.grad, index, f"gradient sum of tied parameter {group.name}")


def _unique_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _detach(value):
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{rank}:{step}":
        os._exit(1)
