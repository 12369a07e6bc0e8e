"""The collectives of a tensor-parallel stage as graph ops: ``hetcc::all_reduce``, ``hetcc::all_gather``,
``hetcc::tensor_enter``, ``hetcc::tensor_slice`` and, for sequence parallelism, ``hetcc::reduce_scatter``
and ``hetcc::gather_enter``; and ``hetcc::dropout_mask``, a sharded tensor's part of a whole dropout mask.

A stage with tensor degree t runs on t devices, each holding a shard of its weights
(``hetcc.passes.tensor_parallel``). Every tensor in its graph is either *replicated* (the same on every
device) or *sharded* along one dimension; the ops move a tensor between the two, and their backward
keeps the one invariant the pass relies on: **the gradient of a replicated tensor is the same on every
device**. Hence (Megatron-LM's f and g, generalised):

=================  ==============================================  ============================================
op                 forward                                         backward
=================  ==============================================  ============================================
``all_reduce``     sum of the devices' partial sums (row-parallel  identity (the gradient is already the same
                   matmul): replicated                             on every device)
``tensor_enter``   identity, where a replicated tensor feeds an    all-reduce: each device's gradient is its
                   op whose result is sharded                      shard's part of the whole
``all_gather``     the shards concatenated along ``dim``           this device's slice of the (replicated)
                                                                   gradient
``tensor_slice``   this device's slice along ``dim``               the gradients' shards gathered
``reduce_scatter`` this device's slice of the sum of the devices'  the gradients' shards gathered (every
                   partial sums (row-parallel matmul, sequence     device's partial sum feeds every slice)
                   parallel): sharded along ``dim``
``gather_enter``   the shards gathered along ``dim``, where they   reduce-scatter: each device's gradient is
                   feed an op whose result is sharded              its shard's part of the whole, summed
=================  ==============================================  ============================================

``reduce_scatter`` then ``gather_enter`` move what one ``all_reduce`` does (Megatron-LM's sequence
parallelism), and what runs between them on the sharded sequence (norms, residual adds, dropout)
computes and keeps 1/t of the tokens.

The ops run over the *current tensor group* (``use_tensor_group``), which the runtime sets to the
stage's tensor-parallel process group; ``LocalTensorGroup`` is a group of one (degree 1) for tests and
tools that run a stage's code in one process. Like ``hetcc.sendrecv``, this module sits below the passes
and the runtime and imports neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from hetcc.errors import RuntimeFailure


class TensorGroup(Protocol):
    """The devices of one tensor-parallel stage: this device's ``rank`` among ``size``."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...


class LocalTensorGroup:
    """A tensor group of one device: every collective is the identity."""

    rank, size = 0, 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.clone()

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.clone()


