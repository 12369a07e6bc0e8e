"""Calibration records: what ``hetcc.calibrate`` measured on one device type, and how it replaces
the datasheet efficiency profile of that type in a cluster.

A calibration file (YAML or JSON, one per device type and machine) looks like::

    version: 2
    device_type: A100-80GB              # the type the figures are for, matched ignoring case/punctuation
    device_name: NVIDIA A100-SXM4-80GB  # provenance, optional: what the hardware calls itself, host,
    host: node0                         # torch version, threads used, and when it was measured
    torch_version: 2.13.0
    threads: 32
    date: '2026-11-30T03:40:12Z'
    matmul_flops: {fp32: 1.8e13, bf16: 2.6e14}   # FLOP/s per dtype (numbers, or "260 TFLOP/s")
    memory_bandwidth_bps: 1.7e12                 # bytes/s (or "1.7 TB/s")
    kernel_overhead_s: 4.1e-06                   # seconds (or "4.1 us")
    host_op_s: 1.4e-05                           # optional (GPUs): host seconds per graph op,
    host_backward_op_s: 6.4e-05                  # and per op's backward (see passes.cost);
    host_fused_op_s: 6.0e-05                     # the same per fused-group call
    host_fused_backward_op_s: 1.2e-04
    flops_by_size:                               # optional (version 2): FLOP/s one call reaches by its
      gemm: {bf16: [[1.0e+06, 4.1e+11], [1.1e+12, 2.6e+14]]}   # size, [FLOPs per call, FLOP/s] pairs
      gemm_unaligned: {bf16: [[1.1e+12, 1.2e+14]]}             # per op class (RATE_CLASSES) and dtype
      sdpa: {bf16: [[1.7e+10, 1.9e+14]]}
      sdpa_backward: {bf16: [[1.7e+10, 1.4e+14]]}

Version 1 files (no ``flops_by_size``) still load, and price as they always did.

``Calibration.load`` checks a file against that format (``_FILE``, a ``hetcc.hardware.schema`` record), so
errors name the file, the field and the closest valid key.

Rule for ``apply`` (the achievable rates become the measured ones):

* GPUs (datasheet peaks): ``matmul_efficiency`` = the best measured share of peak over the measured
  dtypes (at most 1); each measured dtype's peak is set to measured / efficiency, so
  ``achievable_flops(k) == matmul_flops[k]`` for every measured k (for the dtype that sets the
  efficiency, or a single measured dtype, the datasheet peak is kept). Unmeasured dtypes keep their
  datasheet peak at the new efficiency; measured dtypes the type has no peak for are ignored (an
  error when that leaves none).
  ``memory_efficiency`` = measured / peak bandwidth. A figure above its datasheet peak (boost clocks)
  raises the peak to the figure at efficiency 1.
* CPUs (vendor "cpu": the peaks are placeholders): the measured figures become the peaks and
  bandwidth at efficiency 1.0; unmeasured dtypes keep their old achievable rate as their peak.
* Both: ``kernel_overhead_s`` = the measured overhead; the host costs (``host_op_s``,
  ``host_backward_op_s``, ``host_fused_op_s``, ``host_fused_backward_op_s``), where measured, replace
  the type's. Each ``flops_by_size`` curve becomes a ``RateCurve`` of the type (for dtypes it has a peak
  for): each point's share of the calibrated peak, its time taken less the per-kernel overhead (at
  most ``1 - MIN_KERNEL_SHARE`` of it), since the cost model adds that overhead to every kernel: so the
  cost model's time of a measured call is the measured time.

``calibrated_types`` applies calibrations to the device types they name, and ``apply_to_cluster`` to a
cluster's types; a cluster file's ``calibration:`` key does the latter while the file is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import yaml

from hetcc.errors import ClusterError, did_you_mean
from hetcc.hardware.presets import (
    DTYPE_KEYS,
    HOST_FIELDS,
    PRESETS,
    RATE_CLASSES,
    DeviceType,
    PeakTable,
    RateCurve,
    type_key,
)
from hetcc.hardware.schema import (
    Count,
    ListOf,
    Nullable,
    Number,
    Quantity,
    Record,
    Table,
    Text,
    Where,
    load_file,
    short_repr,
)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before flops_by_size
# The least share of a measured call ``apply`` leaves to the kernel after taking off the per-kernel
# overhead (a call no slower than an empty kernel is not priced at zero seconds).
MIN_KERNEL_SHARE = 0.1
Curve = tuple[tuple[float, float], ...]  # (FLOPs per call, FLOP/s) by increasing FLOPs


def _point(value: object, where: Where) -> tuple[float, float]:
    """One measured point of a curve: ``[FLOPs per call, FLOP/s]``."""
    if not isinstance(value, list) or len(value) != 2:
        where.fail(f"expected [FLOPs per call, FLOP/s]; got {short_repr(value)}")
    return float(Number(positive=True)(value[0], where.at(0))), Quantity("flop/s")(value[1], where.at(1))


_CURVES = Table(DTYPE_KEYS, ListOf(_point, nonempty=True), "dtype to [[FLOPs per call, FLOP/s], ...]")
_FILE = Record(
    {
        "version": Count(),
        "device_type": Text(),
        **dict.fromkeys(("device_name", "host", "torch_version", "date"), Text(empty=True)),
        "threads": Nullable(Count()),
        "matmul_flops": Table(
            DTYPE_KEYS, Quantity("flop/s"), "dtype to FLOP/s, e.g. {fp32: 1.2e11}", nonempty=True
        ),
        "memory_bandwidth_bps": Quantity("bytes/s"),
        "kernel_overhead_s": Quantity("seconds"),
        **dict.fromkeys(HOST_FIELDS, Nullable(Quantity("seconds"))),
        "flops_by_size": Table(
            RATE_CLASSES, _CURVES, "op class to curves per dtype, e.g. {gemm: {fp32: ...}}"
        ),
    },
    required=("device_type", "matmul_flops", "memory_bandwidth_bps", "kernel_overhead_s"),
    missing_hint="write calibration files with `hetcc calibrate`",
)


@dataclass(frozen=True)
class Calibration:
    """Speeds measured on one device of type ``device_type``, with where and when they were taken."""

    device_type: str  # the device type the figures are for ("cpu", "A100-80GB", a custom type's name)
    matmul_flops: Mapping[str, float]  # best sustained FLOP/s of a large square matmul, per dtype key
    memory_bandwidth_bps: float  # bytes read + written per second by a streaming pointwise op
    kernel_overhead_s: float  # seconds per op that does no work (dispatch + launch)
    host_op_s: float | None = None  # host seconds to issue one graph op (GPUs; None: not measured)
    host_backward_op_s: float | None = None  # ... and to run autograd's backward of one
    host_fused_op_s: float | None = None  # the same for one fused-group call
    host_fused_backward_op_s: float | None = None
    # per op class (RATE_CLASSES) and dtype key: FLOP/s one call reaches by its FLOPs (gross of overhead)
    flops_by_size: Mapping[str, Mapping[str, Curve]] = dataclasses.field(default_factory=dict, hash=False)
    device_name: str = ""  # what the hardware calls itself ("NVIDIA A100-SXM4-80GB", a CPU model)
    host: str = ""
    torch_version: str = ""
    threads: int | None = None  # torch.get_num_threads() while measuring (matters on CPUs)
    date: str = ""  # ISO 8601, UTC

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "matmul_flops", PeakTable(self.matmul_flops))
        except ValueError as error:
            raise ClusterError(f"calibration of {self.device_type!r}: matmul_flops: {error}") from None
        try:  # points as (FLOPs, FLOP/s) float pairs by increasing FLOPs
            curves = {c: {k: tuple(sorted((float(f), float(r)) for f, r in points)) for k, points in by.items()}
                      for c, by in self.flops_by_size.items()}  # fmt: skip
        except (AttributeError, TypeError, ValueError):
            raise ClusterError(
                f"calibration of {self.device_type!r}: flops_by_size: expected op class -> dtype -> "
                f"[(FLOPs per call, FLOP/s), ...]; got {short_repr(self.flops_by_size)}"
            ) from None
        object.__setattr__(self, "flops_by_size", curves)
        for name, reason in self._problems():
            raise ClusterError(f"calibration of {self.device_type!r}: {name}: {reason}")

    def _problems(self) -> Iterator[tuple[str, str]]:
        if not isinstance(self.device_type, str) or not self.device_type.strip():
            yield "device_type", f"expected a non-empty string; got {self.device_type!r}"
        if not self.matmul_flops:
            yield "matmul_flops", "no dtype measured; give at least one, e.g. {fp32: 1.2e11}"
        for key, flops in self.matmul_flops.items():
            if key not in DTYPE_KEYS:
                yield (
                    f"matmul_flops.{key}",
                    f"not a dtype key ({', '.join(DTYPE_KEYS)}){did_you_mean(key, DTYPE_KEYS)}",
                )
            elif not 0 < flops < math.inf:
                yield f"matmul_flops.{key}", f"must be a positive number of FLOP/s; got {flops!r}"
        if not (_is_number(self.memory_bandwidth_bps) and 0 < self.memory_bandwidth_bps < math.inf):
            yield (
                "memory_bandwidth_bps",
                f"must be a positive number of bytes/s; got {self.memory_bandwidth_bps!r}",
            )
        if not (_is_number(self.kernel_overhead_s) and 0 <= self.kernel_overhead_s < math.inf):
            yield "kernel_overhead_s", f"must be a number of seconds >= 0; got {self.kernel_overhead_s!r}"
        for field in HOST_FIELDS:
            value = getattr(self, field)
            if value is not None and not (_is_number(value) and 0 <= value < math.inf):
                yield field, f"must be a number of seconds >= 0; got {value!r}"
        yield from _curve_problems(self.flops_by_size)
        if self.threads is not None and not (
            _is_number(self.threads) and isinstance(self.threads, int) and self.threads >= 1
        ):
            yield "threads", f"expected a positive integer; got {self.threads!r}"

    # ---- files -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The file's contents: plain JSON/YAML-ready values in SI units."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        curves = {
            c: {k: [list(p) for p in points] for k, points in by.items()}
            for c, by in self.flops_by_size.items()
        }
        return (
            {"version": FORMAT_VERSION}
            | data
            | {"matmul_flops": dict(self.matmul_flops), "flops_by_size": curves}
        )

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        """Write a ``.yaml``/``.yml`` or ``.json`` file (by suffix); returns the path written."""
        path = pathlib.Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".yaml", ".yml", ".json"):
            raise ClusterError(f"{path}: a calibration file must end in .yaml, .yml or .json")
        if suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            header = (
                f"# hetcc calibration of {self.device_type}: see hetcc.hardware.calibration for the format\n"
            )
            text = header + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Calibration:
        """Read a file written by ``save`` (or by hand); errors name the file and the field."""
        path = pathlib.Path(path)
        return _read(load_file(path, "calibration file"), Where(str(path)))

    # ---- printing --------------------------------------------------------------------------------
    def describe(self) -> str:
        """A few readable lines: what was measured where, and for GPU presets the share of datasheet."""
        preset = _preset_named(self.device_type)
        head = self.device_name or "unnamed device"
        if self.threads and preset is None:
            head += f", {self.threads} thread{'s' if self.threads > 1 else ''}"
        lines = [f"calibration of {self.device_type} ({head})"]
        where = [
            self.host and f"host {self.host}",
            self.torch_version and f"torch {self.torch_version}",
            self.date,
        ]
        lines += [f"  measured on {', '.join(x for x in where if x)}"] if any(where) else []
        for key, flops in self.matmul_flops.items():
            peak = preset.peak_flops.get(key) if preset else None
            lines.append(
                _row(
                    f"matmul {key}",
                    _rate(flops, "FLOP/s"),
                    peak and flops / peak,
                    peak and _rate(peak, "FLOP/s"),
                )
            )
        peak_bps = preset.memory_bandwidth_bps if preset else None
        bandwidth_bps = self.memory_bandwidth_bps
        lines.append(
            _row(
                "memory bandwidth",
                _rate(bandwidth_bps, "B/s"),
                peak_bps and bandwidth_bps / peak_bps,
                peak_bps and _rate(peak_bps, "B/s"),
            )
        )
        lines.append(_row("kernel overhead", f"{self.kernel_overhead_s * 1e6:.3g} us"))
        for label, forward, backward in (
            ("host per graph op", self.host_op_s, self.host_backward_op_s),
            ("host per fused call", self.host_fused_op_s, self.host_fused_backward_op_s),
        ):
            if forward is not None and backward is not None:
                lines.append(_row(label, f"{forward * 1e6:.3g} us forward, {backward * 1e6:.3g} us backward"))
        for op_class, by_dtype in self.flops_by_size.items():
            for key, points in by_dtype.items():
                at = ", ".join(
                    f"{_rate(rate, '', 3, '')} @ {_rate(flops, '', 3, '')}" for flops, rate in points
                )
                lines.append(f"  {op_class + ' ' + key:<19} {at} (FLOP/s @ FLOPs per call)")
        return "\n".join(lines)


def _row(label: str, value: str, share: float | None = None, peak: str | None = None) -> str:
    """One aligned line of ``describe``, with the share of the datasheet peak where there is one."""
    of_peak = f"  ({share:.0%} of the {peak} datasheet peak)" if share else ""
    return f"  {label:<18}{value:>14}{of_peak}"


def _curve_problems(curves: Mapping[str, Mapping[str, Curve]]) -> Iterator[tuple[str, str]]:
    for op_class, by_dtype in curves.items():
        if op_class not in RATE_CLASSES:
            yield f"flops_by_size.{op_class}", f"not an op class ({', '.join(RATE_CLASSES)})"
        for key, points in by_dtype.items():
            name = f"flops_by_size.{op_class}.{key}"
            if key not in DTYPE_KEYS:
                yield name, f"not a dtype key ({', '.join(DTYPE_KEYS)})"
            elif not points or not all(0 < f < math.inf and 0 < r < math.inf for f, r in points):
                yield (
                    name,
                    f"expected [FLOPs per call, FLOP/s] points, all positive; got {short_repr(points)}",
                )
            elif len({f for f, _ in points}) < len(points):
                yield name, "two points at the same FLOPs per call"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _preset_named(name: str) -> DeviceType | None:
    """The GPU preset called exactly ``name`` (up to case and punctuation), for printing shares."""
    found = [t for t in PRESETS.values() if type_key(t.name) == type_key(name) and t.vendor != "cpu"]
    return found[0] if found else None


def _rate(value: float, unit: str, digits: int = 4, space: str = " ") -> str:
    """``value`` with an SI prefix: "2.039 TB/s"; ``_rate(1.05e6, "", 3, "")`` is "1.05M"."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.{digits}g}{space}{prefix}{unit}"
    return f"{value:.{digits}g}{space}{unit}"


