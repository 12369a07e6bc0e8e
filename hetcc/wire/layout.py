"""What the wire formats share: the tile and fp8 constants, sizes, and reading a slice of a payload as a
dtype (``hetcc.wire.quantize`` is the torch reference, ``hetcc.wire.triton_codecs`` the fused kernels)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

TILE = 128  # elements per scale in the tiled integer formats
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, last dim): the tensor as a matrix of its last dimension; 0-d and 1-d are one row."""
    n = numel(shape)
    d = int(shape[-1]) if len(shape) >= 2 else n
    return (n // d if d else 0), d


def tile_count(n: int) -> int:
    return -(-n // TILE)


def view_as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte slice of a payload read as ``dtype`` (copied first where it starts unaligned)."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype)
