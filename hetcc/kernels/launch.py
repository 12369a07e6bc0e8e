"""``fused(inputs, name)``: the call every fused node of a stage makes, and what it launches.

A fused node's target is this function, so ``stage<k>.py`` prints the call that runs. It costs about
what its launch costs: the group, the autograd function and, per input signature, the launch (the
retyped group, its compiled kernel, grid, strides, output dtypes) are worked out once and cached; a
call builds a key from its inputs, allocates its outputs and launches. There is no ``torch.library``
dispatch and no pytree wrapper on the way, as there is for ``torch.ops.hetcc.fusion_group``.

- Where Triton runs (a GPU; a CPU under ``TRITON_INTERPRET=1``): the generated forward kernel inside
  one ``torch.autograd.Function``, whose backward launches the generated backward kernel, or re-runs
  the group's ops under autograd where the group has none.
- Where it does not (a CPU without the interpreter, a device Triton has no backend for): the group's
  original ops, one torch call each, under the caller's autograd and autocast: exactly what the unfused
  graph runs, with the same saved tensors and the same backward, at the cost of one Python call.
- Under tracing (``torch.export``, FakeTensors, ``torch.compile``): the custom op
  ``torch.ops.hetcc.fusion_group``, which keeps a fused graph traceable as one node per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetcc.kernels.cache import TRITON, choose_backend, compiled
from hetcc.kernels.execute import (
    Geometry,
    autocast_state,
    compute_device,
    count_launch,
    geometry,
    has_kernel,
    iteration_shape,
    launch_kernel,
    prepared_inputs,
    recompute_backward,
    run_backward,
    specialize,
)
from hetcc.kernels.group import FusionGroup
from hetcc.kernels.lowering import rule
from hetcc.kernels.op import registered_group
from hetcc.kernels.source import differentiable_inputs


def fused(inputs: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Run fusion group ``name`` on ``inputs`` (see the module docstring for what runs where)."""
    call = _CALLS.get(name)
    if call is None:
        call = _CALLS[name] = FusedCall(registered_group(name))
    return call(inputs)


def forget_calls() -> None:
    """Drop the cached calls (after groups were registered again under changed definitions)."""
    _CALLS.clear()


class FusedCall:
    """One group's call, with everything that does not depend on the inputs' values worked out once."""

    def __init__(self, group: FusionGroup):
        self.group = group
        self._steps = _eager_steps(group)
        self._plans: dict[tuple, _Launch | None] = {}  # input signature -> launch (None: fall back)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if _traced(inputs):
            return torch.ops.hetcc.fusion_group(list(inputs), self.group.name)
        device_type = compute_device(inputs).type
        if choose_backend(device_type)[0] != TRITON:
            count_launch("fused_eager")
            return self.run_ops(inputs)
        launch = self.launch_for(inputs)
        if launch is None:
            count_launch("fused_eager")
            return self.run_ops(inputs)
        return list(_FusedKernel.apply(self, launch, *inputs))

    def run_ops(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The group's original ops, one torch call each, recorded by autograd as the unfused graph's."""
        values: list[torch.Tensor] = []
        for op, operands, cast in self._steps:
            result = op(*[inputs[v] if k == "in" else values[v] if k == "tmp" else v for k, v in operands])
            values.append(result.to(cast) if cast is not None else result)
        return [values[j] for j in self.group.outputs]

    def launch_for(self, inputs: Sequence[torch.Tensor]) -> _Launch | None:
        """The cached launch for these inputs' shapes, strides, dtypes, device and autocast state."""
        device = compute_device(inputs)
        autocast = autocast_state(device.type)
        key = (device, autocast, *[(x.dtype, x.shape, x.stride()) for x in inputs])
        if key not in self._plans:
            self._plans[key] = _plan_launch(self.group, inputs, autocast)
        return self._plans[key]


@dataclass(frozen=True)
class _Launch:
    """What launching a group's forward kernel on one input signature needs."""

    typed: FusionGroup  # the group retyped for the inputs' dtypes and autocast state
    kernel: object  # the compiled forward kernel
    shape: torch.Size  # the iteration shape (every output's)
    where: Geometry  # grid, scalar arguments, BLOCK
    output_dtypes: tuple[torch.dtype, ...]
    differentiable: tuple[bool, ...]  # per output: floating point, so it carries a gradient
    autocast: tuple  # the forward's autocast state, for the backward


def _plan_launch(group: FusionGroup, inputs: Sequence[torch.Tensor], autocast) -> _Launch | None:
    typed = specialize(group, inputs, autocast)
    if not has_kernel(typed):
        return None  # e.g. float64: the original ops run
    dtypes = tuple(typed.output_dtypes)
    shape = iteration_shape(typed, inputs)
    floating = tuple(d.is_floating_point for d in dtypes)
    where = geometry(typed, shape, inputs)
    return _Launch(typed, compiled(typed).forward, shape, where, dtypes, floating, autocast)


class _FusedKernel(torch.autograd.Function):
    """The generated forward kernel, and its backward: the generated backward kernel where the group
    has one, else the group's ops differentiated by torch (``recompute_backward``)."""

    @staticmethod
    def forward(ctx, call: FusedCall, launch: _Launch, *inputs: torch.Tensor):
        device = compute_device(inputs)
        outputs = [torch.empty(launch.shape, dtype=d, device=device) for d in launch.output_dtypes]
        args = [*prepared_inputs(launch.typed, inputs, launch.shape), *outputs]
        launch_kernel(launch.kernel, launch.where, args, stat="fused")
        ctx.call, ctx.launch = call, launch
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o, f in zip(outputs, launch.differentiable) if not f])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        inputs = list(ctx.saved_tensors)
        found = _input_grads(ctx.call.group, ctx.launch, inputs, grads)
        return (None, None, *found)


def _input_grads(group: FusionGroup, launch: _Launch, inputs: list[torch.Tensor], grads) -> list:
    """The inputs' gradients: the generated backward kernel for the types the forward ran (its Triton
    backend is there), or the group's ops differentiated by torch where the group has no such kernel."""
    if all(g is None for g in grads):
        return [None] * len(inputs)
    typed = launch.typed
    if typed.backward != "generated":
        return recompute_backward(group, inputs, grads, launch.autocast)
    device = compute_device(inputs)
    filled = [torch.zeros(launch.shape, device=device) if g is None else g for g in grads]
    found = run_backward(typed, inputs, filled)
    reached = set(differentiable_inputs(typed))
    return [g if i in reached else None for i, g in enumerate(found)]


def _eager_steps(group: FusionGroup) -> list[tuple]:
    """Per instruction: its torch function, its operands as (kind, value), and the dtype a cast makes."""
    return [
        (rule(i.op).eager, tuple(tuple(a) for a in i.args), i.dtype if i.op == "cast" else None)
        for i in group.instrs
    ]


def _traced(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the call is being traced (FakeTensors, export's functional tensors, torch.compile):
    anything but plain tensors goes through the custom op, which tracers see as one node."""
    return torch.compiler.is_compiling() or any(
        type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter for x in inputs
    )


_CALLS: dict[str, FusedCall] = {}