def _read(data: object, where: Where) -> Calibration:
    """The Calibration a parsed file holds, checked against its format (``_FILE``)."""
    fields = _FILE(data, where)
    version = fields.pop("version", FORMAT_VERSION)
    if version not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        where.at("version").fail(f"unsupported version {version!r}; this hetcc reads {readable}")
    with where.blame():
        return Calibration(**fields)


# ---- applying --------------------------------------------------------------------------------------
def apply(device_type: DeviceType, calibration: Calibration) -> DeviceType:
    """``device_type`` with its efficiency profile replaced by ``calibration`` (module docstring: rule).

    The name is kept: a calibrated A100-80GB is still an A100-80GB. The calibration's own
    ``device_type`` is not checked here; ``calibrated_types`` matches by name.
    """
    if device_type.vendor == "cpu":
        peaks = {k: v * device_type.matmul_efficiency for k, v in device_type.peak_flops.items()}
        peaks |= dict(calibration.matmul_flops)
        return device_type.replace(
            peak_flops=peaks, matmul_efficiency=1.0,
            memory_bandwidth_bps=calibration.memory_bandwidth_bps, memory_efficiency=1.0,
            kernel_overhead_s=calibration.kernel_overhead_s, **_host(calibration),
            rate_curves=_rate_curves(calibration, peaks),
        )  # fmt: skip
    peaks, matmul_efficiency = _calibrated_peaks(device_type, calibration)
    bandwidth_bps = max(device_type.memory_bandwidth_bps, calibration.memory_bandwidth_bps)
    return device_type.replace(
        peak_flops=peaks, matmul_efficiency=matmul_efficiency, memory_bandwidth_bps=bandwidth_bps,
        memory_efficiency=calibration.memory_bandwidth_bps / bandwidth_bps,
        kernel_overhead_s=calibration.kernel_overhead_s, **_host(calibration),
        rate_curves=_rate_curves(calibration, peaks),
    )  # fmt: skip


