"""Measure a local device so the cost model prices nodes at real speeds instead of datasheet guesses.

``calibrate()`` times three things on one device of this host: matmuls (FLOP/s per dtype of the GEMMs
a training step runs: forward, input- and weight-gradient layouts, square and wide), memory-bound
pointwise ops (bytes read + written per second) and an add on 1-element tensors (the per-kernel
overhead). Each figure is a median over repeated calls after a warm-up, so one slow call (a page
fault, a neighbour's burst) does not move it. The result is a ``Calibration``
(``hetcc.hardware.calibration``): saved per machine as YAML/JSON, and turned into a calibrated
``DeviceType`` by ``apply`` or a calibrated ``Cluster`` by ``apply_to_cluster``.

torch is imported only when measuring, so reading calibration files needs no torch.
"""

from __future__ import annotations

import contextlib
import datetime
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
from hetcc.hardware.calibration import Calibration, apply, apply_to_cluster
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
    forward_s, backward_s = _forward_backward_s(lambda: module(x), lambda y: y.backward(), sync, plan)
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
        plan,
    )
    return {"host_fused_op_s": forward_s, "host_fused_backward_op_s": backward_s}


def _forward_backward_s(forward, backward, sync: Callable[[], None], plan: _Plan) -> tuple[float, float]:
    """(seconds of ``forward()``, seconds ``backward(forward())`` adds to it), each a median."""
    forward_s = _seconds_per_call(forward, sync, plan.overhead_budget_s)
    both_s = _seconds_per_call(lambda: backward(forward()), sync, plan.overhead_budget_s)
    return forward_s, max(both_s - forward_s, 0.0)


@dataclass(frozen=True)
class _Plan:
    """How much work one calibration does: matmul sizes, stream length, and time budgets."""

    matmul_sizes: Sequence[int]  # square n×n @ n×n, tried smallest first
    matmul_budget_s: float  # timing budget per size; a size whose one call would exceed it is skipped
    stream_elements: int  # fp32 elements per tensor of the streaming add (three tensors)
    stream_budget_s: float
    overhead_budget_s: float
    overhead_calls: int  # tiny ops per timed sample (a sample of one call is mostly timer noise)


_PLANS = {
    # CPU: a few seconds in all. 64 MiB per stream tensor is well past any last-level cache.
    ("cpu", False): _Plan((256, 512, 1024, 2048), 0.5, 16 * 2**20, 0.5, 0.2, 100),
    ("cpu", True): _Plan((128, 256, 512), 0.05, 4 * 2**20, 0.1, 0.05, 100),
    # GPU: sizes where a GEMM reaches its sustained rate; 512 MiB per stream tensor dwarfs any L2.
    ("cuda", False): _Plan((1024, 2048, 4096, 8192), 0.3, 128 * 2**20, 0.3, 0.2, 1000),
    ("cuda", True): _Plan((512, 1024, 2048), 0.1, 32 * 2**20, 0.1, 0.05, 1000),
}


def calibrate(
    device: str = "cpu",
    *,
    dtypes: Sequence[str] = ("fp32",),
    quick: bool = False,
    type_name: str | None = None,
) -> Calibration:
    """Measure matmul FLOP/s per dtype, streaming bandwidth and per-kernel overhead of one device.

    ``device`` is a torch device string ("cpu", "cuda", "cuda:1"; ROCm GPUs are "cuda" too).
    ``dtypes`` are peak keys or torch dtype names ("fp32", "bf16", "fp16"; "tf32" on CUDA).
    ``quick`` shrinks the work to well under two seconds on a CPU (coarser figures, for tests).
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
    calibration = Calibration(
        device_type=name,
        device_name=device_name,
        host=socket.gethostname(),
        torch_version=str(torch.__version__),  # a str subclass that YAML cannot write
        threads=torch.get_num_threads(),
        matmul_flops={key: _matmul_flops(torch, dev, key, plan, sync) for key in keys},
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
    fn: Callable[[], object], sync: Callable[[], None], budget_s: float, calls: int = 1, warmup: int = 2
) -> float:
    """Median seconds per call of ``fn``: samples of ``calls`` calls each, for about ``budget_s``.

    The device is synchronised before each sample starts and after it ends, so asynchronous (GPU)
    work is counted where it runs, not where it is queued. At least 3 samples are taken.
    """
    for _ in range(warmup):
        fn()
    sync()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 200):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
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


def _matmul_flops(torch: Any, dev: Any, key: str, plan: _Plan, sync: Callable[[], None]) -> float:
    """Sustained FLOP/s of the GEMMs training runs, at the largest size the budget allows.

    The size is found with square n×n @ n×n products. At that size the rate is total FLOPs over total
    time of a training mix: a square and a wide (n/4 × n @ n × 4n, like a vocabulary projection)
    product, each in the three layouts of a linear layer (forward ``x @ w``, input gradient
    ``g @ wᵀ``, weight gradient ``xᵀ @ g``). Transposed and skinny operands run well below the square
    peak on most BLAS libraries, so a square-only figure would make every prediction optimistic.
    """
    dtype = getattr(torch, _TORCH_DTYPES[key])
    size, last_s = plan.matmul_sizes[0], 0.0
    with _float32_matmul_precision(torch, "high" if key == "tf32" else "highest"), torch.no_grad():
        for n in plan.matmul_sizes:
            if last_s * 8 > plan.matmul_budget_s / 2:
                break  # the next size (8× the work, plus warm-up) would overrun its budget
            last_s, size = _matmul_seconds(torch, dev, (n, n, n), dtype, plan, sync, "nn"), n
        shapes = [(size, size, size), (max(size // 4, 1), size, 4 * size)]
        flops = total_s = 0.0
        for m, k, n in shapes:
            for layout in ("nn", "nt", "tn"):
                total_s += _matmul_seconds(torch, dev, (m, k, n), dtype, plan, sync, layout)
                flops += 2 * m * k * n
    return flops / total_s


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
    return _seconds_per_call(lambda: torch.mm(a, b, out=out), sync, plan.matmul_budget_s)


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
