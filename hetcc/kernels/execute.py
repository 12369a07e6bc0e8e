"""Running a FusionGroup: its generated Triton kernels, or its original ops with torch (the fallback and
the recompute backward). Shapes come from the runtime inputs, so one compiled kernel serves every
shape with the same structure; only rank and which inputs are flat are fixed by the group.

Dtypes follow the runtime inputs (``specialize``): under ``torch.autocast`` a group traced in fp32 reads
the bf16 output of a matmul, and writes what its original ops would write there (bf16, or fp32 where an
op promotes or autocast runs it in fp32), from a kernel generated for that dtype signature.

Every run is counted in process-local counters (``launch_stats``), which the runtime reports per rank as
provenance: they show which code a fused group ran, not only that its numbers were right.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hetcc.errors import RuntimeFailure
from hetcc.kernels.cache import TRITON, choose_backend, compiled
from hetcc.kernels.group import FusionGroup, retyped
from hetcc.kernels.lowering import FUSIBLE_DTYPES, MAX_ROW_ELEMENTS, rule
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
    original ops (the fallback, whose backward is torch's autograd of those ops, not counted);
    ``backward_triton`` / ``backward_interpreter`` launched the generated backward kernel,
    ``backward_recompute`` re-ran the original ops under autograd (a group saved with
    ``backward="recompute"``, or dtypes no kernel is generated for)."""
    return {key: _launches[key] for key in LAUNCH_STATS}


def reset_launch_stats() -> None:
    _launches.clear()


def iteration_shape(group: FusionGroup, inputs: Sequence[torch.Tensor]) -> torch.Size:
    """Broadcast of the inputs' shapes: every output of a group has it."""
    shape = _broadcast_shapes([x.shape for x in inputs])
    if len(shape) != len(group.shape):
        raise RuntimeFailure(
            f"fusion group {group.name} was built for rank {len(group.shape)} but got inputs of shape {tuple(shape)}",
            hint="re-run hetcc.passes.fuse on a graph traced with inputs of this rank",
        )
    return shape


def _broadcast_shapes(shapes: list[torch.Size]) -> torch.Size:
    """``torch.broadcast_shapes`` for concrete sizes in a few microseconds (torch's takes tens, on every
    call of every group); symbolic sizes (fake tensors) and mismatches go to torch's."""
    rank = max(len(shape) for shape in shapes)
    out = [1] * rank
    for shape in shapes:
        for d, n in enumerate(shape, rank - len(shape)):
            if type(n) is not int or out[d] not in (1, n):
                return torch.broadcast_shapes(*shapes)
            out[d] = n if n != 1 else out[d]
    return torch.Size(out)


def compute_device(inputs: Sequence[torch.Tensor]) -> torch.device:
    """Where the group runs: the first input that is not a 0-d CPU scalar (as eager ops decide)."""
    for x in inputs:
        if x.dim() > 0 or x.device.type != "cpu":
            return x.device
    return inputs[0].device


AutocastState = tuple[bool, torch.dtype | None]  # (enabled, dtype) on one device type


def autocast_state(device_type: str) -> AutocastState:
    """``torch.autocast``'s state for ``device_type`` in this thread ((False, None): a device type
    autocast does not know, e.g. meta)."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except RuntimeError:
        return False, None


def _autocast(device_type: str, state: AutocastState | None):
    """Enter ``state`` (None, or a device type autocast does not know: leave the state in force)."""
    if state is None or state[1] is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, state[1], state[0])


def run_eager(group: FusionGroup, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The group's original ops, one torch call each (exactly what the unfused graph computed)."""
    values = eager_values(eager_steps(group), inputs)
    outputs = [values[j] for j in group.outputs]
    # A custom op's outputs may alias neither its inputs nor each other.
    seen: set[int] = {id(x) for x in inputs}
    fresh = []
    for out in outputs:
        fresh.append(out.clone() if id(out) in seen else out)
        seen.add(id(fresh[-1]))
    return fresh


EagerStep = tuple  # (torch function, operands as (kind, value), the dtype a cast makes or None)


def eager_steps(group: FusionGroup) -> tuple[EagerStep, ...]:
    """What ``eager_values`` runs for ``group``, one step per instruction (the launcher keeps them)."""
    return tuple(
        (rule(i.op).eager, tuple(tuple(a) for a in i.args), i.dtype if i.op == "cast" else None)
        for i in group.instrs
    )