def _host(calibration: Calibration) -> dict[str, float]:
    """The host costs a calibration measured (none: the type keeps its own)."""
    return {f: getattr(calibration, f) for f in HOST_FIELDS if getattr(calibration, f) is not None}


def _rate_curves(calibration: Calibration, peaks: Mapping[str, float]) -> tuple[RateCurve, ...]:
    """The calibration's ``flops_by_size`` as shares of ``peaks`` (the calibrated type's), each call's
    seconds less the per-kernel overhead (module docstring); dtypes without a peak are left out."""
    overhead_s = calibration.kernel_overhead_s
    curves = []
    for op_class, by_dtype in calibration.flops_by_size.items():
        for key, points in by_dtype.items():
            if key not in peaks:
                continue
            kernel_s = [max(f / rate - overhead_s, f / rate * MIN_KERNEL_SHARE) for f, rate in points]
            shares = tuple((f, f / s / peaks[key]) for (f, _), s in zip(points, kernel_s))
            curves.append(RateCurve(op_class, key, shares))
    return tuple(curves)


def _calibrated_peaks(device_type: DeviceType, calibration: Calibration) -> tuple[dict[str, float], float]:
    """GPU rule: (peaks, efficiency) with peak[k] × efficiency == measured[k] for each measured k."""
    measured = {k: v for k, v in calibration.matmul_flops.items() if k in device_type.peak_flops}
    if not measured:
        has, got = ", ".join(device_type.peak_flops), ", ".join(calibration.matmul_flops)
        raise ClusterError(
            f"calibration of {calibration.device_type!r} measured {got} matmuls, but device type "
            f"{device_type.name!r} has peaks only for {has}",
            hint=f"calibrate a dtype the type has a peak for ({has})",
        )
    shares = {k: v / device_type.peak_flops[k] for k, v in measured.items()}
    best = max(shares, key=shares.__getitem__)
    efficiency = min(1.0, shares[best])
    peaks = dict(device_type.peak_flops)
    for key, flops in measured.items():
        if key != best or shares[best] > 1.0:
            peaks[key] = flops / efficiency
    return peaks, efficiency


