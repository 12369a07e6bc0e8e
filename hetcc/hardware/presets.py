"""Device types: what one kind of accelerator can do, and presets with datasheet figures.

A ``DeviceType`` holds dense peak FLOP/s per dtype, memory capacity and bandwidth, and an efficiency
profile (the share of peak a large GEMM or a streaming kernel reaches, and a per-kernel overhead).
The cost model turns these into time; ``hetcc calibrate`` measures the rates a device reaches, which
replace the profile (``hetcc.hardware.calibration.apply``), and may add ``rate_curves``: the share of
peak a GEMM or an attention kernel reaches by its size (``RateCurve``), which presets do not have.

Peaks are dense (no 2:4 sparsity) and taken from vendor datasheets. Memory capacities are binary
(an "80 GB" A100 has 80 GiB of HBM); bandwidths are decimal (bytes/s), as the datasheets state them.
Everything here imports without torch: a torch dtype is accepted through its ``str()`` name.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.schema import finite, short_repr

DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
VENDORS = ("nvidia", "amd", "cpu")

# torch dtype names (``str(torch.bfloat16)`` minus "torch.") and short names -> peak key.
# float32 means fp32 (CUDA cores): torch does not use TF32 for matmuls unless asked, so "tf32" is
# only ever chosen explicitly.
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
}  # fmt: skip


def flops_key(dtype: object) -> str:
    """Map a torch dtype, its name, or a short name ("bf16") to a key of ``DeviceType.peak_flops``."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[name]
    except KeyError:
        raise ClusterError(
            f"no FLOP/s figure exists for dtype {dtype!r}",
            hint=f"device types give peaks for {', '.join(DTYPE_KEYS)} (or torch dtypes that map to them)",
        ) from None


class PeakTable(Mapping[str, float]):
    """An immutable, hashable, picklable ``{dtype key: FLOP/s}`` mapping (so DeviceType can be hashed)."""

    __slots__ = ("_items",)

    def __init__(self, peaks: Mapping[str, float]):
        """``ValueError`` naming what is wrong when ``peaks`` is not a mapping of names to numbers (the
        records that hold one turn it into their own error, naming the field)."""
        # a float as it is (its value is checked where it is used); an int only if a float can hold it
        if not isinstance(peaks, Mapping) or not all(
            isinstance(v, float) or finite(v) for v in peaks.values()
        ):
            raise ValueError(f"expected a mapping of dtype key to FLOP/s; got {short_repr(peaks)}")
        order = {key: i for i, key in enumerate(DTYPE_KEYS)}
        items = ((str(k), float(v)) for k, v in peaks.items())
        self._items = tuple(sorted(items, key=lambda kv: (order.get(kv[0], len(order)), kv[0])))

    def __getitem__(self, key: str) -> float:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __reduce__(self) -> tuple[Any, ...]:
        return PeakTable, (dict(self._items),)

    def __repr__(self) -> str:
        return repr(dict(self._items))


HOST_FIELDS = ("host_op_s", "host_backward_op_s", "host_fused_op_s", "host_fused_backward_op_s")
# Kernel classes whose rate ``hetcc calibrate`` measures by size: GEMMs with every dimension a multiple of
# 8 and with one that is not, and scaled_dot_product_attention's forward and backward.
RATE_CLASSES = ("gemm", "gemm_unaligned", "sdpa", "sdpa_backward")


