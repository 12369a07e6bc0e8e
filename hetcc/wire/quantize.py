"""Scalar wire formats: a cast to a narrower float, integer levels per 128-element tile (optionally
after a Hadamard rotation of each tile), and fp8 e4m3 with one scale per row.

Each scheme maps a flat tensor to one uint8 payload and back to flat fp32 (``hetcc.wire.codecs`` does
the flattening and the dtypes). This is the reference: on a CUDA/ROCm tensor the int8, int4 and fp8
formats run as fused Triton kernels (``hetcc.wire.triton_codecs``) that write the same bytes.

Scales are ``absmax * fp32(1 / qmax)``, a multiply rather than a divide: torch on CUDA divides by a
Python scalar as a multiply by its reciprocal, so a divide would round differently on each device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetcc.kernels import cache
from hetcc.wire.layout import FP8_MAX, TILE, matrix_shape, numel, tile_count, view_as

_SUBNORMAL_STEP_FP8 = 2.0**-9  # spacing of e4m3 subnormals, in units of the row scale


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the fused Triton kernels serve ``t``: a CUDA/ROCm tensor, with Triton installed."""
    return t.is_cuda and cache.triton_installed()


def _triton_codecs():
    # Imported on first use on a GPU tensor: importing Triton costs seconds and it may be absent.
    from hetcc.wire import triton_codecs

    return triton_codecs