class ProcessTensorGroup:
    """A tensor group over a ``torch.distributed`` process group (``group``: None is the world)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.contiguous().clone()
        self._dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(self.size)]
        self._dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This device's slice of the sum: one reduce-scatter where the backend has it (gloo has none:
        an all-reduce, then the slice)."""
        if self._dist.get_backend(self.group) == "gloo":
            return own_slice(self.all_reduce(tensor), dim, self.rank, self.size).contiguous()
        whole = tensor.movedim(dim, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // self.size, *whole.shape[1:]))
        self._dist.reduce_scatter_tensor(out, whole, group=self.group)
        return out.movedim(0, dim).contiguous()


_current: list[TensorGroup] = []


@contextlib.contextmanager
def use_tensor_group(group: TensorGroup) -> Iterator[TensorGroup]:
    """Run the collectives of the stage's graph over ``group`` for the block."""
    _current.append(group)
    try:
        yield group
    finally:
        _current.pop()


def _group() -> TensorGroup:
    if not _current:
        raise RuntimeFailure(
            "a tensor-parallel collective (hetcc.all_reduce / all_gather / tensor_enter / tensor_slice / "
            "reduce_scatter / gather_enter) ran "
            "outside a tensor group",
            hint="run stage modules through hetcc.runtime (run_local / launch), or inside "
            "hetcc.collectives.use_tensor_group(...)",
        )
    return _current[-1]


def part_shape(shape, dim: int, degree: int) -> list[int]:
    """The shape of one of ``degree`` equal parts along ``dim`` of a tensor of ``shape``."""
    part = list(shape)
    part[dim] //= degree
    return part


def own_slice(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Device ``rank``'s equal part of ``tensor`` along ``dim``, of ``size`` parts."""
    return tensor.chunk(size, dim=dim)[rank]


# ------------------------------------------------------------------------------------------ all_reduce


@torch.library.custom_op("hetcc::all_reduce", mutates_args=())
def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over the tensor group (each device holds a partial sum)."""
    return _group().all_reduce(tensor)


@all_reduce.register_fake
def _all_reduce_fake(tensor):
    return torch.empty_like(tensor)


all_reduce.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------------------------------- tensor_enter


@torch.library.custom_op("hetcc::tensor_enter", mutates_args=())
def tensor_enter(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (replicated) as the input of sharded ops: the identity, whose gradient is all-reduced."""
    return tensor.clone()


@tensor_enter.register_fake
def _tensor_enter_fake(tensor):
    return torch.empty_like(tensor)


tensor_enter.register_autograd(
    lambda ctx, grad: _group().all_reduce(grad), setup_context=lambda ctx, inputs, output: None
)


# ------------------------------------------------------------------------------------------ all_gather


@torch.library.custom_op("hetcc::all_gather", mutates_args=())
def all_gather(tensor: torch.Tensor, dim: int, degree: int) -> torch.Tensor:
    """The ``degree`` devices' shards of a tensor, concatenated along ``dim``."""
    return _group_of("all_gather", degree).all_gather(tensor, dim)


@all_gather.register_fake
def _all_gather_fake(tensor, dim, degree):
    shape = list(tensor.shape)
    shape[dim] *= degree
    return tensor.new_empty(shape)


def _gather_setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.degree = inputs


def _all_gather_backward(ctx, grad):
    group = _group()
    return own_slice(grad, ctx.dim, group.rank, ctx.degree).contiguous(), None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_gather_setup)


# ---------------------------------------------------------------------------------------- tensor_slice


@torch.library.custom_op("hetcc::tensor_slice", mutates_args=())
def tensor_slice(tensor: torch.Tensor, dim: int, degree: int) -> torch.Tensor:
    """This device's part of a replicated ``tensor`` along ``dim`` (of ``degree`` equal parts)."""
    group = _group_of("tensor_slice", degree)
    return own_slice(tensor, dim, group.rank, degree).clone(memory_format=torch.contiguous_format)


@tensor_slice.register_fake
def _part_fake(tensor, dim, degree):
    """A part along ``dim`` (``tensor_slice``'s and ``reduce_scatter``'s result)."""
    return tensor.new_empty(part_shape(tensor.shape, dim, degree))


def _gathered_backward(ctx, grad):
    """The gradient of a part is the whole one gathered (``tensor_slice``, ``reduce_scatter``)."""
    return _group().all_gather(grad.contiguous(), ctx.dim), None, None


tensor_slice.register_autograd(_gathered_backward, setup_context=_gather_setup)


# -------------------------------------------------------------------------------------- reduce_scatter


@torch.library.custom_op("hetcc::reduce_scatter", mutates_args=())
def reduce_scatter(tensor: torch.Tensor, dim: int, degree: int) -> torch.Tensor:
    """This device's part along ``dim`` of the sum of the ``degree`` devices' partial sums ``tensor``."""
    return _group_of("reduce_scatter", degree).reduce_scatter(tensor, dim)


reduce_scatter.register_fake(_part_fake)
reduce_scatter.register_autograd(_gathered_backward, setup_context=_gather_setup)


# ---------------------------------------------------------------------------------------- gather_enter


@torch.library.custom_op("hetcc::gather_enter", mutates_args=())
def gather_enter(tensor: torch.Tensor, dim: int, degree: int) -> torch.Tensor:
    """The ``degree`` devices' shards concatenated along ``dim``, as the input of sharded ops (a
    column-parallel matmul): its gradient, a partial sum on each device, is reduce-scattered."""
    return _group_of("gather_enter", degree).all_gather(tensor, dim)


gather_enter.register_fake(_all_gather_fake)


def _gather_enter_backward(ctx, grad):
    return _group().reduce_scatter(grad.contiguous(), ctx.dim), None, None


gather_enter.register_autograd(_gather_enter_backward, setup_context=_gather_setup)


# ---------------------------------------------------------------------------------------- dropout_mask


@torch.library.custom_op("hetcc::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask(like: torch.Tensor, shape: list[int], p: float, dim: int, degree: int) -> torch.Tensor:
    """This device's part along ``dim`` of a dropout mask for a whole tensor of ``shape``: 0 (dropped,
    probability ``p``) or 1 / (1 - p), in ``like``'s dtype and on its device. Every device of the group
    draws the whole mask from the random state they share and keeps its part, so the parts of a sharded
    tensor are dropped as the whole tensor would be (not alike), and the devices' draws stay in step.
    The draw is eager PyTorch's on CPU (``bernoulli_(1 - p)`` then ``div_(1 - p)``): a sharded dropout
    there gives the whole graph's result bit for bit."""
    group = _group_of("dropout_mask", degree)
    whole = torch.empty(shape, dtype=like.dtype, device=like.device)
    whole = whole.zero_() if p >= 1 else whole.bernoulli_(1 - p).div_(1 - p)
    return own_slice(whole, dim, group.rank, degree).clone(memory_format=torch.contiguous_format)


@dropout_mask.register_fake
def _dropout_mask_fake(like, shape, p, dim, degree):
    return like.new_empty(part_shape(shape, dim, degree))


# the mask depends on ``like``'s dtype and device, not on its values
dropout_mask.register_autograd(
    lambda ctx, grad: (None, None, None, None, None), setup_context=lambda ctx, inputs, output: None
)


def _group_of(op: str, degree: int) -> TensorGroup:
    """The current tensor group, which ``op`` (compiled for ``degree`` devices) must run on."""
    group = _group()
    if group.size != degree:
        raise RuntimeFailure(
            f"hetcc.{op} was compiled for tensor degree {degree} but runs in a tensor group of {group.size} "
            "devices",
            hint="run the stage on as many devices as its plan gives it (pipeline.json: tensor degree per stage)",
        )
    return group