def eager_values(steps: Sequence[EagerStep], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every instruction's value, each op called on inputs (``in``), earlier values (``tmp``) or
    constants (None for an absent weight/bias). Dtypes are eager's for these inputs (promotion,
    autocast) except a cast's, which the graph fixed; a clone or dropout keeps its operand's dtype."""
    values: list[torch.Tensor] = []
    for op, operands, cast in steps:
        result = op(*[inputs[v] if k == "in" else values[v] if k == "tmp" else v for k, v in operands])
        values.append(result.to(cast) if cast is not None else result)
    return values


def recompute_backward(
    group: FusionGroup,
    inputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    autocast: AutocastState | None = None,
) -> list[torch.Tensor | None]:
    """Input gradients by re-running the original ops under torch autograd, under ``autocast`` (the
    forward's ``autocast_state``; None: the state in force), so they compute in the forward's dtypes.

    Call it at the autograd level (not inside a custom op's implementation, where autograd is off).
    """
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(x.dtype.is_floating_point) for x in inputs]
        with _autocast(compute_device(inputs).type, autocast):
            outputs = run_eager(group, leaves)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in leaves if x.requires_grad]
        if not pairs or not wanted:
            return [None] * len(leaves)
        _launches["backward_recompute"] += 1
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    by_leaf = dict(zip(map(id, wanted), found))
    return [by_leaf.get(id(x)) for x in leaves]


_SPECIALIZED: dict[tuple, FusionGroup] = {}


def specialize(
    group: FusionGroup, inputs: Sequence[torch.Tensor], autocast: AutocastState | None = None
) -> FusionGroup:
    """The group retyped for these inputs under ``autocast`` (default: the state in force): every value
    in the dtype the original ops give it, so the kernel generated from it writes what eager would.

    The dtypes come from running the original ops once per signature (input dtypes, which inputs are
    0-d, device type, autocast state) on one-element tensors: torch's own promotion and autocast lists
    (on CUDA autocast runs exp, log, pow, rsqrt, softmax and the norms in fp32; on CPU it does not)."""
    device_type = compute_device(inputs).type
    autocast = autocast_state(device_type) if autocast is None else autocast
    key = (group.name, device_type, autocast, tuple((x.dtype, x.dim() == 0) for x in inputs))
    if key not in _SPECIALIZED:
        with torch.no_grad(), _autocast(device_type, autocast):
            probes = [x.new_zeros((1,) * x.dim()) for x in inputs]
            dtypes = [value.dtype for value in eager_values(eager_steps(group), probes)]
        _SPECIALIZED[key] = retyped(group, [x.dtype for x in inputs], dtypes)
    return _SPECIALIZED[key]


def has_kernel(group: FusionGroup) -> bool:
    """Whether codegen handles every dtype of the group (not e.g. float64: those run the original ops)."""
    dtypes = {spec.dtype for spec in group.inputs} | {instr.dtype for instr in group.instrs}
    return dtypes <= set(FUSIBLE_DTYPES)


def run_forward(group: FusionGroup, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Forward on the backend the inputs' device allows (see ``choose_backend``), by the kernel for the
    inputs' dtypes (``specialize``)."""
    device_type = compute_device(inputs).type
    triton = choose_backend(device_type)[0] == TRITON
    launch = forward_launch(group, inputs, autocast_state(device_type)) if triton else None
    if launch is None:
        _launches["fused_eager"] += 1
        return run_eager(group, inputs)
    return launch_forward(launch, inputs)


@dataclass(frozen=True)
class ForwardLaunch:
    """What launching a group's forward kernel on one input signature needs (the launcher caches it)."""

    typed: FusionGroup  # the group retyped for the inputs' dtypes and autocast state (``specialize``)
    kernel: object  # its compiled forward kernel
    shape: torch.Size  # the iteration shape (every output's)
    where: Geometry
    output_dtypes: tuple[torch.dtype, ...]
    autocast: AutocastState  # the forward's, for its backward


def forward_launch(
    group: FusionGroup, inputs: Sequence[torch.Tensor], autocast: AutocastState
) -> ForwardLaunch | None:
    """The forward launch of ``group`` on inputs like ``inputs`` under ``autocast``; None where no
    kernel is generated for the dtypes (e.g. float64: the original ops run)."""
    typed = specialize(group, inputs, autocast)
    if not has_kernel(typed):
        return None
    shape = iteration_shape(typed, inputs)
    where = geometry(typed, shape, inputs)
    return ForwardLaunch(typed, compiled(typed).forward, shape, where, tuple(typed.output_dtypes), autocast)


def launch_forward(launch: ForwardLaunch, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``launch`` on ``inputs``: the outputs, freshly allocated."""
    device = compute_device(inputs)
    outputs = [torch.empty(launch.shape, dtype=d, device=device) for d in launch.output_dtypes]
    args = [*prepared_inputs(launch.typed, inputs, launch.shape), *outputs]
    launch_kernel(launch.kernel, launch.where, args, stat="fused")
    return outputs


def group_input_grads(
    group: FusionGroup,
    typed: FusionGroup | None,
    inputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    autocast: AutocastState,
    backward: Callable | None = None,
) -> list[torch.Tensor | None]:
    """The gradients of a group's inputs (None where none reaches) from its outputs' ``grads`` (None
    for outputs no gradient reached): its generated backward kernel for ``typed``, the group retyped
    as its forward ran, launched by ``backward(typed, inputs, grads)`` (default ``run_backward``); or,
    where ``typed`` is None, its original ops differentiated by torch (``recompute_backward``)."""
    if all(g is None for g in grads):
        return [None] * len(inputs)
    if typed is None:
        return recompute_backward(group, inputs, grads, autocast)
    shape, device = iteration_shape(typed, inputs), compute_device(inputs)
    filled = [torch.zeros(shape, device=device) if g is None else g for g in grads]
    found = (backward or run_backward)(typed, inputs, filled)
    reached = set(differentiable_inputs(typed))
    return [g if i in reached else None for i, g in enumerate(found)]


def generated_backward(
    group: FusionGroup, inputs: Sequence[torch.Tensor], autocast: AutocastState
) -> FusionGroup | None:
    """The group retyped as its forward ran (``autocast``: the forward's state) if its backward runs
    the generated kernel; None where it recomputes the original ops instead."""
    device_type = compute_device(inputs).type
    if group.backward != "generated" or choose_backend(device_type)[0] != TRITON:
        return None
    typed = specialize(group, inputs, autocast)
    return typed if has_kernel(typed) else None


def run_backward(
    group: FusionGroup, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Input gradients from the generated backward kernel (None for inputs no gradient reaches), each
    in its input's dtype. ``group``: retyped for ``inputs`` (``generated_backward``)."""
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
    args = [*prepared_inputs(group, inputs, shape), *grad_outs, *buffers.values()]
    launch_kernel(compiled(group).backward, geometry(group, shape, inputs), args, stat="backward")
    return [
        buffers[i].sum_to_size(x.shape).to(x.device, x.dtype) if i in buffers else None
        for i, x in enumerate(inputs)
    ]


def prepared_inputs(
    group: FusionGroup, inputs: Sequence[torch.Tensor], shape: torch.Size
) -> list[torch.Tensor]:
    """Inputs as the kernel expects them: on one device, flat inputs contiguous in the iteration shape."""
    prepared, device = [], compute_device(inputs)
    for spec, x in zip(group.inputs, inputs):
        x = x.to(device)  # a 0-d CPU scalar next to GPU tensors
        if spec.flat and (x.shape != shape or not x.is_contiguous()):
            x = x.expand(shape).contiguous()
        prepared.append(x)
    return prepared


def count_launch(stat: str) -> None:
    """Count one run under ``stat`` (one of ``LAUNCH_STATS``)."""
    _launches[stat] += 1


@dataclass(frozen=True)
class Geometry:
    """How one kernel of a group is launched over an iteration shape: grid, the scalar arguments after
    the tensors (element or column count, sizes and strides of strided inputs) and BLOCK."""

    grid: tuple[int, ...]
    scalars: tuple[int, ...]
    block: int
    interpreted: bool  # CPU tensors through TRITON_INTERPRET=1


def geometry(group: FusionGroup, shape: torch.Size, inputs: Sequence[torch.Tensor]) -> Geometry:
    """The launch of ``group``'s kernels over ``shape`` for ``inputs`` (their strides: a strided input's
    strides are kernel arguments)."""
    numel = shape.numel()
    interpreted = compute_device(inputs).type == "cpu"
    strided = strided_inputs(group)
    strides = [s for i in strided for s in inputs[i].expand(shape).stride()]
    sizes = list(shape) if strided else []
    if group.kind == "row":
        n_cols = shape[-1]
        block = _next_power_of_2(n_cols)
        if block > MAX_ROW_ELEMENTS:
            raise RuntimeFailure(
                f"fusion group {group.name}: rows of {n_cols} elements exceed the row kernel's limit {MAX_ROW_ELEMENTS}",
                hint="fuse with a smaller last dimension or leave this reduction unfused",
            )
        return Geometry((numel // max(n_cols, 1),), (n_cols, *sizes, *strides), block, interpreted)
    block = min(_INTERPRETER_BLOCK, _next_power_of_2(numel)) if interpreted else _GPU_BLOCK
    return Geometry((-(-numel // block),), (numel, *sizes, *strides), block, interpreted)


def launch_kernel(kernel, where: Geometry, args: list, stat: str) -> None:
    """Launch ``kernel`` with tensor ``args`` as ``where`` says, counted under ``<stat>_triton`` or
    ``<stat>_interpreter``. An empty iteration space launches nothing."""
    if where.grid[0] == 0:
        return
    _launches[f"{stat}_{'interpreter' if where.interpreted else 'triton'}"] += 1
    kernel[where.grid](*args, *where.scalars, BLOCK=where.block)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
