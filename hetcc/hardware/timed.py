"""What ``hardware.measure.calibrate`` times on a device, and how: the sizes and time budgets per device
kind (``CalibrationPlan``, ``PLANS``), the timing primitive (``seconds_per_call``: medians over synchronised
samples), and the kernel measurements (GEMM and attention FLOP/s by size, streaming bandwidth, the
per-kernel overhead). torch is passed in: this module imports none, so reading calibrations needs none.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hetcc.hardware.calibration import Curve

# Matmul dtypes calibrate can time. tf32 is fp32 storage on tensor cores: CUDA only.
TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class CalibrationPlan:
    """How much work one calibration does: GEMM and attention sizes, stream length, and time budgets."""

    gemm_widths: Sequence[int]  # n of the n×n @ n×n GEMMs of the curve, always timed
    larger_widths: Sequence[int]  # ... then these, smallest first, while one call fits largest_call_s
    gemm_budget_s: float  # timing budget per GEMM (and attention call) timed
    largest_call_s: float  # a larger width whose one call would take longer is not timed
    sample_s: float  # a timed sample repeats a short call until it lasts this long (a GPU's sync is slow)
    attention_shapes: Sequence[tuple[int, int, int, int]]  # (batch, heads, sequence, head dim)
    stream_elements: int  # fp32 elements per tensor of the streaming add (three tensors)
    stream_budget_s: float
    overhead_budget_s: float
    overhead_calls: int  # tiny ops per timed sample (a sample of one call is mostly timer noise)


PLANS = {
    # CPU: several seconds per dtype. 64 MiB per stream tensor is well past any last-level cache.
    ("cpu", False): CalibrationPlan((64, 128, 256), (512, 1024, 2048), 0.1, 0.25, 2e-4,
                          ((1, 8, 256, 64), (1, 8, 1024, 64)), 16 * 2**20, 0.5, 0.2, 100),
    ("cpu", True): CalibrationPlan((64, 128, 256), (512,), 0.02, 0.025, 2e-4, ((1, 4, 128, 64),), 4 * 2**20, 0.1, 0.05, 100),
    # GPU: up to where a GEMM reaches its sustained rate; 512 MiB per stream tensor dwarfs any L2.
    ("cuda", False): CalibrationPlan((64, 128, 256, 512, 1024), (2048, 4096, 8192), 0.05, 0.15, 2e-3,
                           ((2, 8, 512, 64), (4, 16, 2048, 128)), 128 * 2**20, 0.3, 0.2, 1000),
    ("cuda", True): CalibrationPlan((256, 512), (1024, 2048), 0.02, 0.05, 2e-3, ((4, 16, 1024, 64),),
                          32 * 2**20, 0.1, 0.05, 1000),
}  # fmt: skip


def forward_backward_s(forward, backward, sync: Callable[[], None], budget_s: float, sample_s: float = 0.0):
    """(seconds of ``forward()``, seconds ``backward(forward())`` adds to it), each a median."""
    forward_s = seconds_per_call(forward, sync, budget_s, sample_s=sample_s)
    both_s = seconds_per_call(lambda: backward(forward()), sync, budget_s, sample_s=sample_s)
    return forward_s, max(both_s - forward_s, 0.0)


def seconds_per_call(
    fn: Callable[[], object],
    sync: Callable[[], None],
    budget_s: float,
    calls: int = 1,
    warmup: int = 2,
    sample_s: float = 0.0,
) -> float:
    """Median seconds per call of ``fn``: samples of ``calls`` calls each, for about ``budget_s``.

    The device is synchronised before each sample starts and after it ends, so asynchronous (GPU)
    work is counted where it runs, not where it is queued. At least 3 samples are taken. A sample
    shorter than ``sample_s`` is not kept: the next ones repeat the call more often, so a short call
    is not timed with the sync's latency (nor a lazy first load's).
    """
    sync()
    for _ in range(warmup):
        start = time.perf_counter()
        fn()
        sync()
        if time.perf_counter() - start > budget_s:
            break  # one call longer than the budget has warmed up whatever it needed
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 200):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed < sample_s and calls < 1000:
            calls = min(1000, max(2 * calls, math.ceil(calls * sample_s / max(elapsed, 1e-9))))
            continue
        samples.append(elapsed / calls)
    return statistics.median(samples)


@contextlib.contextmanager
def _float32_matmul_precision(torch: Any, level: str) -> Iterator[None]:
    """fp32 is timed at "highest" (true fp32) and tf32 at "high" (tensor cores); restored after."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(level)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


