"""Fused pointwise kernels vs eager vs torch.compile on one GPU.

For chains of 2-6 pointwise ops (a bias add and a broadcast included) at 1M-64M elements, fp32 and bf16,
prints the time of each (triton.testing.do_bench, median ms) and the achieved bandwidth of one memory
pass (inputs read once + outputs written once) as a share of the device's peak. Eager runs one kernel
per op, so its share is low by design; the fused kernel should approach torch.compile's.

The last column, "fused GPU", times the fused module replayed as a CUDA graph
(triton.testing.do_bench_cudagraph): the kernel alone, without hetcc's Python per call (custom op,
dispatch, allocation, Triton's launcher). Where "fused" is much slower than "fused GPU", the CPU side
limits the fused path, not the generated kernel.

    python benchmarks/kernels_gpu.py                       # every chain, size and dtype
    python benchmarks/kernels_gpu.py --sizes 16M --dtypes bf16 --peak-gbps 4800
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (name, op) applied in order; a chain of length n is the first n steps.
STEPS: list[tuple[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]] = [
    ("mul", lambda v, x, b: v * 1.5),
    ("add_bias", lambda v, x, b: v + b),
    ("gelu_tanh", lambda v, x, b: F.gelu(v, approximate="tanh")),
    ("mul_x", lambda v, x, b: v * x),
    ("sigmoid", lambda v, x, b: torch.sigmoid(v)),
    ("sub_x", lambda v, x, b: v - x),
]
SIZES = {"1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24, "64M": 1 << 26}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROW = 4096  # elements per row; the bias broadcasts over rows

# torch.cuda.get_device_name substrings -> hetcc preset, most specific first.
DEVICE_PRESETS = [
    ("H200", "H200"),
    ("H100", "H100-SXM"),
    ("A100-SXM4-80GB", "A100-80GB"),
    ("A100 80GB", "A100-80GB"),
    ("A100", "A100-40GB"),
    ("V100", "V100-32GB"),
    ("RTX 4090", "RTX-4090"),
    ("RTX 3090", "RTX-3090"),
    ("L4", "L4"),
    ("T4", "T4"),
    ("MI300X", "MI300X"),
    ("MI250X", "MI250X-GCD"),  # torch sees one GCD
    ("MI210", "MI210"),
]


class Chain(torch.nn.Module):
    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        value = x
        for _, step in STEPS[: self.length]:
            value = step(value, x, bias)
        return value


def peak_gbps(device_name: str, override: float | None) -> float | None:
    """Peak memory bandwidth in GB/s: the flag, else hetcc's preset for this device name."""
    if override is not None:
        return override
    from hetcc.hardware.presets import get_preset

    for needle, preset in DEVICE_PRESETS:
        if needle.lower() in device_name.lower():
            return get_preset(preset).memory_bandwidth_bps / 1e9
    return None


def fused_module(chain: Chain, args: tuple[torch.Tensor, ...]):
    """The chain exported and fused; returns (module, its one FusionGroup)."""
    from hetcc.passes.fuse import FUSION_META_KEY, fuse

    gm = fuse(torch.export.export(copy.deepcopy(chain), args, strict=False).module())
    groups = [n.meta[FUSION_META_KEY] for n in gm.graph.nodes if FUSION_META_KEY in n.meta]
    if len(groups) != 1:
        raise SystemExit(f"expected one fusion group for {chain.length} ops, got {len(groups)}:\n{gm.code}")
    return gm, groups[0]


def measure(
    chain: Chain, numel: int, dtype: torch.dtype, bench: Callable, graph_bench: Callable
) -> dict[str, float]:
    """Median milliseconds of fused, eager and torch.compile on the same inputs, and of the fused module
    replayed as a CUDA graph (nan where capture fails); bytes of one pass."""
    x = torch.randn(numel // ROW, ROW, device="cuda", dtype=dtype)
    bias = torch.randn(ROW, device="cuda", dtype=dtype)
    args = (x, bias)
    gm, group = fused_module(chain, args)
    compiled = torch.compile(chain, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), chain(*args), atol=2e-2, rtol=2e-2)
        times = {
            "fused": bench(lambda: gm(*args)),
            "eager": bench(lambda: chain(*args)),
            "compile": bench(lambda: compiled(*args)),
        }
        try:
            times["fused_gpu"] = graph_bench(lambda: gm(*args), return_mode="median")
        except Exception as error:  # noqa: BLE001 - a capture failure is reported, not fatal
            print(f"# fused GPU: CUDA graph capture failed: {str(error)[:200]}", flush=True)
            times["fused_gpu"] = float("nan")
    return times | {"bytes": float(group.bytes)}


def report_line(length: int, size: str, dtype: str, result: dict[str, float], peak: float | None) -> str:
    cells = [f"{length:>3} {size:>4} {dtype:>4}"]
    for name in ("fused", "eager", "compile", "fused_gpu"):
        gbps = result["bytes"] / (result[name] * 1e-3) / 1e9
        share = f" {100 * gbps / peak:5.1f}%" if peak else ""
        cells.append(f"{result[name]:8.3f} ms {gbps:7.0f} GB/s{share}")
    cells.insert(4, f"{result['eager'] / result['fused']:5.2f}x  {result['compile'] / result['fused']:5.2f}x")
    return " | ".join(cells)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--ops", nargs="+", type=int, default=[2, 3, 4, 5, 6], choices=range(2, len(STEPS) + 1)
    )
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth, GB/s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu: no CUDA/ROCm device is available; nothing to benchmark.")
        return 0
    try:
        from triton.testing import do_bench, do_bench_cudagraph
    except ImportError:
        print("kernels_gpu: Triton is not installed; fused groups would run their original ops.")
        return 0
    name = torch.cuda.get_device_name()
    peak = peak_gbps(name, args.peak_gbps)
    print(f"# {name}; peak {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    print(
        "ops size dtype | fused | eager | torch.compile | eager/fused  compile/fused | fused GPU (CUDA graph)"
    )
    for dtype in args.dtypes:
        for size in args.sizes:
            for length in args.ops:
                result = measure(Chain(length), SIZES[size], DTYPES[dtype], do_bench, do_bench_cudagraph)
                print(report_line(length, size, dtype, result, peak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