@dataclass(frozen=True)
class Cast:
    """x rounded to ``dtype`` (fp16 clamped to its range first). Bound: half an ulp of the target,
    ``|x| * eps/2``, plus half its subnormal spacing, plus what fp16's clamp cuts off.
    ``passthrough`` marks "none": the tensor goes as fp32 and is never chosen as a codec."""

    dtype: torch.dtype
    passthrough: bool = False

    def fits(self, shape: Sequence[int]) -> bool:
        return not self.passthrough

    def payload_bytes(self, shape: Sequence[int]) -> int:
        return numel(shape) * self.dtype.itemsize

    def encode(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        y = x.float()
        if self.dtype == torch.float16:  # finite values saturate; inf and nan stay (an fp16 scaler sees them)
            y = torch.where(torch.isfinite(y), y.clamp(-65504.0, 65504.0), y)
        return y.to(self.dtype, copy=True).view(torch.uint8)  # a copy even for "none": no aliasing

    def decode(self, payload: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return view_as(payload, self.dtype).to(torch.float32, copy=True)

    def error_bound(self, x: torch.Tensor, shape: Sequence[int]) -> float:
        info, absmax = torch.finfo(self.dtype), float(x.abs().max())
        clipped = max(0.0, absmax - info.max)
        return absmax * info.eps / 2 + info.tiny * info.eps / 2 + clipped

    def flops(self, shape: Sequence[int]) -> float:
        return 0.0 if self.passthrough else float(numel(shape))


def hadamard(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix H_128 / sqrt(128): symmetric, its own inverse."""
    return _hadamard(torch.device(device), dtype)


@functools.cache
def _hadamard(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < TILE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(TILE)).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class Tiled:
    """Symmetric integer levels, one fp32 scale per 128-element tile (the last one zero-padded):
    ``s = absmax * (1/qmax)``, ``q = round(x / s)`` clamped to ``[-qmax, qmax]``; int4 stores
    ``q + 8`` as nibbles, element 2i low, 2i+1 high. ``rotate`` first multiplies each padded tile by
    ``hadamard()``, which spreads an outlier over its tile; those formats store all padded levels.

    Layout: ``[scales fp32 x ntiles][levels]``, levels ``n`` (int8) or ``ceil(n/2)`` (int4) bytes,
    ``ntiles * 128`` or ``ntiles * 64`` bytes when rotated.

    Bound: rounding and the fp32 divide/multiply leave ``max s * (1/2 + 2^-12)``. Rotated, that holds
    per element in the rotated space; the orthonormal rotation keeps its 2-norm, so
    ``sqrt(128) * max s * (1/2 + 2^-12)``, plus ``2^-12 * ||tile||_2`` for the fp32 rounding of the
    two 128-term products."""

    bits: int
    rotate: bool = False

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def fits(self, shape: Sequence[int]) -> bool:
        return True

    def payload_bytes(self, shape: Sequence[int]) -> int:
        tiles = tile_count(numel(shape))
        return 4 * tiles + self._level_bytes(tiles * TILE if self.rotate else numel(shape))

    def _level_bytes(self, count: int) -> int:
        return count if self.bits == 8 else (count + 1) // 2

    def encode(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        if runs_triton(x) and not self.rotate:
            return _triton_codecs().encode_tiles(x, self.bits)
        tiles = _padded_tiles(x.float())
        if self.rotate:
            tiles = tiles @ hadamard(x.device)
        scale, q = quantize_tiles(tiles, self.qmax)
        levels = q.reshape(-1) if self.rotate else q.reshape(-1)[: x.numel()]
        data = levels.to(torch.int8).view(torch.uint8) if self.bits == 8 else pack_nibbles(levels)
        return torch.cat([scale.view(torch.uint8), data])

    def decode(self, payload: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        n = numel(shape)
        if runs_triton(payload) and not self.rotate:
            return _triton_codecs().decode_tiles(payload, n, self.bits)
        tiles = tile_count(n)
        scale, data = view_as(payload[: 4 * tiles], torch.float32), payload[4 * tiles :]
        count = tiles * TILE if self.rotate else n
        levels = view_as(data, torch.int8).float() if self.bits == 8 else unpack_nibbles(data, count)
        values = _padded_tiles(levels) * scale[:, None]
        if self.rotate:
            values = values @ hadamard(payload.device)
        return values.reshape(-1)[:n]

    def error_bound(self, x: torch.Tensor, shape: Sequence[int]) -> float:
        tiles = _padded_tiles(x.float())
        if not self.rotate:
            scale, _ = quantize_tiles(tiles, self.qmax)
            return float(scale.max()) * (0.5 + 2**-12)
        scale, _ = quantize_tiles(tiles @ hadamard(x.device), self.qmax)
        rounding = float(tiles.norm(dim=1).max()) * 2**-12
        return math.sqrt(TILE) * float(scale.max()) * (0.5 + 2**-12) + rounding

    def flops(self, shape: Sequence[int]) -> float:
        padded = tile_count(numel(shape)) * TILE
        rotation = 2.0 * TILE * padded if self.rotate else 0.0
        return 5.0 * padded + rotation  # abs, max, divide, clamp, round per element


def _padded_tiles(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` zero-padded to whole tiles, as ``[ntiles, 128]``."""
    return F.pad(flat, (0, -flat.numel() % TILE)).view(-1, TILE)


def quantize_tiles(tiles: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scale per tile, levels as fp32 integers in ``[-qmax, qmax]``). A zero tile has scale 0
    and levels 0: it is divided by 1 instead, so nothing divides by zero."""
    scale = tiles.abs().amax(dim=1) * (1.0 / qmax)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.round((tiles / safe[:, None]).clamp(-qmax, qmax))


def pack_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """int4 levels (fp32 in [-7, 7]) as ``level + 8`` nibbles, two per byte, even element low; an
    odd count is padded with level 0."""
    codes = (F.pad(levels, (0, levels.numel() % 2)) + 8).to(torch.uint8).view(-1, 2)
    return codes[:, 0] | (codes[:, 1] << 4)


def unpack_nibbles(data: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` int4 levels of ``data`` as fp32 (byte 0 reads as -8: times scale 0 is 0)."""
    codes = torch.stack([data & 15, data >> 4], dim=1).reshape(-1)[:count]
    return codes.float() - 8.0


@dataclass(frozen=True)
class RowFp8:
    """float8 e4m3fn with one fp32 scale per row of the last dimension: ``s = absmax_row * (1/448)``,
    values ``x / s`` clamped to +-448 and cast. Layout: ``[scales fp32 x rows][values, n bytes]``.

    Bound: 3 mantissa bits round to ``|x| * 2^-4``; below e4m3's normal range the spacing is ``2^-9``
    in units of ``s``, and ``s * 2^-9`` also covers the fp32 divide and multiply. The bound returned is
    the largest over rows of ``absmax_row * 2^-4 + s * 2^-9``."""

    def fits(self, shape: Sequence[int]) -> bool:
        return True

    def payload_bytes(self, shape: Sequence[int]) -> int:
        return 4 * matrix_shape(shape)[0] + numel(shape)

    def encode(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        rows, d = matrix_shape(shape)
        if runs_triton(x):
            return _triton_codecs().encode_rows_fp8(x, rows, d)
        m = x.float().view(rows, d)
        scale = m.abs().amax(dim=1) * (1.0 / FP8_MAX)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        values = (m / safe[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch.cat([scale.view(torch.uint8), values.view(torch.uint8).reshape(-1)])

    def decode(self, payload: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        rows, d = matrix_shape(shape)
        if runs_triton(payload):
            return _triton_codecs().decode_rows_fp8(payload, rows, d)
        scale = view_as(payload[: 4 * rows], torch.float32)
        values = payload[4 * rows :].view(torch.float8_e4m3fn).float().view(rows, d)
        return (values * scale[:, None]).reshape(-1)

    def error_bound(self, x: torch.Tensor, shape: Sequence[int]) -> float:
        rows, d = matrix_shape(shape)
        absmax = x.float().view(rows, d).abs().amax(dim=1)
        scale = absmax * (1.0 / FP8_MAX)
        return float((absmax * 2**-4 + scale * _SUBNORMAL_STEP_FP8).max())

    def flops(self, shape: Sequence[int]) -> float:
        return 5.0 * numel(shape)  # abs, max, divide, clamp, convert per element