_LAYOUTS = ("nn", "nt", "tn")


def gemm_curves(
    torch: Any, dev: Any, key: str, plan: CalibrationPlan, sync
) -> tuple[float, dict[str, Curve]]:
    """(sustained FLOP/s of the GEMMs training runs, FLOP/s by size: {"gemm": .., "gemm_unaligned": ..}).

    A point of the curve is total FLOPs over total time of the three layouts of a linear layer's
    GEMMs (forward ``x @ wᵀ``, input gradient ``g @ w``, weight gradient ``gᵀ @ x``) of n×n matrices,
    for each width n of the plan, then larger ones while one call, at the best rate seen, would take
    at most ``plan.largest_call_s`` (the best rate: one slow small call, a descheduled thread, does not
    end the curve); unaligned, the same with an odd output width n - 1, at every other width down
    from the second largest. The sustained rate is measured at the largest width, on the square and a
    wide (n/4 × n @ n × 4n, like a vocabulary projection) product: transposed and skinny operands run
    well below the square peak on most BLAS libraries, so a square-only figure would be optimistic.
    """
    dtype = getattr(torch, TORCH_DTYPES[key])
    aligned: list[tuple[float, float, float]] = []  # (width, FLOPs per call, seconds of the three)
    with _float32_matmul_precision(torch, "high" if key == "tf32" else "highest"), torch.no_grad():
        for n in (*plan.gemm_widths, *plan.larger_widths):
            best_rate = max((3 * f / s for _, f, s in aligned), default=math.inf)
            if n not in plan.gemm_widths and 2.0 * n**3 / best_rate > plan.largest_call_s:
                break  # this width (and the next) would overrun its budget
            aligned.append((n, 2.0 * n**3, _linear_s(torch, dev, (n, n, n), dtype, plan, sync)))
        unaligned = [(n, 2.0 * n * n * (n - 1), _linear_s(torch, dev, (n, n, n - 1), dtype, plan, sync))
                     for n, _, _ in aligned[-2::-2] or aligned]  # fmt: skip
        size, square_flops, square_s = aligned[-1][0], 3 * aligned[-1][1], aligned[-1][2]
        wide = (max(size // 4, 1), size, 4 * size)
        wide_s = sum(_matmul_seconds(torch, dev, wide, dtype, plan, sync, layout) for layout in _LAYOUTS)
    curves = {name: tuple((f, 3 * f / s) for _, f, s in points)
              for name, points in (("gemm", aligned), ("gemm_unaligned", unaligned))}  # fmt: skip
    return (square_flops + 3 * 2.0 * math.prod(wide)) / (square_s + wide_s), curves


def _linear_s(torch: Any, dev: Any, mkn, dtype: Any, plan: CalibrationPlan, sync) -> float:
    """Seconds of the three GEMMs of a linear layer with m tokens, k inputs and n outputs, as training
    runs them: (m×k) @ (k×n) forward, (m×n) @ (n×k) input gradient, (n×m) @ (m×k) weight gradient."""
    m, k, n = mkn
    gemms = (((m, k, n), "nt"), ((m, n, k), "nn"), ((n, m, k), "tn"))
    return sum(_matmul_seconds(torch, dev, shape, dtype, plan, sync, layout) for shape, layout in gemms)


def attention_curves(torch: Any, dev: Any, key: str, plan: CalibrationPlan, sync) -> dict[str, Curve]:
    """FLOP/s of ``scaled_dot_product_attention``, {"sdpa": forward, "sdpa_backward": backward}, at each
    of ``plan.attention_shapes``; both points stand at the forward's FLOPs (``_attention_point``)."""
    dtype = getattr(torch, TORCH_DTYPES[key])
    with _float32_matmul_precision(torch, "high" if key == "tf32" else "highest"):
        points = [_attention_point(torch, dev, shape, dtype, plan, sync) for shape in plan.attention_shapes]
    backward = tuple((f, rate) for f, _, rate in points if rate is not None)
    forward = {"sdpa": tuple((f, rate) for f, rate, _ in points)}
    return forward | ({"sdpa_backward": backward} if backward else {})


def _attention_point(
    torch: Any, dev: Any, shape, dtype, plan: CalibrationPlan, sync
) -> tuple[float, float, float | None]:
    """(forward FLOPs, forward FLOP/s, backward FLOP/s or None where lost in noise) of one attention call
    as exported Hugging Face models make it (a boolean causal mask broadcast over the heads) on inputs
    that need gradients. FLOPs are counted as ``passes.flops`` counts them (torch's formulas, which
    ignore the mask)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    batch, _, seq, _ = shape
    mask = torch.ones(seq, seq, device=dev, dtype=torch.bool).tril().expand(batch, 1, seq, seq)
    attention = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, attn_mask=mask)
    gradients = functools.partial(torch.autograd.grad, inputs=(q, k, v), grad_outputs=torch.ones_like(q))
    forward_s, backward_s = forward_backward_s(attention, gradients, sync, plan.gemm_budget_s, plan.sample_s)
    flops = float(sdpa_flop_count(q.shape, k.shape, v.shape))
    backward_flops = float(sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape))
    return flops, flops / forward_s, backward_flops / backward_s if backward_s > 0 else None


def _matmul_seconds(torch: Any, dev: Any, mkn, dtype: Any, plan: CalibrationPlan, sync, layout: str) -> float:
    """Seconds of an (m×k) @ (k×n) product whose operands are stored transposed per ``layout``."""
    m, k, n = mkn
    a = (
        torch.randn(k, m, device=dev).to(dtype).t()
        if layout == "tn"
        else torch.randn(m, k, device=dev).to(dtype)
    )
    b = (
        torch.randn(n, k, device=dev).to(dtype).t()
        if layout == "nt"
        else torch.randn(k, n, device=dev).to(dtype)
    )
    out = torch.empty(m, n, device=dev, dtype=dtype)
    return seconds_per_call(lambda: torch.mm(a, b, out=out), sync, plan.gemm_budget_s, sample_s=plan.sample_s)


def stream_bandwidth_bps(torch: Any, dev: Any, plan: CalibrationPlan, sync: Callable[[], None]) -> float:
    """Bytes/s that memory-bound ops reach on fp32 tensors far larger than any cache.

    A mix of what models run between matmuls: ``add`` and ``mul`` (two reads, a write) and ``exp`` and
    ``tanh`` (a read, a write), total bytes over total time. On a GPU all four run at memory speed; on a
    CPU core the transcendental ones are compute-bound, and an add-only figure would make every
    softmax, GELU and log-softmax look several times cheaper than it is.
    """
    with torch.no_grad():
        a, b, c = (torch.ones(plan.stream_elements, device=dev) for _ in range(3))
        mix = [(lambda: torch.add(a, b, out=c), 3), (lambda: torch.mul(a, b, out=c), 3),
               (lambda: torch.exp(a, out=c), 2), (lambda: torch.tanh(a, out=c), 2)]  # fmt: skip
        seconds = sum(seconds_per_call(op, sync, plan.stream_budget_s / len(mix)) for op, _ in mix)
    return sum(tensors for _, tensors in mix) * a.numel() * a.element_size() / seconds


def kernel_overhead_s(torch: Any, dev: Any, plan: CalibrationPlan, sync: Callable[[], None]) -> float:
    """Seconds per op when the op does no work: an add on 1-element tensors (dispatch + launch)."""
    with torch.no_grad():
        a, b, c = (torch.ones(1, device=dev) for _ in range(3))
        return seconds_per_call(
            lambda: torch.add(a, b, out=c), sync, plan.overhead_budget_s, calls=plan.overhead_calls
        )
