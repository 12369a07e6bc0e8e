"""Running a FusionGroup: its generated Triton kernels, or its original ops with torch (the fallback and
the recompute backward). Shapes come from the runtime inputs, so one compiled kernel serves every
shape with the same structure; only rank, dtypes and which inputs are flat are fixed by the group.

Every run is counted in process-local counters (``launch_stats``), which the runtime reports per rank as
provenance: they show which code a fused group ran, not only that its numbers were right.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from hetcc.errors import RuntimeFailure
from hetcc.kernels.cache import TRITON, choose_backend, compiled
from hetcc.kernels.group import FusionGroup
from hetcc.kernels.lowering import MAX_ROW_ELEMENTS, PASS_THROUGH, rule
from hetcc.kernels.source import differentiable_inputs, strided_inputs

_GPU_BLOCK = 1024
_INTERPRETER_BLOCK = 1 << 16  # the interpreter pays per program, not per lane: few, wide blocks

# What ``launch_stats`` reports: forward runs of a fused group by backend, backward runs by the generated
# kernel or by re-running the group's ops under autograd.
LAUNCH_STATS = (
    "fused_triton", "fused_interpreter", "fused_eager",
    "backward_triton", "backward_interpreter", "backward_recompute",
)  # fmt: skip
_launches: Counter[str] = Counter()


def launch_stats() -> dict[str, int]:
    """Fused-group runs in this process since the last reset: ``fused_triton`` / ``fused_interpreter``
    launched the generated forward kernel on a GPU / through TRITON_INTERPRET=1, ``fused_eager`` ran the
    original ops (the fallback); ``backward_triton`` / ``backward_interpreter`` launched the generated
    backward kernel, ``backward_recompute`` differentiated the original ops (row groups, fallback)."""
    return {key: _launches[key] for key in LAUNCH_STATS}


def reset_launch_stats() -> None:
    _launches.clear()


def iteration_shape(group: FusionGroup, inputs: Sequence[torch.Tensor]) -> torch.Size:
    """Broadcast of the inputs' shapes: every output of a group has it."""
    shape = torch.broadcast_shapes(*(x.shape for x in inputs))
    if len(shape) != len(group.shape):
        raise RuntimeFailure(
            f"fusion group {group.name} was built for rank {len(group.shape)} but got inputs of shape {tuple(shape)}",
            hint="re-run hetcc.passes.fuse on a graph traced with inputs of this rank",
        )
    return shape


def compute_device(inputs: Sequence[torch.Tensor]) -> torch.device:
    """Where the group runs: the first input that is not a 0-d CPU scalar (as eager ops decide)."""
    for x in inputs:
        if x.dim() > 0 or x.device.type != "cpu":
            return x.device
    return inputs[0].device


