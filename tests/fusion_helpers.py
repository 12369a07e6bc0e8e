"""Shared by the fusion tests: export a module, fuse a copy, run a training step on either, and check
from the launch counters which code the fused groups ran."""

from __future__ import annotations

import copy

import torch

from hetcc.kernels import launch_stats, reset_launch_stats
from hetcc.passes.fuse import FUSION_META_KEY, fuse


def export_and_fuse(module: torch.nn.Module, args: tuple):
    reference = torch.export.export(module, args, strict=False).module()
    return reference, fuse(copy.deepcopy(reference))


def fused_groups(gm: torch.fx.GraphModule):
    return [n.meta[FUSION_META_KEY] for n in gm.graph.nodes if FUSION_META_KEY in n.meta]


def forward_backward(gm: torch.fx.GraphModule, args: tuple, seed: int = 0):
    """Outputs and gradients (inputs, then parameters) of a weighted sum of the float outputs."""
    gm.zero_grad(set_to_none=True)
    leaves = [a.clone().requires_grad_(a.dtype.is_floating_point) for a in args]
    outputs = gm(*leaves)
    outputs = outputs if isinstance(outputs, tuple | list) else (outputs,)
    generator = torch.Generator().manual_seed(seed)
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=generator)).sum()
        for o in outputs
        if o.dtype.is_floating_point
    )
    loss.backward()
    grads = [leaf.grad for leaf in leaves if leaf.requires_grad] + [p.grad for p in gm.parameters()]
    return [o.detach() for o in outputs], grads


def forward_backward_counted(gm: torch.fx.GraphModule, args: tuple, seed: int = 0):
    """``forward_backward`` and how its fused groups ran (``hetcc.kernels.launch_stats``)."""
    reset_launch_stats()
    result = forward_backward(gm, args, seed)
    return result, launch_stats()


def assert_generated_kernels_ran(groups: list, launches: dict[str, int]) -> None:
    """One training step ran each group's generated forward kernel once through the interpreter, and its
    backward once: the generated kernel (``backward == "generated"``, pointwise and row groups), or
    autograd over the original ops for a group saved with ``backward == "recompute"``. Nothing fell back
    to eager."""
    generated = sum(group.backward == "generated" for group in groups)
    expected = dict.fromkeys(launches, 0)
    expected |= {
        "fused_interpreter": len(groups),
        "backward_interpreter": generated,
        "backward_recompute": len(groups) - generated,
    }
    assert launches == expected
