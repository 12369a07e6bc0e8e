"""``torch.ops.hetcc.fusion_group(inputs, name)``: the one custom op every fused node calls.

Custom ops (with fake implementations) survive torch.export and fx, unlike an autograd.Function that
launches Triton. The group is looked up by name in a per-process registry that ``fuse`` (or loading a
saved stage) fills. The backward is a second custom op so graphs that trace through autograd see it as
one node too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.fx

from hetcc.errors import PlanFormatError, RuntimeFailure
from hetcc.hardware.schema import read_text
from hetcc.kernels.execute import (
    autocast_state,
    compute_device,
    generated_backward,
    group_input_grads,
    iteration_shape,
    run_backward,
    run_forward,
    specialize,
)
from hetcc.kernels.group import FusionGroup, check_group, group_from_json
from hetcc.kernels.source import differentiable_inputs

MAX_GROUP_BYTES = 4 * 2**20  # one saved fusion group's JSON

FUSION_META_KEY = "hetcc_fusion"  # node.meta key of a fused node's FusionGroup
_GROUPS: dict[str, FusionGroup] = {}


def register_group(group: FusionGroup) -> None:
    """Make ``group`` callable as ``torch.ops.hetcc.fusion_group(inputs, group.name)``."""
    _GROUPS[group.name] = group


def register_groups_in(gm: torch.fx.GraphModule) -> list[FusionGroup]:
    """Register every group a (copied, split or unpickled) module's fused nodes carry in their meta."""
    groups = [n.meta[FUSION_META_KEY] for n in gm.graph.nodes if FUSION_META_KEY in n.meta]
    for group in groups:
        register_group(group)
    return groups


def load_groups(folder: str | Path) -> list[FusionGroup]:
    """Register every group saved by ``write_kernel`` under ``<folder>/kernels/`` (e.g. a saved plan)."""
    groups = [_read_group(path) for path in sorted(Path(folder, "kernels").glob("*.json"))]
    for group in groups:
        register_group(group)
    return groups


def _read_group(path: Path) -> FusionGroup:
    """A saved group, checked before its Triton source can be generated from it (``check_group``)."""
    text = read_text(path, "fusion group", error=PlanFormatError, max_bytes=MAX_GROUP_BYTES)
    try:
        group = group_from_json(text)
    except PlanFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as error:
        raise PlanFormatError(
            f"{path}: not a fusion group hetcc wrote: {str(error)[:200]}", hint="re-save the plan"
        ) from None
    return check_group(group, str(path))


def registered_group(name: str) -> FusionGroup:
    """The registered group called ``name`` (raises RuntimeFailure naming it if unknown)."""
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeFailure(
            f"fusion group {name!r} is not registered in this process",
            hint="run hetcc.passes.fuse on the graph (or load the saved stage's kernels) before calling it",
        ) from None


@torch.library.custom_op("hetcc::fusion_group", mutates_args=())
def fusion_group(inputs: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Run fusion group ``name`` on ``inputs``: Triton where it can run, the original ops otherwise."""
    return run_forward(registered_group(name), inputs)


@fusion_group.register_fake
def _fusion_group_fake(inputs: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    group = registered_group(name)
    shape = iteration_shape(group, inputs)
    device = compute_device(inputs)
    typed = specialize(group, inputs)  # the dtypes ``run_forward`` and the original ops give
    return [torch.empty(shape, dtype=dtype, device=device) for dtype in typed.output_dtypes]


@torch.library.custom_op("hetcc::fusion_group_backward", mutates_args=())
def fusion_group_backward(
    inputs: list[torch.Tensor], grads: list[torch.Tensor], name: str
) -> list[torch.Tensor]:
    """Gradients of every input of group ``name`` by its generated kernel (an empty tensor for inputs no
    gradient reaches, e.g. a condition, since a custom op cannot return None)."""
    found = run_backward(registered_group(name), inputs, grads)
    return [x.new_empty(0) if g is None else g for g, x in zip(found, inputs)]


@fusion_group_backward.register_fake
def _fusion_group_backward_fake(inputs: list[torch.Tensor], grads: list[torch.Tensor], name: str):
    reached = set(differentiable_inputs(registered_group(name)))
    return [x.new_empty(x.shape if i in reached else (0,)) for i, x in enumerate(inputs)]


def _setup_context(ctx, inputs: tuple, output) -> None:
    tensors, name = inputs
    ctx.save_for_backward(*tensors)
    ctx.name = name
    # Backward usually runs outside autocast; it uses the forward's state to see the forward's dtypes.
    ctx.autocast = autocast_state(compute_device(tensors).type)


def _backward(ctx, grads: Sequence[torch.Tensor | None]):
    """Generated kernel where the group has one and Triton runs, through the backward op (so a traced
    backward shows one node); else torch autograd on the ops."""
    group, inputs = registered_group(ctx.name), list(ctx.saved_tensors)
    typed = generated_backward(group, inputs, ctx.autocast)
    return group_input_grads(group, typed, inputs, grads, ctx.autocast, _backward_op), None


def _backward_op(typed: FusionGroup, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list:
    register_group(typed)  # the backward op finds the retyped group by its name
    return torch.ops.hetcc.fusion_group_backward(inputs, grads, typed.name)


fusion_group.register_autograd(_backward, setup_context=_setup_context)
