"""rates: the FLOP/s one kernel reaches on a device type, as ``passes.cost`` prices it.

The constant rate is peak × matmul_efficiency of the format the type runs the dtype in
(``DTYPE_FALLBACK``). A calibrated type may carry rates measured by size (``DeviceType.rate_curves``):
a kernel of a class with curves (``CURVES``: GEMMs, unaligned GEMMs, attention) runs instead at the share
of peak its curve gives for its forward's FLOPs per call, so a small GEMM is priced at the low share a
small GEMM reaches. A half-precision GEMM off tensor-core alignment runs at
``UNALIGNED_TENSOR_CORE_SHARE`` of the aligned rate, unless the unaligned curve was measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetcc.errors import ClusterError
from hetcc.hardware.presets import DeviceType

# When a device type has no peak for a dtype, the nearest format its matrix units run instead.
# bf16 has no fallback but fp32: a card without bf16 units (T4, V100) runs bf16 matmuls no faster.
DTYPE_FALLBACK = {"bf16": "fp32", "fp16": "fp32", "fp8": "fp16", "tf32": "fp32"}
# Share of the aligned bf16/fp16 GEMM rate left when a row is not 16 bytes aligned. Measured on an
# H200: GPT-2's head (N = 50257) ran its three GEMMs at 95-146 TFLOP/s against 658 aligned.
UNALIGNED_TENSOR_CORE_SHARE = 0.2
# The curves that price a class's forward and its backward, the first one measured winning; with none,
# the constant rate. A half-precision GEMM off alignment priced by the aligned curve or the constant
# rate runs at UNALIGNED_TENSOR_CORE_SHARE of it.
CURVES = {
    "gemm": (("gemm",), ("gemm",)),
    "gemm_unaligned": (("gemm_unaligned", "gemm"), ("gemm_unaligned", "gemm")),
    "sdpa": (("sdpa",), ("sdpa_backward", "sdpa")),
}
CURVE_NOTE = "rate by size measured on"  # a node's note: "rate by size measured on <type>: gemm 31% of peak"


@dataclass(frozen=True)
class Speed:
    """FLOP/s of one node's forward and backward kernels on one device type, with the measured curve
    (and its share of peak) that set each, where one did."""

    fwd_flops_per_s: float
    bwd_flops_per_s: float
    fwd_curve: tuple[str, float] | None = None  # (curve, share of peak)
    bwd_curve: tuple[str, float] | None = None

    def note(self, type_name: str) -> str | None:
        """``rate by size measured on cpu: gemm 31% of peak`` (backward too where it differs), or None."""
        parts = [
            f"{c} {share:.0%}" for c, share in dict.fromkeys(filter(None, (self.fwd_curve, self.bwd_curve)))
        ]
        return f"{CURVE_NOTE} {type_name}: {', '.join(parts)} of peak" if parts else None


class Rates:
    """Achievable rates of one device type, with dtype fallback resolved once per dtype."""

    def __init__(self, device_type: DeviceType):
        self.type = device_type
        self._keys: dict[str, str] = {}

    def flops_per_s(self, key: str) -> float:
        """The constant rate: peak x matmul_efficiency of the format the type runs ``key`` in."""
        return self.type.achievable_flops(self._peak_key(key))

    def _peak_key(self, key: str) -> str:
        if key not in self._keys:
            self._keys[key] = self._resolve(key)
        return self._keys[key]

    def _resolve(self, key: str) -> str:
        probe = key
        while probe is not None:
            if probe in self.type.peak_flops:
                return probe
            probe = DTYPE_FALLBACK.get(probe)
        raise ClusterError(
            f"device type {self.type.name} has no FLOP/s figure for {key} or a fallback format",
            hint="add peak_flops for it in the cluster file (custom_types) or compile with another dtype",
        )

    def speed(self, key: str, kernel: str | None, call_flops: float, slow: bool) -> Speed:
        """FLOP/s of a node's kernels: of the ``kernel`` class's measured curves (``CURVES``) at
        ``call_flops`` (its forward's FLOPs per call), else the constant rate; ``slow`` (a half-precision
        GEMM off alignment) takes UNALIGNED_TENSOR_CORE_SHARE of any but the unaligned curve."""
        forward, backward = CURVES.get(kernel, ((), ()))
        fwd_flops_per_s, fwd_curve = self._curve_rate(key, forward, call_flops, slow)
        bwd_flops_per_s, bwd_curve = self._curve_rate(key, backward, call_flops, slow)
        return Speed(fwd_flops_per_s, bwd_flops_per_s, fwd_curve, bwd_curve)

    def _curve_rate(
        self, key: str, curves: Sequence[str], call_flops: float, slow: bool
    ) -> tuple[float, tuple[str, float] | None]:
        """(FLOP/s, (curve, share of peak) or None: the constant rate) of one kernel."""
        peak_key = self._peak_key(key)
        for name in curves:
            curve = self.type.rate_curve(name, peak_key)
            if curve is not None:
                share = curve.share(call_flops) * (
                    UNALIGNED_TENSOR_CORE_SHARE if slow and name == "gemm" else 1.0
                )
                return self.type.peak_flops[peak_key] * share, (name, share)
        return self.flops_per_s(key) * (UNALIGNED_TENSOR_CORE_SHARE if slow else 1.0), None

    def time_s(self, flops: float, nbytes: float, key: str, flops_per_s: float | None = None) -> float:
        """Roofline seconds of one kernel at ``flops_per_s`` (default: the constant rate of ``key``)."""
        if not flops and not nbytes:
            return 0.0
        compute_s = flops / (flops_per_s or self.flops_per_s(key)) if flops else 0.0
        memory_s = nbytes / self.type.achievable_bandwidth_bps
        return max(compute_s, memory_s) + self.type.kernel_overhead_s
