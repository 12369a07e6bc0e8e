"""Fused Triton kernels for the int8 and int4 tile formats and the per-row fp8 format: one launch
reads the tensor (any float dtype) and writes scales and levels straight into views of one
preallocated payload; decode is one launch back to fp32. They write the bytes ``hetcc.wire.quantize``
writes, which tests check under ``TRITON_INTERPRET=1``; codecs call them for CUDA/ROCm tensors.

Bit-equality rests on the same fp32 operations in the same order: the scale is ``absmax * fp32(1 /
qmax)``, the divide is ``tl.div_rn`` (a plain ``/`` is approximate on NVIDIA GPUs), and rounding to
nearest even is ``(y + 1.5 * 2^23) - 1.5 * 2^23`` on ``y`` already clamped to +-qmax (libdevice's
``rint`` does not run in the interpreter). fp8 e4m3 bytes are built with integer ops rather than a
cast to ``tl.float8e4nv``: the interpreter's cast drops the carry when rounding bumps the exponent
(31.6 becomes 16, not 32), and this also runs on GPUs without fp8 conversions (before sm_89).
The Hadamard formats stay in torch: their cost is the 128 x 128 matmul, which torch already does well.

Importing this module imports Triton (seconds); ``hetcc.wire.quantize`` imports it on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetcc.wire.layout import FP8_MAX, TILE, tile_count, view_as

TILES_PER_PROGRAM = 8  # tiles one program quantizes: 1024 elements, a block of [8, 128]
ROW_BLOCK = 1024  # columns one fp8 program reads per step (it loops over the row twice)
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding it rounds |y| < 2^22 to an integer, nearest even


def encode_tiles(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The int8 (``bits=8``) or int4 tile payload of flat contiguous ``x`` (``quantize.Tiled``)."""
    n, tiles = x.numel(), tile_count(x.numel())
    level_bytes = n if bits == 8 else (n + 1) // 2
    payload = torch.empty(4 * tiles + level_bytes, dtype=torch.uint8, device=x.device)
    scale, levels = payload[: 4 * tiles].view(torch.float32), payload[4 * tiles :]
    qmax = 2 ** (bits - 1) - 1
    kernel = _int8_encode if bits == 8 else _int4_encode
    kernel[(triton.cdiv(tiles, TILES_PER_PROGRAM),)](
        x, scale, levels, n, 1.0 / qmax, qmax, TILE, TILES_PER_PROGRAM
    )
    return payload


