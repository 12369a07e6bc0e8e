"""Low-rank wire format: the tensor as a matrix ``m`` [rows, d] (d = last dim) sent as factors
``A`` [rows, r] and ``B`` [d, r] with ``m ~ A @ B.T``, ``r = max(1, ceil(d / 16))`` capped at
``min(rows, d)``.

The factors come from a randomized range finder (Halko, Martinsson & Tropp 2011): a Gaussian test
matrix with ``r + 8`` columns from a CPU generator seeded 0 (so encoding is deterministic and
independent of the global RNG), two power iterations re-orthonormalised by QR, then the SVD of the
small projected matrix truncated to rank ``r``. Payload: ``[A fp32 rows*r][B fp32 d*r]``, row-major.

A max-abs bound is not what a truncated SVD controls, so ``error_bound`` reports the max-abs error of
the reconstruction this codec produces (it encodes and decodes); the Frobenius error is near the best
rank-r one (Eckart-Young), which tests check against ``torch.linalg.svd``. No error feedback here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetcc.wire.layout import matrix_shape, view_as

OVERSAMPLE = 8  # extra test columns: the range finder's error nears the best rank-r error
POWER_ITERATIONS = 2  # each sharpens the spectrum the range finder sees (activations decay slowly)


def rank(shape: Sequence[int]) -> int:
    rows, d = matrix_shape(shape)
    return min(max(1, -(-d // 16)), rows, d)


@dataclass(frozen=True)
class LowRank:
    """Rank-``rank(shape)`` factors of the tensor viewed as [rows, last dim] (module docstring)."""

    def fits(self, shape: Sequence[int]) -> bool:
        rows, d = matrix_shape(shape)
        return rank(shape) * (rows + d) < rows * d

    def payload_bytes(self, shape: Sequence[int]) -> int:
        rows, d = matrix_shape(shape)
        return 4 * rank(shape) * (rows + d)

    def encode(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        if not bool(torch.isfinite(x).all()):
            # No factorisation exists: NaN factors decode to NaN, which a loss scaler sees as the overflow it is.
            return torch.full((self.payload_bytes(shape) // 4,), math.nan, device=x.device).view(torch.uint8)
        a, b = factor(x.float().view(matrix_shape(shape)), rank(shape))
        return torch.cat([a.contiguous().view(-1), b.contiguous().view(-1)]).view(torch.uint8)

    def decode(self, payload: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        (rows, d), r = matrix_shape(shape), rank(shape)
        factors = view_as(payload, torch.float32)
        a, b = factors[: rows * r].view(rows, r), factors[rows * r :].view(d, r)
        return (a @ b.T).reshape(-1)

    def error_bound(self, x: torch.Tensor, shape: Sequence[int]) -> float:
        reconstruction = self.decode(self.encode(x, shape), shape)
        return float((reconstruction - x.float()).abs().max())

    def flops(self, shape: Sequence[int]) -> float:
        rows, d = matrix_shape(shape)
        k = _columns(rows, d, rank(shape))
        products = 2.0 * rows * d * k * (2 + 2 * POWER_ITERATIONS)  # m @ omega, the iterations, q.T @ m
        factorisations = 4.0 * k * k * (rows + d) * (POWER_ITERATIONS + 1)  # the QRs and the small SVD
        return products + factorisations + 2.0 * rows * k * rank(shape)  # + q @ u


def _columns(rows: int, d: int, r: int) -> int:
    return min(r + OVERSAMPLE, rows, d)


def factor(m: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [rows, r], B [d, r]) with ``m ~ A @ B.T``: A holds the singular values (U * S), B = V."""
    rows, d = m.shape
    generator = torch.Generator().manual_seed(0)
    omega = torch.randn(d, _columns(rows, d, r), generator=generator).to(m.device)
    q = torch.linalg.qr(m @ omega).Q
    for _ in range(POWER_ITERATIONS):
        q = torch.linalg.qr(m @ torch.linalg.qr(m.T @ q).Q).Q
    u, s, vh = torch.linalg.svd(q.T @ m, full_matrices=False)
    return (q @ u[:, :r]) * s[:r], vh[:r].T
