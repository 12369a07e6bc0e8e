"""Codec encode/decode speed on a GPU: the fused Triton kernels (int8, int4, fp8) against the same codec's
torch path, and each call's share of the device's measured copy bandwidth, on GPT-2-sized activations.

    python benchmarks/codecs_gpu.py [--device cuda] [--rows 8192] [--hidden 1024]

``--device cpu`` dry-runs it here (the torch path only: the kernels need a GPU or the interpreter).
Also checks that the kernels write the torch path's bytes on the device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetcc.wire import CODECS, get_codec, quantize  # noqa: E402

REPEATS = 50
TRITON_CODECS = ("int8", "int4", "fp8")  # the codecs with fused kernels (hetcc.wire.triton_codecs)


def _timed(fn, device: torch.device) -> float:
    """Median seconds of ``fn()`` over REPEATS calls (synchronised on a GPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _copy_bandwidth(x: torch.Tensor) -> float:
    """Bytes/s of a device copy of ``x`` (read + write)."""
    out = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _timed(lambda: out.copy_(x), x.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device(args.device)
    x = torch.randn(args.rows, args.hidden, device=device)
    bandwidth = _copy_bandwidth(x)
    print(f"{args.rows} x {args.hidden} fp32 on {device}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(
        f"{'codec':<14} {'ratio':>6} {'encode us':>10} {'decode us':>10} {'enc BW share':>12} {'torch enc us':>12} {'same bytes':>10}"
    )
    for name in CODECS:
        if name == "none":
            continue
        codec = get_codec(name)
        payload = codec.encode(x)
        encode_s = _timed(lambda codec=codec: codec.encode(x), device)
        decode_s = _timed(lambda codec=codec, p=payload: codec.decode(p, x.shape, x.dtype), device)
        moved = x.numel() * 4 + payload.numel()
        torch_s, same = float("nan"), "-"
        if name in TRITON_CODECS and quantize.runs_triton(x):
            reference = codec.encode(x.cpu())
            same = "yes" if torch.equal(payload.cpu(), reference) else "NO"
            original = quantize.runs_triton
            quantize.runs_triton = lambda t: False  # the same codec's torch path, on the device
            try:
                torch_s = _timed(lambda codec=codec: codec.encode(x), device)
            finally:
                quantize.runs_triton = original
        print(f"{name:<14} {payload.numel() / (x.numel() * 4):>6.3f} {encode_s * 1e6:>10.1f} {decode_s * 1e6:>10.1f} "
              f"{moved / encode_s / bandwidth:>12.0%} {torch_s * 1e6:>12.1f} {same:>10}")  # fmt: skip


if __name__ == "__main__":
    main()