@dataclass(frozen=True)
class RateCurve:
    """The share of its dtype's peak FLOP/s one kernel of a class reaches, against the FLOPs of one call
    (a backward's at the FLOPs of the forward call it differentiates), as measured: small kernels reach
    far less than large ones. Between points the share is interpolated in log FLOPs; beyond the ends it
    is the end's. A share may exceed 1 where the peak is itself a measured mix (a calibrated CPU).
    """

    op_class: str  # one of RATE_CLASSES
    dtype: str  # a key of DTYPE_KEYS
    points: tuple[tuple[float, float], ...]  # (FLOPs per call, share of peak), by increasing FLOPs

    def __post_init__(self) -> None:
        points = tuple(sorted((float(f), float(s)) for f, s in self.points))
        object.__setattr__(self, "points", points)
        where = f"rate curve {self.op_class} {self.dtype}"
        if self.op_class not in RATE_CLASSES:
            raise ClusterError(f"{where}: op class is not one of {', '.join(RATE_CLASSES)}")
        if self.dtype not in DTYPE_KEYS:
            raise ClusterError(f"{where}: dtype is not one of {', '.join(DTYPE_KEYS)}")
        if not points or not all(0 < f < math.inf and 0 < s < math.inf for f, s in points):
            raise ClusterError(
                f"{where}: expected (FLOPs per call, share) points, all positive; got {points}"
            )
        if len({f for f, _ in points}) < len(points):
            raise ClusterError(f"{where}: two points at the same FLOPs per call")

    def share(self, flops: float) -> float:
        """The share of peak at ``flops`` per call: log-linear between points, the end's beyond them."""
        sizes = [f for f, _ in self.points]
        i = bisect.bisect_left(sizes, flops)
        if i == 0 or i == len(sizes):
            return self.points[min(i, len(sizes) - 1)][1]
        (f0, s0), (f1, s1) = self.points[i - 1], self.points[i]
        return s0 + (s1 - s0) * math.log(flops / f0) / math.log(f1 / f0)

    def to_dict(self) -> dict[str, Any]:
        return {"op_class": self.op_class, "dtype": self.dtype, "points": [list(p) for p in self.points]}