def calibrated_types(
    types: Sequence[DeviceType], calibrations: Iterable[Calibration]
) -> dict[str, DeviceType]:
    """``{name: calibrated type}`` for each of ``types`` a calibration names (``apply``).

    Names match ignoring case and punctuation ("a100_80gb" calibrates "A100-80GB"). Two calibrations
    of one type, or one naming none of ``types``, are errors: either is a mix-up of files, and
    silently ignoring it would price with guesses.
    """
    by_key = {type_key(t.name): t for t in types}
    chosen: dict[str, Calibration] = {}
    for calibration in calibrations:
        key = type_key(calibration.device_type)
        if key not in by_key:
            names = [t.name for t in types]
            raise ClusterError(
                f"calibration of {calibration.device_type!r} (host {calibration.host or '?'}) matches no "
                f"device type of the cluster{did_you_mean(calibration.device_type, names)}",
                hint=f"the cluster's types: {', '.join(names)}",
            )
        if key in chosen:
            raise ClusterError(
                f"two calibrations of device type {by_key[key].name!r}",
                hint="keep one calibration per device type",
            )
        chosen[key] = calibration
    return {by_key[k].name: apply(by_key[k], c) for k, c in chosen.items()}


class _HasTypes(Protocol):
    """What calibrating needs of a cluster (a ``Cluster`` or its ``ClusterParts``): a protocol, so that
    this module need not import them (the cluster file reader imports this module)."""

    @property
    def types(self) -> tuple[DeviceType, ...]: ...

    def replace_types(self: _T, types: Mapping[str, DeviceType]) -> _T: ...


_T = TypeVar("_T", bound=_HasTypes)


def apply_to_cluster(cluster: _T, calibrations: Iterable[Calibration]) -> _T:
    """A copy of ``cluster`` whose device types named by a calibration are calibrated (``calibrated_types``);
    types without a calibration are unchanged."""
    return cluster.replace_types(calibrated_types(cluster.types, calibrations))
