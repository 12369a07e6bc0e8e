"""Measure a local device so the cost model prices nodes at real speeds instead of datasheet guesses.

``calibrate()`` times these on one device of this host: matmuls (FLOP/s per dtype of the GEMMs a
training step runs: forward, input- and weight-gradient layouts, square and wide), and the same by
size, aligned and not (a curve: small GEMMs reach far less than large ones), scaled dot-product
attention forward and backward, memory-bound pointwise ops (bytes read + written per second) and an
add on 1-element tensors (the per-kernel overhead). Each figure is a median over repeated calls after a
warm-up, so one slow call (a page fault, a neighbour's burst) does not move it. The result is a ``Calibration``
(``hetcc.hardware.calibration``): saved per machine as YAML/JSON, and turned into a calibrated
``DeviceType`` by ``apply`` or a calibrated ``Cluster`` by ``apply_to_cluster``.

torch is imported only when measuring, so reading calibration files needs no torch.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import math
import pathlib
import platform
import re
import socket
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hetcc.errors import ClusterError
from hetcc.hardware.calibration import Calibration, Curve, apply, apply_to_cluster
from hetcc.hardware.presets import PRESETS, flops_key, type_key

__all__ = ["Calibration", "apply", "apply_to_cluster", "calibrate", "preset_for_device_name"]

log = logging.getLogger(__name__)

# Matmul dtypes calibrate can time. tf32 is fp32 storage on tensor cores: CUDA only.
_TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


HOST_CHAIN_LAYERS = 16  # repeats of the four ops in the chain ``_host_op_s`` times


def _host_op_s(torch: Any, dev: Any, plan: _Plan, sync: Callable[[], None]) -> dict[str, float]:
    """Host seconds per graph op, forward and backward, where the device work is negligible: an fx
    GraphModule of HOST_CHAIN_LAYERS x (linear, layer norm, tanh, residual add), a transformer's op
    mix, on 8 x 64 tensors, run the way a stage runs (Python graph code, the dispatcher, autograd),
    so what is timed is the host."""
    import torch.fx

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(HOST_CHAIN_LAYERS))
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(64) for _ in range(HOST_CHAIN_LAYERS))

        def forward(self, x):
            for linear, norm in zip(self.layers, self.norms):
                x = x + torch.tanh(norm(linear(x)))
            return x.sum()

    leaves = torch.fx.Tracer()
    leaves.is_leaf_module = lambda module, name: False  # the functional ops, as an exported graph has them
    module = torch.fx.GraphModule(Chain(), leaves.trace(Chain())).to(dev)
    ops = sum(node.op in ("call_function", "call_method") for node in module.graph.nodes)
    x = torch.randn(8, 64, device=dev, requires_grad=True)
    forward_s, backward_s = _forward_backward_s(
        lambda: module(x), lambda y: y.backward(), sync, plan.overhead_budget_s
    )
    return {"host_op_s": forward_s / ops, "host_backward_op_s": backward_s / ops}


def _host_fused_op_s(torch: Any, dev: Any, plan: _Plan, sync: Callable[[], None]) -> dict[str, float]:
    """Host seconds of one fused-group call (``hetcc.kernels.launch.fused``, what a stage's fused node
    calls: its cached launch, then the Triton launch; on a CPU without Triton the group's ops),
    forward and backward, on an 8 x 64 group of two ops whose kernels take next to nothing."""
    from hetcc.kernels import group as g
    from hetcc.kernels.launch import fused
    from hetcc.kernels.op import register_group

    spec = g.TensorSpec("x", (8, 64), torch.float32, flat=True, broadcast=False, param=False)
    instrs = (
        g.Instr("mul", (("in", 0), ("const", 2.0)), torch.float32, "mul = x * 2.0"),
        g.Instr("tanh", (("tmp", 0),), torch.float32, "tanh = tanh(mul)"),
    )
    key = g.structural_key("pointwise", (spec,), instrs, (1,), "generated")
    group = g.FusionGroup(
        g.group_name(instrs, key),
        "pointwise",
        (8, 64),
        (spec,),
        instrs,
        (1,),
        ("tanh",),
        "generated",
        dev.type,
    )
    register_group(group)
    x = torch.randn(8, 64, device=dev, requires_grad=True)
    grad = torch.ones(8, 64, device=dev)
    forward_s, backward_s = _forward_backward_s(
        lambda: fused([x], group.name),
        lambda y: torch.autograd.backward(y, [grad]),
        sync,
        plan.overhead_budget_s,
    )
    return {"host_fused_op_s": forward_s, "host_fused_backward_op_s": backward_s}


def _forward_backward_s(forward, backward, sync: Callable[[], None], budget_s: float, sample_s: float = 0.0):
    """(seconds of ``forward()``, seconds ``backward(forward())`` adds to it), each a median."""
    forward_s = _seconds_per_call(forward, sync, budget_s, sample_s=sample_s)
    both_s = _seconds_per_call(lambda: backward(forward()), sync, budget_s, sample_s=sample_s)
    return forward_s, max(both_s - forward_s, 0.0)


@dataclass(frozen=True)
class _Plan:
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


_PLANS = {
    # CPU: several seconds per dtype. 64 MiB per stream tensor is well past any last-level cache.
    ("cpu", False): _Plan((64, 128, 256), (512, 1024, 2048), 0.1, 0.25, 2e-4,
                          ((1, 8, 256, 64), (1, 8, 1024, 64)), 16 * 2**20, 0.5, 0.2, 100),
    ("cpu", True): _Plan((64, 128, 256), (512,), 0.02, 0.025, 2e-4, ((1, 4, 128, 64),), 4 * 2**20, 0.1, 0.05, 100),
    # GPU: up to where a GEMM reaches its sustained rate; 512 MiB per stream tensor dwarfs any L2.
    ("cuda", False): _Plan((64, 128, 256, 512, 1024), (2048, 4096, 8192), 0.05, 0.15, 2e-3,
                           ((2, 8, 512, 64), (4, 16, 2048, 128)), 128 * 2**20, 0.3, 0.2, 1000),
    ("cuda", True): _Plan((256, 512), (1024, 2048), 0.02, 0.05, 2e-3, ((4, 16, 1024, 64),),
                          32 * 2**20, 0.1, 0.05, 1000),
}  # fmt: skip


def calibrate(
    device: str = "cpu",
    *,
    dtypes: Sequence[str] = ("fp32",),
    quick: bool = False,
    type_name: str | None = None,
) -> Calibration:
    """Measure matmul FLOP/s per dtype (and by size, and attention's), streaming bandwidth and
    per-kernel overhead of one device.

    ``device`` is a torch device string ("cpu", "cuda", "cuda:1"; ROCm GPUs are "cuda" too).
    ``dtypes`` are peak keys or torch dtype names ("fp32", "bf16", "fp16"; "tf32" on CUDA).
    ``quick`` shrinks the work to about a second per dtype on a CPU (coarser figures, for tests).
    ``type_name`` names the device type the figures are for; by default "cpu" on a CPU and the
    preset closest to the GPU's name and memory. CPU figures depend on ``torch.get_num_threads()``,
    which is recorded: calibrate with the thread count the pipeline stages will run with.
    """
    torch = _torch()
    dev, kind = _device(torch, device)
    keys = _dtype_keys(dtypes, kind)
    plan = _PLANS[(kind, quick)]
    sync = (lambda: torch.cuda.synchronize(dev)) if kind == "cuda" else (lambda: None)
    device_name, name = _identify(torch, dev, kind, type_name)
    matmul_flops, curves = {}, {}
    for key in keys:
        matmul_flops[key], by_class = _gemm_curves(torch, dev, key, plan, sync)
        for op_class, points in (by_class | _attention_curves(torch, dev, key, plan, sync)).items():
            curves.setdefault(op_class, {})[key] = points
    calibration = Calibration(
        device_type=name,
        device_name=device_name,
        host=socket.gethostname(),
        torch_version=str(torch.__version__),  # a str subclass that YAML cannot write
        threads=torch.get_num_threads(),
        matmul_flops=matmul_flops,
        flops_by_size=curves,
        memory_bandwidth_bps=_stream_bandwidth_bps(torch, dev, plan, sync),
        kernel_overhead_s=_kernel_overhead_s(torch, dev, plan, sync),
        **(
            _host_op_s(torch, dev, plan, sync) | _host_fused_op_s(torch, dev, plan, sync)
            if kind == "cuda"
            else {}
        ),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    log.info("%s", calibration.describe())
    return calibration


# ---- what is being measured ----------------------------------------------------------------------
def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ClusterError("calibration needs torch", hint="pip install torch") from None
    return torch


def _device(torch: Any, device: str) -> tuple[Any, str]:
    """The torch device and its kind ("cpu" or "cuda"); errors say what exists here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ClusterError(
            f"calibrate: cannot read device {device!r}: {error}", hint='use "cpu" or "cuda:0"'
        ) from None
    if dev.type == "cpu":
        return dev, "cpu"
    if dev.type != "cuda":
        raise ClusterError(
            f"calibrate: device type {dev.type!r} is not supported", hint='use "cpu" or "cuda"'
        )
    if not torch.cuda.is_available():
        raise ClusterError(
            f"calibrate: {device!r} asked for, but torch sees no CUDA/ROCm GPU", hint='use "cpu"'
        )
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ClusterError(f"calibrate: no {dev}; this host has {torch.cuda.device_count()} GPU(s)")
    return dev, "cuda"


def _dtype_keys(dtypes: Sequence[str], kind: str) -> list[str]:
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    keys = list(dict.fromkeys(flops_key(d) for d in dtypes))
    for key in keys:
        if key not in _TORCH_DTYPES:
            raise ClusterError(
                f"calibrate: cannot time {key} matmuls", hint="measure fp32, bf16, fp16 or tf32"
            )
        if key == "tf32" and kind != "cuda":
            raise ClusterError("calibrate: tf32 is a GPU tensor-core mode; a CPU has no tf32 matmul")
    if not keys:
        raise ClusterError("calibrate: dtypes is empty", hint='e.g. dtypes=("fp32", "bf16")')
    return keys


def _identify(torch: Any, dev: Any, kind: str, type_name: str | None) -> tuple[str, str]:
    """(what the hardware calls itself, the device type name the figures are filed under)."""
    if kind == "cpu":
        return _cpu_model(), type_name or "cpu"
    device_name = torch.cuda.get_device_name(dev)
    if type_name:
        return device_name, type_name
    memory_bytes = torch.cuda.get_device_properties(dev).total_memory
    preset = preset_for_device_name(device_name, memory_bytes)
    if preset is None:
        log.warning("no preset matches GPU %r; filing its calibration under that name", device_name)
    return device_name, preset or device_name


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def preset_for_device_name(device_name: str, memory_bytes: int | None = None) -> str | None:
    """The preset a GPU's reported name denotes ("NVIDIA A100-SXM4-80GB" -> "A100-80GB"), or None.

    A preset matches when its model (name less memory size and form factor: "A100", "MI250X",
    "RTX4090") equals a word or two adjacent words of the name; among several (A100 40 vs 80 GB,
    MI250X package vs one GCD) the one with the closest memory size wins.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w]
    phrases = set(words) | {a + b for a, b in zip(words, words[1:])}
    candidates = [t for t in PRESETS.values() if t.vendor != "cpu" and _model_key(t.name) in phrases]
    if not candidates:
        return None
    if memory_bytes:
        candidates.sort(key=lambda t: abs(math.log(t.memory_bytes / memory_bytes)))
    return candidates[0].name


def _model_key(preset_name: str) -> str:
    return type_key(re.sub(r"-(\d+GB|SXM|GCD)$", "", preset_name))


# ---- timing --------------------------------------------------------------------------------------
def _seconds_per_call(
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


def _gemm_curves(torch: Any, dev: Any, key: str, plan: _Plan, sync) -> tuple[float, dict[str, Curve]]:
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
    dtype = getattr(torch, _TORCH_DTYPES[key])
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


def _linear_s(torch: Any, dev: Any, mkn, dtype: Any, plan: _Plan, sync) -> float:
    """Seconds of the three GEMMs of a linear layer with m tokens, k inputs and n outputs, as training
    runs them: (m×k) @ (k×n) forward, (m×n) @ (n×k) input gradient, (n×m) @ (m×k) weight gradient."""
    m, k, n = mkn
    gemms = (((m, k, n), "nt"), ((m, n, k), "nn"), ((n, m, k), "tn"))
    return sum(_matmul_seconds(torch, dev, shape, dtype, plan, sync, layout) for shape, layout in gemms)


def _attention_curves(torch: Any, dev: Any, key: str, plan: _Plan, sync) -> dict[str, Curve]:
    """FLOP/s of ``scaled_dot_product_attention``, {"sdpa": forward, "sdpa_backward": backward}, at each
    of ``plan.attention_shapes``; both points stand at the forward's FLOPs (``_attention_point``)."""
    dtype = getattr(torch, _TORCH_DTYPES[key])
    with _float32_matmul_precision(torch, "high" if key == "tf32" else "highest"):
        points = [_attention_point(torch, dev, shape, dtype, plan, sync) for shape in plan.attention_shapes]
    backward = tuple((f, rate) for f, _, rate in points if rate is not None)
    forward = {"sdpa": tuple((f, rate) for f, rate, _ in points)}
    return forward | ({"sdpa_backward": backward} if backward else {})


def _attention_point(
    torch: Any, dev: Any, shape, dtype, plan: _Plan, sync
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
    forward_s, backward_s = _forward_backward_s(attention, gradients, sync, plan.gemm_budget_s, plan.sample_s)
    flops = float(sdpa_flop_count(q.shape, k.shape, v.shape))
    backward_flops = float(sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape))
    return flops, flops / forward_s, backward_flops / backward_s if backward_s > 0 else None


def _matmul_seconds(torch: Any, dev: Any, mkn, dtype: Any, plan: _Plan, sync, layout: str) -> float:
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
    return _seconds_per_call(
        lambda: torch.mm(a, b, out=out), sync, plan.gemm_budget_s, sample_s=plan.sample_s
    )


def _stream_bandwidth_bps(torch: Any, dev: Any, plan: _Plan, sync: Callable[[], None]) -> float:
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
        seconds = sum(_seconds_per_call(op, sync, plan.stream_budget_s / len(mix)) for op, _ in mix)
    return sum(tensors for _, tensors in mix) * a.numel() * a.element_size() / seconds


def _kernel_overhead_s(torch: Any, dev: Any, plan: _Plan, sync: Callable[[], None]) -> float:
    """Seconds per op when the op does no work: an add on 1-element tensors (dispatch + launch)."""
    with torch.no_grad():
        a, b, c = (torch.ones(1, device=dev) for _ in range(3))
        return _seconds_per_call(
            lambda: torch.add(a, b, out=c), sync, plan.overhead_budget_s, calls=plan.overhead_calls
        )
