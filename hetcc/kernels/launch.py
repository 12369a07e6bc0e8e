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

import torch

from hetcc.kernels.cache import TRITON, choose_backend
from hetcc.kernels.execute import (
    ForwardLaunch,
    autocast_state,
    compute_device,
    count_launch,
    eager_steps,
    eager_values,
    forward_launch,
    group_input_grads,
    launch_forward,
)
from hetcc.kernels.group import FusionGroup
from hetcc.kernels.op import registered_group


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
        self._steps = eager_steps(group)
        self._launches: dict[tuple, ForwardLaunch | None] = {}  # input signature -> launch (None: ops)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if _traced(inputs):
            return torch.ops.hetcc.fusion_group(list(inputs), self.group.name)
        triton = choose_backend(compute_device(inputs).type)[0] == TRITON
        launch = self.launch_for(inputs) if triton else None
        if launch is None:  # no Triton here, or no kernel for these dtypes: the ops themselves
            count_launch("fused_eager")
            return self.run_ops(inputs)
        return list(_FusedKernel.apply(self, launch, *inputs))

    def run_ops(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The group's original ops, one torch call each, recorded by autograd as the unfused graph's."""
        values = eager_values(self._steps, inputs)
        return [values[j] for j in self.group.outputs]

    def launch_for(self, inputs: Sequence[torch.Tensor]) -> ForwardLaunch | None:
        """The cached launch for these inputs' shapes, strides, dtypes, device and autocast state."""
        device = compute_device(inputs)
        autocast = autocast_state(device.type)
        key = (device, autocast, *[(x.dtype, x.shape, x.stride()) for x in inputs])
        if key not in self._launches:
            self._launches[key] = forward_launch(self.group, inputs, autocast)
        return self._launches[key]


class _FusedKernel(torch.autograd.Function):
    """The generated forward kernel, and its backward: the generated backward kernel where the group
    has one, else the group's ops differentiated by torch (``recompute_backward``)."""

    @staticmethod
    def forward(ctx, call: FusedCall, launch: ForwardLaunch, *inputs: torch.Tensor):
        outputs = launch_forward(launch, inputs)
        ctx.call, ctx.launch = call, launch
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.dtype.is_floating_point])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        # the forward ran the kernels, so the Triton backend is there: generated where the group has one
        launch = ctx.launch
        typed = launch.typed if launch.typed.backward == "generated" else None
        found = group_input_grads(ctx.call.group, typed, list(ctx.saved_tensors), grads, launch.autocast)
        return (None, None, *found)


def _traced(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the call is being traced (FakeTensors, export's functional tensors, torch.compile):
    anything but plain tensors goes through the custom op, which tracers see as one node."""
    return torch.compiler.is_compiling() or any(
        type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter for x in inputs
    )


_CALLS: dict[str, FusedCall] = {}
