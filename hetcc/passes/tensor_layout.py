"""tensor_layout: how a tensor-parallel stage's weights are split over its t devices, what the runtime
needs to give each device its part (``take_part``) and to make the whole again (checkpoints, export).
``passes.tensor_parallel`` decides the layout; this module holds it, apart from the pass, so the runtime
and the stage graphs import the layout alone."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch

from hetcc import collectives


@dataclass(frozen=True)
class ParamShard:
    """How a weight is split over the t devices: along ``dim`` (None: whole on each), whose size is
    ``blocks`` equal pieces each split t ways (1: one contiguous part per device)."""

    dim: int | None
    blocks: int = 1

    def part(self, tensor: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
        """Device ``rank``'s part of the whole ``tensor``."""
        if self.dim is None:
            return tensor
        pieces = tensor.chunk(self.blocks, dim=self.dim)
        return torch.cat([collectives.own_slice(p, self.dim, rank, degree) for p in pieces], dim=self.dim)

    def whole(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every device's part (rank order)."""
        if self.dim is None:
            return parts[0]
        split = [p.chunk(self.blocks, dim=self.dim) for p in parts]
        return torch.cat([split[r][b] for b in range(self.blocks) for r in range(len(parts))], dim=self.dim)


@dataclass
class TensorLayout:
    """The result for one graph at one degree: each parameter's split, and the ops that gathered a
    sharded input for want of a rule."""

    degree: int
    params: dict[str, ParamShard] = field(default_factory=dict)
    gathered_ops: list[str] = field(default_factory=list)

    @property
    def sharded_params(self) -> dict[str, ParamShard]:
        return {name: shard for name, shard in self.params.items() if shard.dim is not None}


def take_part(module: torch.nn.Module, layout: TensorLayout, rank: int) -> None:
    """Replace each sharded weight of ``module`` (a stage holding them whole) by device ``rank``'s part."""
    for target, shard in layout.sharded_params.items():
        _set_attr(module, target, shard.part(operator.attrgetter(target)(module), rank, layout.degree))


def _set_attr(module: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *path, name = target.split(".")
    owner = functools.reduce(getattr, path, module)
    old = getattr(owner, name)
    new = (
        torch.nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad)
        if isinstance(old, torch.nn.Parameter)
        else value.detach().clone()
    )
    delattr(owner, name)
    if isinstance(new, torch.nn.Parameter):
        owner.register_parameter(name, new)
    else:
        owner.register_buffer(name, new)