def decode_tiles(payload: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Flat fp32 ``n`` values from an int8 or int4 tile payload."""
    tiles = tile_count(n)
    scale, levels = view_as(payload[: 4 * tiles], torch.float32), payload[4 * tiles :]
    out = torch.empty(n, dtype=torch.float32, device=payload.device)
    kernel = _int8_decode if bits == 8 else _int4_decode
    kernel[(triton.cdiv(tiles, TILES_PER_PROGRAM),)](scale, levels, out, n, TILE, TILES_PER_PROGRAM)
    return out


def encode_rows_fp8(x: torch.Tensor, rows: int, d: int) -> torch.Tensor:
    """The per-row fp8 payload of flat contiguous ``x`` viewed as [rows, d] (``quantize.RowFp8``)."""
    payload = torch.empty(4 * rows + rows * d, dtype=torch.uint8, device=x.device)
    scale, values = payload[: 4 * rows].view(torch.float32), payload[4 * rows :]
    _fp8_encode[(rows,)](x, scale, values, d, 1.0 / FP8_MAX, FP8_MAX, ROW_BLOCK)
    return payload


def decode_rows_fp8(payload: torch.Tensor, rows: int, d: int) -> torch.Tensor:
    """Flat fp32 values of a per-row fp8 payload for a [rows, d] matrix."""
    scale, values = view_as(payload[: 4 * rows], torch.float32), payload[4 * rows :]
    out = torch.empty(rows * d, dtype=torch.float32, device=payload.device)
    _fp8_decode[(rows, triton.cdiv(d, ROW_BLOCK))](scale, values, out, d, ROW_BLOCK)
    return out


@triton.jit
def _levels(x, scale, qmax):
    """Rows of ``x`` divided by their scale (1 where it is 0), clamped and rounded, as in
    ``quantize.quantize_tiles``."""
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.div_rn(x, safe[:, None])
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    return (y + _ROUNDER) - _ROUNDER


@triton.jit
def _int8_encode(
    x_ptr, scale_ptr, q_ptr, n, inv_qmax, QMAX: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr
):
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)
    offs = tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=1) * inv_qmax
    tl.store(scale_ptr + tile, scale, mask=tile * TILE < n)
    q = _levels(x, scale, QMAX)
    tl.store(q_ptr + offs, q.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True), mask=offs < n)


@triton.jit
def _int8_decode(scale_ptr, q_ptr, out_ptr, n, TILE: tl.constexpr, TILES: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)
    offs = tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    scale = tl.load(scale_ptr + tile, mask=tile * TILE < n, other=0.0)
    q = tl.load(q_ptr + offs, mask=offs < n, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    tl.store(out_ptr + offs, q * scale[:, None], mask=offs < n)


@triton.jit
def _int4_encode(
    x_ptr, scale_ptr, packed_ptr, n, inv_qmax, QMAX: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr
):
    # byte i of a tile holds elements 2i (low nibble) and 2i + 1 (high nibble)
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)
    byte = tile[:, None] * (TILE // 2) + tl.arange(0, TILE // 2)[None, :]
    low = tl.load(x_ptr + 2 * byte, mask=2 * byte < n, other=0.0).to(tl.float32)
    high = tl.load(x_ptr + 2 * byte + 1, mask=2 * byte + 1 < n, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(low), axis=1), tl.max(tl.abs(high), axis=1)) * inv_qmax
    tl.store(scale_ptr + tile, scale, mask=tile * TILE < n)
    low_code = _levels(low, scale, QMAX).to(tl.int32) + 8
    high_code = _levels(high, scale, QMAX).to(tl.int32) + 8
    tl.store(packed_ptr + byte, (low_code | (high_code << 4)).to(tl.uint8), mask=2 * byte < n)


@triton.jit
def _int4_decode(scale_ptr, packed_ptr, out_ptr, n, TILE: tl.constexpr, TILES: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)
    byte = tile[:, None] * (TILE // 2) + tl.arange(0, TILE // 2)[None, :]
    scale = tl.load(scale_ptr + tile, mask=tile * TILE < n, other=0.0)[:, None]
    code = tl.load(packed_ptr + byte, mask=2 * byte < n, other=0).to(tl.int32)
    tl.store(out_ptr + 2 * byte, ((code & 15) - 8).to(tl.float32) * scale, mask=2 * byte < n)
    tl.store(out_ptr + 2 * byte + 1, ((code >> 4) - 8).to(tl.float32) * scale, mask=2 * byte + 1 < n)


@triton.jit
def _fp8_encode(x_ptr, scale_ptr, value_ptr, d, inv_max, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    absmax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        x = tl.load(x_ptr + row * d + start + cols, mask=start + cols < d, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.max(absmax, axis=0) * inv_max
    tl.store(scale_ptr + row, scale)
    safe = tl.where(scale > 0, scale, 1.0)
    for start in range(0, d, BLOCK):
        offs = row * d + start + cols
        x = tl.load(x_ptr + offs, mask=start + cols < d, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.div_rn(x, safe), -FP8_MAX), FP8_MAX)
        tl.store(value_ptr + offs, _e4m3_byte(y), mask=start + cols < d)


@triton.jit
def _fp8_decode(scale_ptr, value_ptr, out_ptr, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr + row)
    code = tl.load(value_ptr + row * d + cols, mask=cols < d, other=0).to(tl.int32)
    tl.store(out_ptr + row * d + cols, _e4m3_value(code) * scale, mask=cols < d)


@triton.jit
def _e4m3_byte(y):
    """The float8_e4m3fn byte of fp32 ``y`` in [-448, 448], rounded to nearest even as torch casts.
    Normal range: drop 20 of fp32's 23 mantissa bits with round-half-even (a carry moves into the
    exponent) and rebias the exponent from 127 to 7; below 2^-6, steps of 2^-9 counted directly."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = ((tl.abs(y) * 512.0 + _ROUNDER) - _ROUNDER).to(tl.int32)
    code = tl.where(tl.abs(y) < 0.015625, subnormal, normal)
    return (code | (((bits >> 31) & 1) << 7)).to(tl.uint8)


@triton.jit
def _e4m3_value(code):
    """fp32 of a float8_e4m3fn byte (as int32), exactly; the NaN byte, which encode never writes,
    reads as 480."""
    sign, exponent, mantissa = code >> 7, (code >> 3) & 15, code & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    return tl.where(exponent == 0, tl.where(sign == 1, -subnormal, subnormal), normal)
