"""Quantities with units, as hetcc's hand-written files (clusters, calibrations) write them: "80 GiB",
"25 Gb/s", "2 us", "312 TFLOP/s".

Numbers are taken as SI base units (bytes, bytes/s, seconds, FLOP/s). Strings carry a unit: "80 GB"
(1e9), "80 GiB" (2**30), "300 GB/s", "25 Gb/s" and "25 Gbps" (bits: /8), "2 us", "0.5 ms",
"312 TFLOP/s". B is bytes, b is bits; memory in bits is rejected as a likely typo.
"""

from __future__ import annotations

import math
import re

from hetcc.errors import ClusterError, did_you_mean

_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_BYTES = {p + b: f for p, f in (_SI | _BINARY).items() for b in ("B", "byte", "bytes")}
_BITS = {p + b: f / 8 for p, f in (_SI | _BINARY).items() for b in ("b", "bit", "bits")}
_UNITS: dict[str, dict[str, float]] = {
    "bytes": _BYTES,
    "bytes/s": {u + per: f for u, f in (_BYTES | _BITS).items() for per in ("/s", "ps", "/sec")},
    # Divisors, not factors: 2 / 1e6 is exactly the float 2e-6, while 2 * 1e-6 is not.
    "seconds": {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "μs": 1e6, "ns": 1e9},
    # FLOP/s units are matched lower-cased: "TFLOPS", "TFLOP/s" and "tflops" all read as 1e12.
    "flop/s": {p.lower() + f: m for p, m in (_SI | {"E": 1e18}).items() for f in ("flop/s", "flops")},
}
_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s\d].*?)?\s*$")


def parse_quantity(value: object, unit: str) -> float:
    """Read a number (SI base unit) or a string such as "80 GiB", "25 Gb/s", "2 us", "312 TFLOP/s".

    ``unit`` is "bytes", "bytes/s", "seconds" or "flop/s". Sizes and rates must be positive;
    durations may be zero. Raises ClusterError saying what is wrong and how to write it.
    """
    table = _UNITS[unit]
    examples = {"bytes": "80 GB, 80 GiB", "bytes/s": "300 GB/s, 25 Gb/s", "seconds": "2 us, 0.5 ms"}
    how = f"write a number in {unit} or e.g. {examples.get(unit, '312 TFLOP/s')}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ClusterError(f"expected a quantity in {unit}, got {value!r}", hint=how)
    try:
        number, suffix = (float(value), None) if not isinstance(value, str) else _split(value, how)
    except OverflowError:  # an int beyond float (10**400)
        raise ClusterError(
            f"a number of {int(value).bit_length()} bits is too large for a quantity in {unit}", hint=how
        ) from None
    if suffix:
        key = suffix.lower() if unit == "flop/s" else suffix
        if unit == "bytes" and key in _BITS:
            raise ClusterError(
                f"{value!r} is in bits; memory is given in bytes", hint=f"write {number:g} {key[:-1]}B"
            )
        if key not in table:
            raise ClusterError(f"unknown unit {suffix!r} in {value!r}{did_you_mean(key, table)}", hint=how)
        number = number / table[key] if unit == "seconds" else number * table[key]
    if not math.isfinite(number) or number < 0 or (number == 0 and unit != "seconds"):
        bound = "finite and >= 0" if unit == "seconds" else "finite and positive"
        raise ClusterError(f"{value!r} is not a quantity in {unit} that is {bound}")
    return number


def _split(text: str, how: str) -> tuple[float, str | None]:
    match = _QUANTITY.match(text)
    if not match:
        raise ClusterError(f"cannot read {text!r} as a quantity", hint=how)
    return float(match.group(1)), match.group(2)