@dataclass(frozen=True)
class DeviceType:
    """One kind of device: dense peaks per dtype, memory, bandwidth and an efficiency profile."""

    name: str
    vendor: str  # "nvidia" | "amd" | "cpu"
    peak_flops: Mapping[str, float]  # dense FLOP/s per key of DTYPE_KEYS, only where the hardware has it
    memory_bytes: int
    memory_bandwidth_bps: float  # bytes/s
    matmul_efficiency: float = 0.7  # share of peak FLOP/s a large GEMM reaches
    memory_efficiency: float = 0.85  # share of peak bandwidth a streaming kernel reaches
    kernel_overhead_s: float = 5e-6  # launch + dispatch cost per kernel
    # Host seconds to issue one graph op (Python, dispatcher, launch) and to run autograd's backward
    # of it; a GPU runs ahead of the host only as far as the host has issued (``passes.cost``).
    # ``hetcc.calibrate`` measures both on a chain of linear / layer norm / tanh / add; an H200's host
    # gave 14.2 us and 63.8 us, the defaults.
    host_op_s: float = 14e-6
    host_backward_op_s: float = 64e-6
    # The same for one fused group's call (``hetcc.kernels.launch.fused``: its cached launch, autograd
    # function and Triton's launcher), measured by ``hetcc.calibrate`` too. Estimated, not yet measured
    # on a GPU: the launcher's own Python takes 15 us forward / 39 us backward on the CPU where the
    # previous call path (a torch.library custom op, 72 / 193 us there) took 191 / 694 us on the H200's
    # host, 2.6x as long; times 2.6, plus ~20 us for each Triton launch.
    host_fused_op_s: float = 60e-6
    host_fused_backward_op_s: float = 120e-6
    # Measured shares of peak by kernel size (``hetcc calibrate``), at most one per class and dtype;
    # without one, a kernel runs at peak x matmul_efficiency whatever its size.
    rate_curves: tuple[RateCurve, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "peak_flops", PeakTable(self.peak_flops))
        except ValueError as error:
            raise ClusterError(f"device type {self.name!r}: peak_flops: {error}") from None
        try:  # to_dict writes curves as dicts
            curves = tuple(c if isinstance(c, RateCurve) else RateCurve(**c) for c in self.rate_curves)
        except (ClusterError, TypeError, ValueError) as error:
            raise ClusterError(f"device type {self.name!r}: rate_curves: {error}") from None
        object.__setattr__(self, "rate_curves", curves)
        for reason in self._problems():
            raise ClusterError(f"device type {self.name!r}: {reason}")

    def _problems(self) -> Iterator[str]:
        if not isinstance(self.name, str) or not self.name:
            yield "name must be a non-empty string"
        if self.vendor not in VENDORS:
            yield f"vendor {self.vendor!r} is not one of {', '.join(VENDORS)}"
        for key, flops in self.peak_flops.items():
            if key not in DTYPE_KEYS:
                yield f"peak_flops key {key!r} is not one of {', '.join(DTYPE_KEYS)}{did_you_mean(key, DTYPE_KEYS)}"
            elif not (0 < flops < math.inf):
                yield f"peak_flops[{key}] must be a positive number, got {flops}"
        if not self.peak_flops:
            yield "peak_flops is empty; give at least one dtype's FLOP/s"
        if (
            isinstance(self.memory_bytes, bool)
            or not isinstance(self.memory_bytes, int)
            or self.memory_bytes <= 0
        ):
            yield f"memory_bytes must be a positive integer, got {self.memory_bytes!r}"
        if not (0 < self.memory_bandwidth_bps < math.inf):
            yield f"memory_bandwidth_bps must be positive, got {self.memory_bandwidth_bps!r}"
        for field in ("matmul_efficiency", "memory_efficiency"):
            if not (0 < getattr(self, field) <= 1):
                yield f"{field} must be in (0, 1], got {getattr(self, field)!r}"
        for field in ("kernel_overhead_s", *HOST_FIELDS):
            if not (0 <= getattr(self, field) < math.inf):
                yield f"{field} must be >= 0, got {getattr(self, field)!r}"
        classes = [(c.op_class, c.dtype) for c in self.rate_curves]
        if len(set(classes)) < len(classes):
            yield "rate_curves has two curves for one op class and dtype"

    def peak(self, dtype: object) -> float:
        """Dense peak FLOP/s for ``dtype`` (torch dtype, "bfloat16", "bf16", "tf32", ...)."""
        key = flops_key(dtype)
        if key not in self.peak_flops:
            raise ClusterError(
                f"device type {self.name!r} has no {key} peak (it has {', '.join(self.peak_flops)})",
                hint=f"run the model in a dtype {self.name} supports, or add peak_flops.{key} to its type",
            )
        return self.peak_flops[key]

    def achievable_flops(self, dtype: object) -> float:
        """FLOP/s a large GEMM reaches: peak × matmul_efficiency."""
        return self.peak(dtype) * self.matmul_efficiency

    def rate_curve(self, op_class: str, key: str) -> RateCurve | None:
        """The measured curve of ``op_class`` kernels in dtype ``key``, or None (not measured)."""
        return next((c for c in self.rate_curves if (c.op_class, c.dtype) == (op_class, key)), None)

    @property
    def achievable_bandwidth_bps(self) -> float:
        """Bytes/s a streaming kernel reaches: peak bandwidth × memory_efficiency."""
        return self.memory_bandwidth_bps * self.memory_efficiency

    def replace(self, **changes: Any) -> DeviceType:
        """A copy with some fields changed (validated like a new type)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, SI units (bytes, bytes/s, FLOP/s, seconds)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return data | {
            "peak_flops": dict(self.peak_flops),
            "rate_curves": [c.to_dict() for c in self.rate_curves],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceType:
        """Inverse of ``to_dict``; unknown keys are an error naming the closest field."""
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in fields:
                raise ClusterError(f"device type dict has unknown key {key!r}{did_you_mean(key, fields)}")
        missing = [
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in data
        ]
        if missing:
            raise ClusterError(f"device type dict {data.get('name', '?')!r} lacks {', '.join(missing)}")
        return cls(**data)


# ---- presets ---------------------------------------------------------------------------------
_TFLOPS = 1e12
_GiB = 2**30
_GBPS = 1e9  # GB/s, decimal as in datasheets
# Efficiency profile per vendor until calibration replaces it; presets adjust it per part.
VENDOR_EFFICIENCY: Mapping[str, Mapping[str, float]] = {
    "nvidia": {"matmul_efficiency": 0.7, "memory_efficiency": 0.85, "kernel_overhead_s": 5e-6},
    "amd": {"matmul_efficiency": 0.6, "memory_efficiency": 0.8, "kernel_overhead_s": 8e-6},
    "cpu": {"matmul_efficiency": 0.8, "memory_efficiency": 0.8, "kernel_overhead_s": 10e-6},
}


def _gpu(
    vendor: str, name: str, peaks: dict[str, float], memory_gib: float, bandwidth_gbps: float, **eff: float
) -> DeviceType:
    """A preset from datasheet units: TFLOP/s, GiB, GB/s; efficiencies default per vendor."""
    peak_flops = {k: v * _TFLOPS for k, v in peaks.items()}
    memory_bytes, bandwidth_bps = int(memory_gib * _GiB), bandwidth_gbps * _GBPS
    return DeviceType(
        name, vendor, peak_flops, memory_bytes, bandwidth_bps, **(VENDOR_EFFICIENCY[vendor] | eff)
    )


def _nvidia(*args: Any, **eff: float) -> DeviceType:
    return _gpu("nvidia", *args, **eff)


def _amd(*args: Any, **eff: float) -> DeviceType:
    return _gpu("amd", *args, **eff)


def _host_memory_bytes() -> int:
    """Physical RAM of this host, or 16 GiB where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * _GiB