def run_eager(group: FusionGroup, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The group's original ops, one torch call each (exactly what the unfused graph computed)."""
    values: list[torch.Tensor] = []
    for instr in group.instrs:
        operands = [_eager_operand(arg, inputs, values) for arg in instr.args]
        result = rule(instr.op).eager(*operands)
        values.append(result.to(instr.dtype) if instr.op in PASS_THROUGH else result)
    outputs = [values[j] for j in group.outputs]
    # A custom op's outputs may alias neither its inputs nor each other.
    seen: set[int] = {id(x) for x in inputs}
    fresh = []
    for out in outputs:
        fresh.append(out.clone() if id(out) in seen else out)
        seen.add(id(fresh[-1]))
    return fresh


def _eager_operand(arg: tuple, inputs: Sequence[torch.Tensor], values: list[torch.Tensor]):
    kind, value = arg
    if kind == "in":
        return inputs[value]
    if kind == "tmp":
        return values[value]
    return value  # a constant, or None for an absent weight/bias


def recompute_backward(
    group: FusionGroup, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Input gradients by re-running the original ops under torch autograd.

    Call it at the autograd level (not inside a custom op's implementation, where autograd is off).
    """
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(x.dtype.is_floating_point) for x in inputs]
        outputs = run_eager(group, leaves)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in leaves if x.requires_grad]
        if not pairs or not wanted:
            return [None] * len(leaves)
        _launches["backward_recompute"] += 1
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    by_leaf = dict(zip(map(id, wanted), found))
    return [by_leaf.get(id(x)) for x in leaves]


def run_forward(group: FusionGroup, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Forward on the backend the inputs' device allows (see ``choose_backend``)."""
    device = compute_device(inputs)
    if choose_backend(device.type)[0] != TRITON:
        _launches["fused_eager"] += 1
        return run_eager(group, inputs)
    shape = iteration_shape(group, inputs)
    outputs = [torch.empty(shape, dtype=d, device=device) for d in group.output_dtypes]
    args = [*_prepared(group, inputs, shape), *outputs]
    _launch(group, compiled(group).forward, shape, inputs, args, stat="fused")
    return outputs


def uses_generated_backward(group: FusionGroup, device_type: str) -> bool:
    """Whether the backward runs the generated kernel (else: recompute the original ops)."""
    return group.backward == "generated" and choose_backend(device_type)[0] == TRITON


def run_backward(
    group: FusionGroup, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Input gradients from the generated backward kernel (None for inputs no gradient reaches)."""
    shape = iteration_shape(group, inputs)
    device = compute_device(inputs)
    grad_outs = [g.expand(shape).contiguous() for g in grads]
    wanted = differentiable_inputs(group)
    buffers = {
        i: torch.empty(
            shape, device=device, dtype=torch.float32 if group.inputs[i].broadcast else inputs[i].dtype
        )
        for i in wanted
    }
    args = [*_prepared(group, inputs, shape), *grad_outs, *buffers.values()]
    _launch(group, compiled(group).backward, shape, inputs, args, stat="backward")
    return [
        buffers[i].sum_to_size(x.shape).to(x.device, x.dtype) if i in buffers else None
        for i, x in enumerate(inputs)
    ]


def _prepared(group: FusionGroup, inputs: Sequence[torch.Tensor], shape: torch.Size) -> list[torch.Tensor]:
    """Inputs as the kernel expects them: on one device, flat inputs contiguous in the iteration shape."""
    prepared, device = [], compute_device(inputs)
    for spec, x in zip(group.inputs, inputs):
        x = x.to(device)  # a 0-d CPU scalar next to GPU tensors
        if spec.flat and (x.shape != shape or not x.is_contiguous()):
            x = x.expand(shape).contiguous()
        prepared.append(x)
    return prepared


def _launch(
    group: FusionGroup, kernel, shape: torch.Size, inputs: Sequence[torch.Tensor], args: list, stat: str
) -> None:
    """Launch ``kernel`` over ``shape``, counted under ``<stat>_triton`` or ``<stat>_interpreter``."""
    numel = shape.numel()
    if numel == 0:
        return
    interpreted = compute_device(inputs).type == "cpu"
    _launches[f"{stat}_{'interpreter' if interpreted else 'triton'}"] += 1
    strides = [s for i in strided_inputs(group) for s in inputs[i].expand(shape).stride()]
    sizes = list(shape) if strided_inputs(group) else []
    if group.kind == "row":
        n_cols = shape[-1]
        block = _next_power_of_2(n_cols)
        if block > MAX_ROW_ELEMENTS:
            raise RuntimeFailure(
                f"fusion group {group.name}: rows of {n_cols} elements exceed the row kernel's limit {MAX_ROW_ELEMENTS}",
                hint="fuse with a smaller last dimension or leave this reduction unfused",
            )
        kernel[(numel // n_cols,)](*args, n_cols, *sizes, *strides, BLOCK=block)
        return
    block = min(_INTERPRETER_BLOCK, _next_power_of_2(numel)) if interpreted else _GPU_BLOCK
    kernel[(-(-numel // block),)](*args, numel, *sizes, *strides, BLOCK=block)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
