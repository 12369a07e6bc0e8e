"""Wire codecs for tensors that cross a pipeline cut: activations forward, gradients back.

``CODECS`` is the table, one row per codec, each a ``Codec`` (name and lossiness order) over a
scheme from ``hetcc.wire.quantize`` or ``hetcc.wire.lowrank`` that does the math. A payload is one
1-D contiguous uint8 tensor whose size depends on the shape alone: under autocast a tensor traced in
fp32 may arrive as bf16, and the receiver must still know how many bytes come. An all-zero payload
decodes to zeros (the runtime sends one where autograd produced no gradient).

Quality budgets are ordered by ``loss_rank``: none 0 < bf16 = fp16 1 < int8 = int8-hadamard 2 <
fp8 3 < int4 = int4-hadamard 4 < lowrank 5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hetcc.errors import PlanFormatError, RuntimeFailure, did_you_mean
from hetcc.wire.layout import numel
from hetcc.wire.lowrank import LowRank
from hetcc.wire.quantize import Cast, RowFp8, Tiled

MIN_CODED_ELEMENTS = 1024  # below this a tensor goes as it is: the scales and the launch outweigh it


class Scheme(Protocol):
    """The math of one codec, on flat tensors (``Codec`` flattens, detaches and converts dtypes)."""

    def fits(self, shape: Sequence[int]) -> bool: ...  # shape conditions beyond a smaller payload
    def payload_bytes(self, shape: Sequence[int]) -> int: ...
    def encode(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor: ...  # uint8 payload
    def decode(self, payload: torch.Tensor, shape: Sequence[int]) -> torch.Tensor: ...  # flat fp32
    def error_bound(self, x: torch.Tensor, shape: Sequence[int]) -> float: ...  # in fp32 arithmetic
    def flops(self, shape: Sequence[int]) -> float: ...  # of one encode


@dataclass(frozen=True)
class Codec:
    """One wire codec: ``name`` (a key of ``CODECS``) and ``loss_rank``, its place in the order of
    quality budgets. Encode and decode run without autograd and are deterministic."""

    name: str
    loss_rank: int

    @property
    def scheme(self) -> Scheme:
        return _TABLE[self.name][1]

    def applies(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """Whether a tensor of this shape and dtype is worth encoding: floating point (not complex),
        at least ``MIN_CODED_ELEMENTS`` elements, and a payload smaller than its raw bytes."""
        n = numel(shape)
        if not dtype.is_floating_point or n < MIN_CODED_ELEMENTS or not self.scheme.fits(shape):
            return False
        return self.payload_bytes(shape) < n * dtype.itemsize

    def payload_bytes(self, shape: Sequence[int]) -> int:
        """The exact size of the encoded payload: a function of the shape alone, not the dtype."""
        return self.scheme.payload_bytes(shape)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a 1-D contiguous uint8 payload of ``payload_bytes(x.shape)``, on ``x``'s device."""
        if not x.dtype.is_floating_point:
            raise PlanFormatError(
                f"wire codec {self.name!r} encodes floating-point tensors, got {x.dtype}",
                hint="choose codecs with Codec.applies(shape, dtype); other tensors go as they are",
            )
        with torch.no_grad():
            return self.scheme.encode(_flat(x), x.shape).contiguous()

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The reconstruction, of ``shape`` and ``dtype``, on ``payload``'s device."""
        self._check_payload(payload, shape)
        with torch.no_grad():
            return self.scheme.decode(payload.detach().contiguous(), shape).to(dtype).reshape(tuple(shape))

    def error_bound(self, x: torch.Tensor) -> float:
        """A bound on ``max |decode(encode(x), x.shape, x.dtype) - x|``: the scheme's (stated in its
        docstring; lowrank's is its measured error) plus reading ``x`` into fp32 and writing the
        result back as ``x.dtype`` (half an ulp of each, and the smallest fp32 normal for underflow)."""
        with torch.no_grad():
            flat = _flat(x)
            bound = self.scheme.error_bound(flat, x.shape)
            magnitude = float(flat.abs().max()) + bound
        info = torch.finfo(x.dtype)
        return bound + magnitude * (info.eps / 2 + 2**-24) + info.tiny * info.eps / 2 + 2**-126

    def work(self, shape: Sequence[int]) -> tuple[float, float]:
        """(flops, bytes moved) of one encode, for a roofline price (a decode is priced the same):
        the raw tensor read as fp32 plus the payload written."""
        return self.scheme.flops(shape), 4.0 * numel(shape) + self.payload_bytes(shape)

    def _check_payload(self, payload: torch.Tensor, shape: Sequence[int]) -> None:
        want = self.payload_bytes(shape)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != want:
            raise RuntimeFailure(
                f"wire codec {self.name!r} expects a 1-D uint8 payload of {want} bytes for shape "
                f"{list(shape)}, got {payload.dtype} of shape {list(payload.shape)}",
                hint="sender and receiver of a cut must use the same plan (codec and tensor shape)",
            )


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous()


# name: (loss_rank, scheme). loss_rank orders quality budgets; equal ranks lose about as much.
_TABLE: dict[str, tuple[int, Scheme]] = {
    "none": (0, Cast(torch.float32, passthrough=True)),
    "bf16": (1, Cast(torch.bfloat16)),
    "fp16": (1, Cast(torch.float16)),
    "int8": (2, Tiled(bits=8)),
    "int8-hadamard": (2, Tiled(bits=8, rotate=True)),
    "fp8": (3, RowFp8()),
    "int4": (4, Tiled(bits=4)),
    "int4-hadamard": (4, Tiled(bits=4, rotate=True)),
    "lowrank": (5, LowRank()),
}

NO_CODEC = "none"  # what a tensor crosses with when no codec applies

CODECS: dict[str, Codec] = {name: Codec(name, loss_rank) for name, (loss_rank, _) in _TABLE.items()}


def get_codec(name: str) -> Codec:
    """The codec called ``name``; an unknown name is a PlanFormatError listing the known ones."""
    if name not in CODECS:
        raise PlanFormatError(
            f"unknown wire codec {name!r}{did_you_mean(name, CODECS)}",
            hint=f"use one of: {', '.join(CODECS)}",
        )
    return CODECS[name]


def within_budget(name: str, budget: str) -> bool:
    """Whether codec ``name`` loses no more than the budget codec ``budget`` allows."""
    return get_codec(name).loss_rank <= get_codec(budget).loss_rank