# On AMD, fp32 is the matrix-core (MFMA) figure: rocBLAS runs fp32 GEMMs there. On NVIDIA, fp32 is
# the CUDA-core figure and tf32 the tensor-core one. GeForce fp16/bf16 are with fp32 accumulate.
_PRESET_LIST = [
    # NVIDIA V100 SXM2 datasheet (no bf16, no tf32 on Volta)
    _nvidia("V100-32GB", {"fp32": 15.7, "fp16": 125}, 32, 900),
    # NVIDIA A100 datasheet, SXM 40GB
    _nvidia("A100-40GB", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, 40, 1555, matmul_efficiency=0.75),
    # NVIDIA A100 datasheet, SXM 80GB
    _nvidia("A100-80GB", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, 80, 2039, matmul_efficiency=0.75),
    # NVIDIA H100 datasheet, SXM5 (sparse figures halved)
    _nvidia("H100-SXM", {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, 80, 3350),
    # NVIDIA H200 datasheet, SXM (H100 compute, 141 GB HBM3e)
    _nvidia("H200", {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, 141, 4800),
    # NVIDIA L4 datasheet (sparse figures halved); 72 W part, clocks drop under load
    _nvidia("L4", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5}, 24, 300, matmul_efficiency=0.6),
    # NVIDIA T4 datasheet (fp16 mixed precision; no bf16/tf32 on Turing); 70 W part
    _nvidia("T4", {"fp32": 8.1, "fp16": 65}, 16, 320, matmul_efficiency=0.6, memory_efficiency=0.8),
    # NVIDIA Ampere GA102 whitepaper, GeForce RTX 3090
    _nvidia("RTX-3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71}, 24, 936),
    # NVIDIA Ada AD102 whitepaper, GeForce RTX 4090
    _nvidia("RTX-4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3}, 24, 1008),
    # AMD Instinct MI210 datasheet
    _amd("MI210", {"fp32": 45.3, "bf16": 181, "fp16": 181}, 64, 1638.4),
    # AMD Instinct MI250X datasheet: the whole package (two GCDs)
    _amd("MI250X", {"fp32": 95.7, "bf16": 383, "fp16": 383}, 128, 3276.8),
    # One MI250X GCD, which is what ROCm/torch exposes as one device: half the package
    _amd("MI250X-GCD", {"fp32": 47.85, "bf16": 191.5, "fp16": 191.5}, 64, 1638.4),
    # AMD Instinct MI300X datasheet (sparse figures halved)
    _amd("MI300X", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}, 192, 5300),
    # Placeholder for the host CPU, replaced by `hetcc calibrate` measurements: modest guesses,
    # memory = this host's RAM.
    DeviceType(
        "cpu", "cpu", {"fp32": 100e9, "bf16": 50e9, "fp16": 50e9}, _host_memory_bytes(), 20e9,
        **VENDOR_EFFICIENCY["cpu"],
    ),
]  # fmt: skip
PRESETS: Mapping[str, DeviceType] = {t.name: t for t in _PRESET_LIST}


def type_key(name: str) -> str:
    """The case- and punctuation-insensitive key type names are looked up by ("A100_80GB" -> "a10080gb")."""
    return "".join(ch for ch in str(name).lower() if ch.isalnum())


_ALIASES = {type_key(n): n for n in PRESETS} | {
    "h100": "H100-SXM", "h100sxm5": "H100-SXM", "h200sxm": "H200", "v100": "V100-32GB",
    "v100sxm2": "V100-32GB", "a10080gbsxm": "A100-80GB", "a10040gbsxm": "A100-40GB",
    "geforcertx3090": "RTX-3090", "geforcertx4090": "RTX-4090",
}  # fmt: skip


def get_preset(name: str) -> DeviceType:
    """The preset called ``name``, ignoring case, dashes, underscores and spaces ("a100_80gb", "h100")."""
    canonical = _ALIASES.get(type_key(name))
    if canonical is not None:
        return PRESETS[canonical]
    match = difflib.get_close_matches(type_key(name), list(_ALIASES), n=1, cutoff=0.5)
    closest = f"; closest preset is {_ALIASES[match[0]]!r}" if match else ""
    raise ClusterError(
        f"unknown device type {name!r}{closest}",
        hint=f"presets: {', '.join(PRESETS)}; or define it under custom_types",
    )
